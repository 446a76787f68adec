"""Bookkeeping of the paged KV cache: which blocks each sequence owns, and the prefix cache.

The pool holds `num_blocks` blocks of `block_size` token slots. A sequence's block table maps
token position p to block ``table[p // block_size]``, slot ``p % block_size``. No tensors live
here; the runner writes KV where the tables say.

Prefix caching (optional) lets a prompt reuse blocks whose KV another sequence already computed.
Only full blocks are cached. Each cached block is an *entry* with a never-reused id; its key is
``(parent entry id, block tokens)`` and it is found through ``hash(key)``. A lookup hit compares
the whole key, and since the parent entry was itself matched the same way, a hit proves that the
entire prefix up to the block's end is identical: a hash collision can only cost a miss, never
return KV computed for other tokens. (Chaining on the parent's *hash* would not: after a
collision one level up, a child could match its tokens under a different prefix.)

Only KV that has actually been computed may be shared, so a block becomes an entry only once
the engine reports its KV computed: `allocate` and `append` register nothing, and
`mark_computed`, called after each step, registers the full blocks that lie within the computed
tokens. Registering earlier would let a later prompt hit a block whose KV does not exist yet (a
prefill chunked over several steps; in decode, the token `append` adds gets its KV only in the
next step) and read garbage, and a sequence freed before its prefill ran would leave garbage
in the cache.

A block whose last reference goes away returns to the free pool; a cached one stays findable
("evictable") until a fresh allocation needs its slot, least recently freed first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

_ROOT = 0
"""Parent entry id of a prompt's first block; real entries are numbered from 1."""


def _block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of a cache key; a module function so tests can force collisions."""
    return hash((parent, tokens))


class NoFreeBlocks(RuntimeError):
    """The pool cannot hold the request; the manager's state is unchanged."""


class _Block:
    """One KV block: its references and, while it is a cache entry, its key."""

    __slots__ = ("ref_count", "hash", "key", "entry_id")

    def __init__(self) -> None:
        self.ref_count = 0
        self.hash: int | None = None
        self.key: tuple[int, tuple[int, ...]] | None = None  # (parent entry id, tokens)
        self.entry_id = 0


class _Seq:
    """A live sequence's table, its length, its computed KV, and where its cache chain stands."""

    __slots__ = ("table", "length", "computed", "processed", "parent")

    def __init__(
        self, table: list[int], length: int, hits: int, computed: int, parent: int | None
    ) -> None:
        self.table = table
        self.length = length
        # Tokens whose KV is computed, as last reported (at first the hit blocks' tokens).
        self.computed = computed
        # Leading full blocks already offered to the cache: the hits, then the computed ones.
        self.processed = hits
        # Entry id matching the sequence's last processed block (_ROOT before the first one);
        # None once the chain left the cache (a collision), so later blocks cannot be cached.
        self.parent = parent


