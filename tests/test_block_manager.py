"""Block manager: table bookkeeping, prefix caching, and a stateful run against a KV oracle.

Blocks enter the prefix cache only through `mark_computed`, which the tests call the way the
engine does: after the KV of the tokens it reports has been computed.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from runtime.engine import block_manager
from runtime.engine.block_manager import BlockManager, NoFreeBlocks

FAST = settings(max_examples=25, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def snapshot(bm: BlockManager, probes: list[list[int]]) -> tuple:
    """Everything observable, including what the cache would hit for `probes`."""
    return (
        bm.live(),
        {s: bm.block_table(s) for s in bm.live()},
        bm.num_free_blocks,
        bm.usage,
        bm.prefix_queries,
        bm.prefix_hits,
        [bm.blocks_needed(p) for p in probes],
    )


@pytest.mark.parametrize("caching", [False, True])
@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    grow=st.lists(st.integers(0, 20), min_size=6, max_size=6),
)
@FAST
def test_allocate_append_free_counts(
    caching: bool, block_size: int, lengths: list[int], grow: list[int]
) -> None:
    rng = random.Random(sum(lengths))
    bm = BlockManager(1000, block_size, enable_prefix_caching=caching)
    toks = {}
    for sid, n in enumerate(lengths):
        toks[sid] = [sid * 1000 + rng.randrange(1000) for _ in range(n)]  # no two share a block
        assert bm.blocks_needed(toks[sid]) == ceil_div(n, block_size)
        free = bm.num_free_blocks
        assert bm.allocate(sid, toks[sid]) == 0
        bm.mark_computed(sid, toks[sid], n)
        assert len(bm.block_table(sid)) == ceil_div(n, block_size)
        assert bm.num_free_blocks == free - ceil_div(n, block_size)
        bm.check()
    used = sum(ceil_div(n, block_size) for n in lengths)
    assert bm.usage == pytest.approx(used / 1000)
    for sid in toks:
        toks[sid] += [sid * 1000 + rng.randrange(1000) for _ in range(grow[sid])]
        old = bm.block_table(sid)
        assert bm.can_append(sid, len(toks[sid]))
        bm.append(sid, toks[sid])
        bm.mark_computed(sid, toks[sid], len(toks[sid]))
        table = bm.block_table(sid)
        assert table[: len(old)] == old
        assert len(table) == ceil_div(len(toks[sid]), block_size)
        bm.check()
    assert sorted(bm.live()) == sorted(toks)
    for sid in toks:
        bm.free(sid)
        bm.check()
    assert bm.live() == []
    assert bm.num_free_blocks == 1000
    assert bm.usage == 0


def test_append_adds_a_block_exactly_at_the_boundary() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(1, [0] * 3)
    assert len(bm.block_table(1)) == 1
    bm.append(1, [0] * 4)
    assert len(bm.block_table(1)) == 1
    bm.append(1, [0] * 5)
    assert len(bm.block_table(1)) == 2
    assert bm.num_free_blocks == 6
    assert bm.usage == pytest.approx(2 / 8)
    bm.check()


@pytest.mark.parametrize("caching", [False, True])
def test_no_free_blocks_changes_nothing(caching: bool) -> None:
    rng = random.Random(0)
    bm = BlockManager(10, 4, enable_prefix_caching=caching)
    prompts = [[rng.randrange(5) for _ in range(n)] for n in (9, 13, 6)]
    for sid, p in enumerate(prompts):
        bm.allocate(sid, p)
        bm.mark_computed(sid, p, len(p))
    bm.free(0)  # leaves cached free blocks when caching is on
    probes = [*prompts, prompts[0][:8] + [7] * 9]
    before = snapshot(bm, probes)
    assert bm.num_free_blocks == 4

    too_big = prompts[0][:8] + [7] * 9  # 5 blocks; hits on free cached blocks count as taken
    assert bm.blocks_needed(too_big) == 5
    assert not bm.can_allocate(too_big)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(9, too_big)
    bm.check()
    assert snapshot(bm, probes) == before

    grown = prompts[1] + [1] * 20  # 33 tokens: 9 blocks, has 4
    assert not bm.can_append(1, len(grown))
    with pytest.raises(NoFreeBlocks):
        bm.append(1, grown)
    bm.check()
    assert snapshot(bm, probes) == before

    bm.append(1, prompts[1] + [1] * 16)  # 29 tokens: 8 blocks, exactly fits
    assert bm.num_free_blocks == 0
    bm.check()


def test_errors() -> None:
    bm = BlockManager(4, 4)
    bm.allocate(1, [1, 2])
    with pytest.raises(ValueError, match="already live"):
        bm.allocate(1, [3])
    with pytest.raises(ValueError, match="empty"):
        bm.allocate(2, [])
    with pytest.raises(ValueError, match="shrink"):
        bm.append(1, [1])
    with pytest.raises(KeyError):
        bm.free(2)
    with pytest.raises(KeyError):
        bm.append(2, [1])
    with pytest.raises(KeyError):
        bm.mark_computed(2, [1], 1)
    with pytest.raises(ValueError, match="cannot have 3 computed"):
        bm.mark_computed(1, [1, 2, 3], 3)  # more than the sequence's 2 tokens
    bm.mark_computed(1, [1, 2], 2)
    with pytest.raises(ValueError, match="go back"):
        bm.mark_computed(1, [1, 2], 1)
    bm.check()
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    bm.free(1)
    with pytest.raises(KeyError):
        bm.free(1)
    bm.check()
    assert bm.num_free_blocks == 4


@given(
    block_size=st.sampled_from([1, 2, 4, 16, 64]),
    data=st.data(),
)
@FAST
def test_shared_prefix_is_reused(block_size: int, data: st.DataObject) -> None:
    vocab = st.integers(0, 50)
    prefix = data.draw(st.lists(vocab, min_size=3 * block_size, max_size=3 * block_size))
    a_tail = data.draw(st.lists(vocab, min_size=1, max_size=2 * block_size))
    b_tail = data.draw(st.lists(vocab, min_size=1, max_size=2 * block_size))
    b_tail[0] = a_tail[0] + 1  # diverge right after the shared prefix
    a, b = prefix + a_tail, prefix + b_tail
    bm = BlockManager(32, block_size, enable_prefix_caching=True)

    assert bm.allocate(1, a) == 0
    bm.mark_computed(1, a, len(a))
    assert (bm.prefix_queries, bm.prefix_hits) == ((len(a) - 1) // block_size, 0)
    assert bm.blocks_needed(b) == ceil_div(len(b), block_size) - 3  # live hits are not taken
    free = bm.num_free_blocks
    assert bm.allocate(2, b) == 3 * block_size
    assert bm.num_free_blocks == free - (ceil_div(len(b), block_size) - 3)
    ta, tb = bm.block_table(1), bm.block_table(2)
    assert ta[:3] == tb[:3]
    assert not set(ta[3:]) & set(tb[3:])
    assert bm.prefix_queries == (len(a) - 1) // block_size + (len(b) - 1) // block_size
    assert bm.prefix_hits == 3
    bm.check()
    bm.free(1)
    bm.check()
    assert bm.usage == pytest.approx(len(tb) / 32)  # shared blocks stay with sequence 2
    bm.free(2)
    bm.check()
    assert bm.num_free_blocks == 32


@pytest.mark.parametrize("keep_first", [True, False])
@given(n=st.integers(1, 5), seed=st.integers(0, 2**16))
@FAST
def test_prompt_of_full_blocks_leaves_last_block_to_compute(
    keep_first: bool, n: int, seed: int
) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(100) for _ in range(n * 4)]
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    assert bm.allocate(1, prompt) == 0
    bm.mark_computed(1, prompt, len(prompt))
    first = bm.block_table(1)
    if not keep_first:
        bm.free(1)
    assert bm.allocate(2, prompt) == (n - 1) * 4
    second = bm.block_table(2)
    assert second[: n - 1] == first[: n - 1]
    if keep_first:
        assert second[-1] != first[-1]
    assert bm.prefix_hits == n - 1
    assert bm.prefix_queries == 2 * (n - 1)
    bm.check()


@pytest.mark.parametrize(
    "fake_hash,p_hit,x_q_hit",
    [(lambda parent, tokens: 0, 0, 4), (lambda parent, tokens: hash(tokens), 4, 8)],
    ids=["constant", "ignores-parent"],
)
def test_hash_collisions_never_return_other_tokens(
    monkeypatch: pytest.MonkeyPatch, fake_hash, p_hit: int, x_q_hit: int
) -> None:
    """Degenerate hashes collide all the time; hits must still be exact, down to the prefix."""
    monkeypatch.setattr(block_manager, "_block_hash", fake_hash)
    bm = BlockManager(32, 4, enable_prefix_caching=True)

    def prefill(sid: int, tokens: list[int]) -> int:
        cached = bm.allocate(sid, tokens)
        bm.mark_computed(sid, tokens, len(tokens))
        return cached

    x, p, q, r = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]
    prefill(1, x + q + [9])  # q's KV here is computed after x
    prefill(2, p + [9])
    # Same tokens as sequence 1's second block, but after p: its KV must not be reused.
    assert prefill(3, p + q + [9]) == p_hit
    t1, t3 = bm.block_table(1), bm.block_table(3)
    assert t3[1] != t1[1]
    # After a block that could not be cached, later blocks are not cached either: r's KV is
    # computed after p + q, and must not be found as if it followed p directly.
    prefill(6, p + q + r + [9])
    assert prefill(7, p + r + [9]) == p_hit
    assert bm.block_table(7)[1] != bm.block_table(6)[2]
    # A different first block never hits, whatever the hash says.
    assert prefill(4, [5, 5, 5, 5, 9]) == 0
    assert not set(bm.block_table(4)) & set(t1 + bm.block_table(2) + t3)
    # The true prefix still hits as far as the degenerate cache can tell entries apart.
    assert prefill(5, x + q + [8]) == x_q_hit
    assert bm.block_table(5)[0] == t1[0]
    bm.check()


def test_freed_cached_blocks_are_reused_then_evicted_lru() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = [1] * 8 + [0]
    b = [2] * 8 + [0]
    bm.allocate(1, a)
    bm.allocate(2, b)
    bm.mark_computed(1, a, len(a))
    bm.mark_computed(2, b, len(b))
    a_blocks, b_blocks = bm.block_table(1)[:2], bm.block_table(2)[:2]
    bm.free(1)
    bm.free(2)
    bm.check()
    assert bm.num_free_blocks == 8

    # A hit on a free cached block takes it back.
    assert bm.allocate(3, a) == 8
    assert bm.block_table(3)[:2] == a_blocks
    assert bm.prefix_hits == 2
    bm.free(3)

    # a was used again, so b's blocks are now the least recently freed. 6 fresh blocks: the 4
    # never-cached free ones, then b's two.
    bm.allocate(4, [3] * 21)
    taken = bm.block_table(4)
    assert set(taken[-2:]) == set(b_blocks)
    assert not set(taken) & set(a_blocks)
    bm.check()
    bm.free(4)
    assert bm.allocate(5, a) == 8
    assert bm.block_table(5)[:2] == a_blocks
    assert bm.allocate(6, b) == 0  # evicted
    bm.check()


def test_identical_generations_keep_the_chain() -> None:
    """A block that duplicates a cached one is not cached twice, but its successors still are."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = [1] * 5
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 5)
    assert bm.allocate(2, prompt) == 4
    bm.mark_computed(2, prompt, 5)
    bm.append(1, prompt + [2] * 3)  # fills block 1 of both: cached once, from sequence 1
    bm.append(2, prompt + [2] * 3)
    bm.mark_computed(1, prompt + [2] * 3, 8)
    bm.mark_computed(2, prompt + [2] * 3, 8)
    bm.append(2, prompt + [2] * 7)  # block 2 exists only in sequence 2
    bm.mark_computed(2, prompt + [2] * 7, 12)
    t1, t2 = bm.block_table(1), bm.block_table(2)
    assert bm.allocate(3, prompt + [2] * 7 + [0]) == 12
    assert bm.block_table(3)[:3] == [t1[0], t1[1], t2[2]]
    bm.check()


