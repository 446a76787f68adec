"""Prefix-affinity routing: which replica a request goes to.

A replica's prefix cache only helps the requests that reach it. Sending a prompt to the replica
that served its first blocks before turns the aggregate cache of N replicas into N times the
cache of one; spreading prefix-sharing traffic round-robin makes every replica cache every
prefix and thrash once they no longer fit.

The prompt is cut into fixed-size blocks (characters of its text, or token ids when the client
sent ids) and each full block gets a chained hash, the hash of its parent's hash and its own
content, as the engine's block manager does for KV blocks: two prompts share the hash of block
i exactly when they share blocks 0..i. The router keeps a bounded table of recent block hashes
-> the replica that last served them (`PrefixTable`), and `choose_replica` (pure: it reads the
table and the loads and changes nothing) decides:

1. the longest prefix of the prompt's hashes found in the table names a replica that is still
   there and is not overloaded (its ongoing requests at most `max_imbalance` above the least
   loaded replica's): that replica (`affinity`);
2. it is overloaded: the least-loaded replica (`overloaded`);
3. no block is known: the least-loaded replica (`new`).

Ties for least loaded go to the replica owning the fewest table entries (so new prefixes
spread over the replicas even when requests arrive one at a time), then by name.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 256  # characters per text block (about 64 tokens of English)
BLOCK_TOKENS = 64  # token ids per block when the prompt is ids (the engine's default block)
MAX_BLOCKS = 128  # blocks hashed per prompt: the cost of a lookup stays bounded
TABLE_SIZE = 65536  # block hashes remembered (least recently used out)
MAX_IMBALANCE = 4  # ongoing requests above the least loaded replica's before it is overloaded


def block_hashes(blocks: Iterable[bytes], max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained 64-bit hashes of the blocks, in order: hash i covers blocks 0..i."""
    out: list[int] = []
    parent = b""
    for i, block in enumerate(blocks):
        if i >= max_blocks:
            break
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def text_hashes(
    text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """Hashes of the text's full blocks of `block_chars` characters (a partial last block is
    not hashed: the engine caches only full blocks either)."""
    n = min(len(text) // block_chars, max_blocks)
    return block_hashes(
        (text[i * block_chars : (i + 1) * block_chars].encode() for i in range(n)), max_blocks
    )


def token_hashes(
    ids: Sequence[int], block_tokens: int = BLOCK_TOKENS, max_blocks: int = MAX_BLOCKS
) -> list[int]:
    """Hashes of the token ids' full blocks of `block_tokens` ids."""
    n = min(len(ids) // block_tokens, max_blocks)
    return block_hashes(
        (
            b",".join(str(int(t)).encode() for t in ids[i * block_tokens : (i + 1) * block_tokens])
            for i in range(n)
        ),
        max_blocks,
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def request_hashes(path: str, body: Any) -> list[int]:
    """The routing key of an OpenAI request body (parsed JSON): block hashes of what the chat
    template or the completion prompt starts with. Anything else (other routes, bodies that do
    not parse) has no key and goes to the least-loaded replica.

    Chat: the tools (rendered near the top by most templates) and then each message's role
    and text, in order. Completions: the prompt, or the first one of a list; token ids are
    hashed as ids."""
    if not isinstance(body, dict):
        return []
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        parts = []
        if body.get("tools"):
            parts.append(json.dumps(body["tools"], sort_keys=True, separators=(",", ":")))
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"\x00{m.get('role', '')}\x00{_content_text(m.get('content'))}")
        return text_hashes("".join(parts))
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) for t in prompt):
                return token_hashes(prompt)
            prompt = prompt[0]
        if isinstance(prompt, str):
            return text_hashes(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return token_hashes(prompt)
    return []


class PrefixTable:
    """Block hash -> the replica that last served a prompt with that prefix; at most `size`
    entries, the least recently used dropped first. Not thread-safe: one router owns it."""

    def __init__(self, size: int = TABLE_SIZE) -> None:
        if size < 1:
            raise ValueError(f"size={size}: expected a positive integer")
        self.size = size
        self._map: OrderedDict[int, str] = OrderedDict()
        self._owned: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._map)

    def get(self, h: int) -> str | None:
        return self._map.get(h)

    def owned(self, replica: str) -> int:
        """How many entries point at the replica (a measure of what it has cached)."""
        return self._owned[replica]

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """The replica served a prompt with these block hashes."""
        for h in hashes:
            old = self._map.pop(h, None)
            if old is not None:
                self._owned[old] -= 1
            self._map[h] = replica
            self._owned[replica] += 1
        while len(self._map) > self.size:
            _, gone = self._map.popitem(last=False)
            self._owned[gone] -= 1

    def forget(self, replica: str) -> None:
        """The replica is gone (died, scaled down): its entries go with it."""
        for h in [h for h, r in self._map.items() if r == replica]:
            del self._map[h]
        self._owned.pop(replica, None)


@dataclass(frozen=True)
class Route:
    replica: str
    reason: str  # affinity | overloaded | new
    matched_blocks: int  # leading blocks of the prompt the table knew (0 if none)


def least_loaded(loads: Mapping[str, int], table: PrefixTable) -> str:
    return min(loads, key=lambda r: (loads[r], table.owned(r), r))


def longest_match(hashes: Sequence[int], table: PrefixTable, live: Mapping[str, Any]) -> tuple:
    """(replica, blocks) for the longest prefix of `hashes` the table maps to a live replica;
    (None, 0) if none."""
    for i in range(len(hashes) - 1, -1, -1):
        replica = table.get(hashes[i])
        if replica is not None and replica in live:
            return replica, i + 1
    return None, 0


def choose_replica(
    hashes: Sequence[int],
    table: PrefixTable,
    loads: Mapping[str, int],
    max_imbalance: int = MAX_IMBALANCE,
) -> Route:
    """The replica for a prompt with these block hashes, given the table and each live
    replica's ongoing requests (`loads`, at least one). Pure: nothing is changed."""
    if not loads:
        raise ValueError("no replicas to route to")
    fallback = least_loaded(loads, table)
    replica, matched = longest_match(hashes, table, loads)
    if replica is None:
        return Route(fallback, "new", 0)
    if loads[replica] - loads[fallback] > max_imbalance:
        return Route(fallback, "overloaded", matched)
    return Route(replica, "affinity", matched)


def round_robin(counter: int, replicas: Sequence[str]) -> str:
    """The baseline policy: the `counter`-th request goes to replica counter mod N (of the
    replicas in sorted order)."""
    if not replicas:
        raise ValueError("no replicas to route to")
    ordered = sorted(replicas)
    return ordered[counter % len(ordered)]
