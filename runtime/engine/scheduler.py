"""Continuous batching: which sequences run this step, and how many tokens each.

Every step: running decodes first (one token each, so a long prompt never stalls them), then
unfinished prefills in chunks, then new admissions in arrival order, all under a per-step token
budget. A decode that finds no free block preempts the newest running sequence: its blocks are
freed at once and it is recomputed later from its tokens (prompt and output so far).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from runtime.engine.block_manager import BlockManager
from runtime.engine.sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens per sequence

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, token_budget: int) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.token_budget
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status is Status.RUNNING and self._make_room(seq):
                batch.add(seq, 1)
                budget -= 1
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                n = min(len(seq.token_ids) - seq.num_computed, budget)
                batch.add(seq, n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            use_cache = seq.params.prompt_logprobs is None  # cached tokens have no logits
            if not self.blocks.can_allocate(seq.token_ids, use_cache):
                break  # first come, first served: no overtaking, so nothing starves
            self.waiting.popleft()
            cached = self.blocks.allocate(seq.seq_id, seq.token_ids, use_cache)
            if seq.preemptions == 0:
                seq.num_cached = cached
                seq.first_scheduled = time.perf_counter()
            seq.num_computed = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(seq.token_ids) - cached, budget)
            batch.add(seq, n)
            budget -= n
        return batch

    def _make_room(self, seq: Sequence) -> bool:
        """A slot for the decode's token, preempting the newest sequences if the pool is dry."""
        while not self.blocks.can_append(seq.seq_id, len(seq.token_ids)):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.append(seq.seq_id, seq.token_ids)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: out of every queue, its blocks free at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