def test_free_evicts_a_sequence_tail_before_its_prefix() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    prompt = list(range(13))  # 3 full cached blocks and a partial one
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 13)
    head = bm.block_table(1)[:2]
    bm.free(1)
    bm.allocate(2, [7] * 8)  # takes the partial block, then evicts one cached block
    assert not set(bm.block_table(2)) & set(head)
    bm.free(2)
    assert bm.allocate(3, prompt[:8] + [0]) == 8
    bm.check()


def test_prompt_is_shared_only_once_marked_computed() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(9))  # 2 full blocks and a partial one
    assert bm.allocate(1, prompt) == 0
    # Sequence 1's prefill has not run: its blocks hold no KV yet and must not be hit.
    assert bm.blocks_needed(prompt) == 3
    assert bm.allocate(2, prompt) == 0
    assert not set(bm.block_table(1)) & set(bm.block_table(2))
    bm.mark_computed(1, prompt, len(prompt))
    assert bm.blocks_needed(prompt) == 1
    assert bm.allocate(3, prompt) == 8
    assert bm.block_table(3)[:2] == bm.block_table(1)[:2]
    assert bm.prefix_hits == 2
    bm.check()


def test_chunked_prefill_registers_only_computed_blocks() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(13))  # 3 full blocks and a partial one
    assert bm.allocate(1, prompt) == 0
    t1 = bm.block_table(1)
    bm.mark_computed(1, prompt, 6)  # first chunk: 1.5 blocks, only block 0 is complete
    bm.mark_computed(1, prompt, 6)  # reporting no progress is fine
    bm.check()
    assert bm.allocate(2, prompt) == 4
    assert bm.block_table(2)[0] == t1[0]
    assert not set(bm.block_table(2)[1:]) & set(t1)
    bm.mark_computed(1, prompt, 12)  # second chunk completes blocks 1 and 2
    assert bm.allocate(3, prompt) == 12
    assert bm.block_table(3)[:3] == t1[:3]
    bm.mark_computed(1, prompt, 13)
    bm.check()