class BlockManager:
    """Allocates, grows and frees block tables over a fixed pool, with optional prefix caching."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # full prompt blocks that could have come from the cache
        self.prefix_hits = 0  # ... and did
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # free, not cached; pop() gives 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached, oldest first
        self._cache: dict[int, int] = {}  # hash -> block id
        self._seqs: dict[int, _Seq] = {}
        self._last_entry_id = _ROOT

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation could use, evicting cached ones if it must."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by live sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, tokens: Sequence[int], use_cache: bool = True) -> int:
        """Free blocks allocate(tokens) would take: a hit on a free cached block takes one too."""
        return self._needed(tokens, self._match(tokens) if use_cache else [])

    def can_allocate(self, tokens: Sequence[int], use_cache: bool = True) -> bool:
        """Whether allocate(tokens) would succeed now."""
        return self.blocks_needed(tokens, use_cache) <= self.num_free_blocks

    def allocate(self, seq_id: int, tokens: Sequence[int], use_cache: bool = True) -> int:
        """Give `seq_id` blocks for its whole prompt; returns how many prompt tokens are cached.

        The result is a multiple of block_size and always < len(tokens): the block holding the
        last prompt token is never a hit, because the model must compute that token's logits.
        Fresh blocks are not registered: their KV does not exist until the prefill computes it,
        possibly over several steps, so they are shared only once `mark_computed` covers them.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already live")
        if len(tokens) == 0:
            raise ValueError("cannot allocate an empty prompt")
        hits = self._match(tokens) if use_cache else []  # e.g. prompt logprobs need every row
        needed = self._needed(tokens, hits)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"prompt needs {needed} blocks, {self.num_free_blocks} free")
        for b in hits:
            block = self._blocks[b]
            if block.ref_count == 0:
                del self._evictable[b]
            block.ref_count += 1
        table = hits + [self._take_free() for _ in range(self._blocks_for(len(tokens)) - len(hits))]
        cached = len(hits) * self.block_size
        parent = self._blocks[hits[-1]].entry_id if hits else _ROOT
        self._seqs[seq_id] = _Seq(table, len(tokens), len(hits), cached, parent)
        if self.enable_prefix_caching and use_cache:
            self.prefix_queries += (len(tokens) - 1) // self.block_size
            self.prefix_hits += len(hits)
        return cached

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._seqs[seq_id].table)

    def can_append(self, seq_id: int, new_len: int) -> bool:
        """Whether the sequence can grow to `new_len` tokens."""
        grow = self._blocks_for(new_len) - len(self._seqs[seq_id].table)
        return grow <= self.num_free_blocks

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Grow the sequence to `tokens`, its full token list (prompt + generated).

        Adds blocks as needed and registers nothing: a token appended in decode gets its KV only
        in the next step, so a block it fills is shared only once `mark_computed` covers it.
        """
        seq = self._seqs[seq_id]
        if len(tokens) < seq.length:
            raise ValueError(f"sequence {seq_id} has {seq.length} tokens, cannot shrink")
        grow = self._blocks_for(len(tokens)) - len(seq.table)
        if grow > self.num_free_blocks:
            raise NoFreeBlocks(
                f"sequence {seq_id} needs {grow} blocks, {self.num_free_blocks} free"
            )
        seq.table.extend(self._take_free() for _ in range(grow))
        seq.length = len(tokens)

    def mark_computed(self, seq_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Record that the first `num_computed` of `tokens` (the full token list) have KV now.

        The engine calls this after each step. With prefix caching, every full block lying
        entirely within those tokens and not offered before becomes a cache entry (unless the
        same content is already cached, or a collision broke the chain): only computed KV may
        be shared. `num_computed` starts at what `allocate` returned and must not go backwards
        or exceed the sequence's length.
        """
        seq = self._seqs[seq_id]
        if num_computed > seq.length or num_computed > len(tokens):
            raise ValueError(
                f"sequence {seq_id} has {seq.length} tokens ({len(tokens)} given), "
                f"cannot have {num_computed} computed"
            )
        if num_computed < seq.computed:
            raise ValueError(
                f"sequence {seq_id} already has {seq.computed} tokens computed, "
                f"cannot go back to {num_computed}"
            )
        seq.computed = num_computed
        self._register_full(seq, tokens, num_computed // self.block_size)

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks (finish, abort or preemption).

        The tail goes first so that, within a sequence, later blocks are evicted before the
        prefix they depend on.
        """
        for b in reversed(self._seqs.pop(seq_id).table):
            block = self._blocks[b]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(b)
                else:
                    self._evictable[b] = None

    def live(self) -> list[int]:
        """Ids of the sequences holding blocks, in allocation order."""
        return list(self._seqs)

    def check(self) -> None:
        """Assert every invariant; the message names the one that broke."""
        refs: Counter[int] = Counter()
        for sid, seq in self._seqs.items():
            assert seq.length >= 1, f"length: sequence {sid} has length {seq.length}"
            want = self._blocks_for(seq.length)
            assert len(seq.table) == want, (
                f"table size: sequence {sid} of {seq.length} tokens has {len(seq.table)} blocks, "
                f"expected {want}"
            )
            assert len(set(seq.table)) == len(seq.table), f"duplicate block in table of {sid}"
            assert seq.computed <= seq.length, (
                f"computed: sequence {sid} has {seq.computed} of {seq.length} tokens computed"
            )
            full = seq.length // self.block_size
            assert seq.processed <= full, (
                f"processed: sequence {sid} processed {seq.processed} blocks, has {full} full"
            )
            assert seq.processed == seq.computed // self.block_size, (
                f"processed: sequence {sid} processed {seq.processed} blocks, "
                f"{seq.computed} tokens computed"
            )
            refs.update(seq.table)
        assert len(self._free) == len(set(self._free)), "free list holds a block twice"
        free = set(self._free)
        assert not free & self._evictable.keys(), "block both in free list and evictable set"
        free |= self._evictable.keys()
        for b, block in enumerate(self._blocks):
            assert block.ref_count == refs[b], (
                f"ref_count: block {b} has {block.ref_count}, live tables hold it {refs[b]} times"
            )
            assert (block.ref_count > 0) != (b in free), (
                f"referenced xor free: block {b} has ref_count {block.ref_count}, free={b in free}"
            )
            cached = block.hash is not None
            assert cached == (block.key is not None) == (block.entry_id != _ROOT), (
                f"entry fields: block {b} has partial cache state"
            )
            assert not cached or self._cache.get(block.hash) == b, (
                f"cache: block {b} carries a hash the cache does not map to it"
            )
            assert (b in self._evictable) == (cached and block.ref_count == 0), (
                f"evictable: block {b} (cached={cached}, refs={block.ref_count}) misplaced"
            )
        assert len(free) + len(refs) == self.num_blocks, (
            f"accounting: {len(free)} free + {len(refs)} referenced != {self.num_blocks}"
        )
        for h, b in self._cache.items():
            assert self._blocks[b].hash == h, f"cache: hash {h} maps to block {b} without it"
        assert self.enable_prefix_caching or not self._cache, "cache used while disabled"

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _needed(self, tokens: Sequence[int], hits: list[int]) -> int:
        return self._blocks_for(len(tokens)) - sum(self._blocks[b].ref_count > 0 for b in hits)

    def _match(self, tokens: Sequence[int]) -> list[int]:
        """Cached blocks for the longest run of the prompt's full blocks before its last token."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        parent, bs = _ROOT, self.block_size
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            b = self._cache.get(_block_hash(*key))
            if b is None or self._blocks[b].key != key:
                break
            hits.append(b)
            parent = self._blocks[b].entry_id
        return hits

    def _register_full(self, seq: _Seq, tokens: Sequence[int], end: int) -> None:
        """Make the sequence's blocks not processed yet, up to index `end`, cache entries.

        Where possible: the same content cached elsewhere is chained on instead, and after a
        collision nothing more of the sequence is cached.
        """
        start, bs = seq.processed, self.block_size
        seq.processed = max(start, end)
        if not self.enable_prefix_caching:
            return
        for i in range(start, end):
            if seq.parent is None:
                return
            key = (seq.parent, tuple(tokens[i * bs : (i + 1) * bs]))
            h = _block_hash(*key)
            owner = self._cache.get(h)
            if owner is None:
                block = self._blocks[seq.table[i]]
                self._last_entry_id += 1
                block.hash, block.key, block.entry_id = h, key, self._last_entry_id
                self._cache[h] = seq.table[i]
                seq.parent = block.entry_id
            elif self._blocks[owner].key == key:
                seq.parent = self._blocks[owner].entry_id  # same content elsewhere: chain on it
            else:
                seq.parent = None  # collision: this lineage cannot be cached any further

    def _take_free(self) -> int:
        """A block for new KV: never-cached ones first, else evict the least recently freed."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            block = self._blocks[b]
            del self._cache[block.hash]
            block.hash, block.key, block.entry_id = None, None, _ROOT
        self._blocks[b].ref_count = 1
        return b
