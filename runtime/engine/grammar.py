"""Structured output: JSON schemas compiled to token masks with llguidance.

llguidance builds its token table from the artifact's tokenizer.json alone (no transformers),
computes a mask in tens of microseconds, and fills a whole batch's masks in parallel on its
own threads (LLExecutor) without holding the GIL. A schema is compiled once into a matcher kept
in a small cache; each request gets a deep copy of it, so the cost of a schema is paid on its
first request only. Masks are bit-packed int32 rows (bit j of word w allows token 32w + j),
built on the CPU and applied to the logits by a tensor op on whatever device they are on.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch as llg_torch
import torch

CACHE_SIZE = 256  # compiled schemas kept; a server sees few distinct schemas


class GrammarError(ValueError):
    """The schema is invalid or uses a feature the grammar engine does not support."""


def schema_key(schema: dict[str, Any]) -> str:
    """The schema's compact text in its own key order, which is the order the model writes an
    object's properties (OpenAI keeps it: a "reasoning" field declared before "answer" is
    written first). So schemas that differ only in key order are different grammars."""
    return json.dumps(schema, separators=(",", ":"))


def forced_prefix_error(matcher: llguidance.LLMatcher) -> str | None:
    """The parser's error on the schema's forced opening tokens, or None.

    llguidance compiles some schemas whose parser then gives up at once: an anyOf past its
    row limit fails after `{"`, a $ref cycle at the first mask, a recursion that every
    object must take forever in its forced tokens. Walking that forced prefix on a copy
    finds them when the schema is compiled (a 400), not after a 200 has started."""
    trial = matcher.deep_copy()
    trial.compute_bitmask()
    forced = trial.compute_ff_tokens()
    if forced and trial.consume_tokens(forced):
        trial.compute_bitmask()
    return parser_error(trial) if trial.is_error() else None


def parser_error(matcher: llguidance.LLMatcher) -> str:
    """The parser's message without the state dump llguidance appends to it."""
    return matcher.get_error().split("<state>")[0].strip()


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer and hands out per-request matchers."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=list(eos_ids)
        )
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles; the engine thread copies
        self._executor = llguidance.LLExecutor()

    def check(self, schema: dict[str, Any]) -> None:
        """Compile (or find) the schema now; raise GrammarError naming the problem."""
        self._compiled(schema_key(schema))

    def matcher(self, key: str) -> llguidance.LLMatcher:
        """A fresh matcher for one request, from the compiled schema with this key."""
        compiled = self._compiled(key)
        with self._lock:
            return compiled.deep_copy()

    def _compiled(self, key: str) -> llguidance.LLMatcher:
        with self._lock:
            return self._compiled_locked(key)

    def _compiled_locked(self, key: str) -> llguidance.LLMatcher:
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                key, defaults={"whitespace_flexible": False}
            )
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"the JSON schema cannot be compiled: {e}") from e
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"the JSON schema cannot be compiled: {parser_error(matcher)}")
        error = forced_prefix_error(matcher)
        if error is not None:
            raise GrammarError(
                f"the JSON schema exceeds the grammar engine's limits ({error}); simplify it: "
                "fewer anyOf branches, no $ref cycle, no recursion every object must take"
            )
        self._cache[key] = matcher
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return matcher

    def fill_masks(self, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
        """Bit-packed masks [B, ceil(V / 32)] int32; rows without a matcher allow everything.
        The constrained rows are computed in parallel on llguidance's threads."""
        masks = llg_torch.allocate_token_bitmask(len(matchers), self.vocab_size)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if rows:
            llg_torch.fill_next_token_bitmask_par(self._executor, rows, masks)
        return masks


def apply_mask(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Logits with every token the bit-packed masks forbid set to -inf, on logits.device."""
    V = logits.shape[-1]
    words = masks.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < V:  # tokens past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    return logits.masked_fill(~allowed[:, :V], float("-inf"))