@pytest.mark.parametrize("computed", [0, 6])
def test_sequence_freed_before_its_prefill_leaves_no_garbage(computed: int) -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(13))
    bm.allocate(1, prompt)
    if computed:
        bm.mark_computed(1, prompt, computed)  # preempted after the first chunk
    bm.free(1)  # aborted or preempted
    bm.check()
    assert len(bm._cache) == computed // 4
    assert bm.num_free_blocks == 8
    assert bm.allocate(2, prompt) == computed // 4 * 4
    bm.check()


def test_decode_block_is_shared_only_once_its_last_token_is_computed() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    toks = [1, 2, 3, 4, 5]
    bm.allocate(1, toks)
    bm.mark_computed(1, toks, 5)  # prefill; it samples the next token
    for t in (6, 7, 8):
        toks = [*toks, t]
        bm.append(1, toks)  # the sampled token's KV is computed by the next step
        probe = [*toks[:8], 0]
        if len(toks) == 8:
            # Block 1 is full but its last token has no KV yet: only block 0 may be hit.
            assert bm.blocks_needed(probe) == 2
            bm.check()
        bm.mark_computed(1, toks, len(toks))  # the next step ran
    assert bm.blocks_needed(probe) == 1
    assert bm.allocate(2, probe) == 8
    assert bm.block_table(2)[:2] == bm.block_table(1)
    bm.check()


def test_mark_computed_without_caching_registers_nothing() -> None:
    bm = BlockManager(8, 4)
    prompt = list(range(9))
    bm.allocate(1, prompt)
    bm.mark_computed(1, prompt, 9)
    bm.check()
    assert bm.allocate(2, prompt) == 0
    with pytest.raises(ValueError, match="go back"):
        bm.mark_computed(1, prompt, 8)


def test_check_names_the_broken_invariant() -> None:
    def fresh() -> BlockManager:
        bm = BlockManager(8, 4, enable_prefix_caching=True)
        bm.allocate(1, [1] * 9)
        bm.mark_computed(1, [1] * 9, 9)
        bm.allocate(2, [1] * 8 + [2])
        bm.free(2)
        bm.allocate(3, [4] * 9)
        bm.mark_computed(3, [4] * 9, 9)
        bm.free(3)
        bm.check()
        return bm

    cases = {
        "ref_count": lambda bm: setattr(bm._blocks[0], "ref_count", 3),
        "free list holds": lambda bm: bm._free.append(bm._free[-1]),
        "referenced xor free": lambda bm: bm._free.append(bm.block_table(1)[0]),
        "table size": lambda bm: setattr(bm._seqs[1], "length", 20),
        "cache": lambda bm: bm._cache.clear(),
        "evictable": lambda bm: bm._free.append(bm._evictable.popitem()[0]),
        "entry fields": lambda bm: setattr(bm._blocks[bm.block_table(1)[0]], "entry_id", 0),
        "duplicate block": lambda bm: bm._seqs[1].table.__setitem__(1, bm._seqs[1].table[0]),
        "computed": lambda bm: setattr(bm._seqs[1], "computed", 10),
        "processed": lambda bm: setattr(bm._seqs[1], "processed", 3),
    }
    for name, corrupt in cases.items():
        bm = fresh()
        corrupt(bm)
        with pytest.raises(AssertionError, match=name):
            bm.check()


# --- stateful: random operations against an oracle of what every block's KV holds ------------

BS = 4
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 1], [0] * 9, [2, 1] * 6]


class BlockManagerMachine(RuleBasedStateMachine):
    """`kv[b]` is the token prefix block b's KV is written for (up to the block's end), and
    `done` holds the blocks whose KV for it has been computed in full.

    The machine plays the engine: after allocate and after each append it reports some or all
    of the sequence's tokens computed, and a separate rule runs later steps of a chunked
    prefill. Whatever a sequence writes (its non-cached prompt blocks, its growing tail) must
    be its own, and a cache hit must hold exactly the prompt's tokens up to the end of the hit
    block, with that KV already computed.
    """

    caching = True

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks: int) -> None:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=self.caching)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}  # tokens reported computed, per live sequence
        self.kv: dict[int, tuple[int, ...]] = {}
        self.done: set[int] = set()
        self.next_id = 0

    def _probes(self) -> list[list[int]]:
        return [p + [9] for p in PREFIXES]

    def _write(self, sid: int, first_block: int) -> None:
        toks, table = self.tokens[sid], self.bm.block_table(sid)
        others = {b for s in self.bm.live() if s != sid for b in self.bm.block_table(s)}
        for i in range(first_block, len(table)):
            assert table[i] not in others, f"sequence {sid} writes into shared block {table[i]}"
            self.kv[table[i]] = tuple(toks[: (i + 1) * BS])
            self.done.discard(table[i])  # whatever KV it held is being overwritten

    def _compute(self, sid: int, data: st.DataObject) -> None:
        """An engine step: the KV of all the sequence's tokens, or of some more, is computed."""
        toks, old = self.tokens[sid], self.computed[sid]
        n = data.draw(st.one_of(st.just(len(toks)), st.integers(old, len(toks))), label="computed")
        self.bm.mark_computed(sid, toks, n)
        table = self.bm.block_table(sid)
        for i in range(old // BS, n // BS):
            assert self.kv[table[i]] == tuple(toks[: (i + 1) * BS])
            self.done.add(table[i])
        self.computed[sid] = n

    def _allocate(self, toks: list[int], data: st.DataObject) -> None:
        sid, self.next_id = self.next_id, self.next_id + 1
        before = snapshot(self.bm, self._probes())
        needed, fits = self.bm.blocks_needed(toks), self.bm.can_allocate(toks)
        hits, queries = self.bm.prefix_hits, self.bm.prefix_queries
        try:
            cached = self.bm.allocate(sid, toks)
        except NoFreeBlocks:
            assert not fits
            assert snapshot(self.bm, self._probes()) == before
            return
        assert fits
        assert self.bm.num_free_blocks == before[2] - needed
        assert cached % BS == 0 and 0 <= cached < len(toks)
        assert self.caching or cached == 0
        if self.caching:
            assert self.bm.prefix_hits - hits == cached // BS
            assert self.bm.prefix_queries - queries == (len(toks) - 1) // BS
        self.tokens[sid] = toks
        self.computed[sid] = cached
        table = self.bm.block_table(sid)
        for i in range(cached // BS):
            assert self.kv.get(table[i]) == tuple(toks[: (i + 1) * BS]), "wrong KV reused"
            assert table[i] in self.done, "KV reused before it was computed"
        self._write(sid, cached // BS)
        self._compute(sid, data)

    @rule(
        data=st.data(),
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=10),
    )
    def allocate(self, data: st.DataObject, prefix: list[int], tail: list[int]) -> None:
        if prefix + tail:
            self._allocate(prefix + tail, data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=6))
    def fork(self, data: st.DataObject, tail: list[int]) -> None:
        """Allocate a prompt sharing a prefix of a live sequence (prompt or generated part)."""
        parent = self.tokens[data.draw(st.sampled_from(sorted(self.tokens)))]
        cut = data.draw(st.integers(1, len(parent)))
        self._allocate(parent[:cut] + tail, data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A later engine step for a sequence, e.g. the next chunk of its prefill."""
        self._compute(data.draw(st.sampled_from(sorted(self.tokens))), data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=9))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        toks = self.tokens[sid] + new
        before = snapshot(self.bm, self._probes())
        fits = self.bm.can_append(sid, len(toks))
        try:
            self.bm.append(sid, toks)
        except NoFreeBlocks:
            assert not fits
            assert snapshot(self.bm, self._probes()) == before
            return
        assert fits
        first = len(self.tokens[sid]) // BS
        self.tokens[sid] = toks
        self._write(sid, first)
        self._compute(sid, data)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[sid], self.computed[sid]
        self.bm.free(sid)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "bm"):
            self.bm.check()
            assert sorted(self.bm.live()) == sorted(self.tokens)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for sid in list(self.tokens):
            self.bm.free(sid)
            self.bm.check()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.usage == 0


@pytest.mark.parametrize(
    "caching,fake_hash",
    [
        (False, None),
        (True, None),
        (True, lambda parent, tokens: 0),
        (True, lambda parent, tokens: hash(tokens)),
    ],
    ids=["no-cache", "cache", "cache-constant-hash", "cache-hash-ignores-parent"],
)
def test_random_operations(monkeypatch: pytest.MonkeyPatch, caching: bool, fake_hash) -> None:
    if fake_hash is not None:
        monkeypatch.setattr(block_manager, "_block_hash", fake_hash)
    machine = type("Machine", (BlockManagerMachine,), {"caching": caching})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=30, stateful_step_count=40, deadline=None)
    )
