"""Turns a scheduled batch into the step's inputs and runs the model once.

The backend turns the host-side step into device tensors (its own metadata); all-decode steps
replay a CUDA graph where the backend supports them. Logits stay on the device: the sampler
runs there and only sampled ids and asked-for logprobs cross to the host. Under tensor
parallelism every step (warm-up ones too) is first sent to the other ranks, which run their
slices of the same forward.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

import torch

from runtime.engine.block_manager import BlockManager
from runtime.engine.cuda_graph import DecodeGraphs
from runtime.engine.overlap import PLACEHOLDER, FeedRows, TokenFeed
from runtime.engine.scheduler import Batch
from runtime.kernels.ops import Backend, StepInputs
from runtime.kv.cache import KVCache
from runtime.model.context import step_context
from runtime.model.llama import LlamaModel

if TYPE_CHECKING:
    from runtime.distributed.worker import Workers


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        blocks: BlockManager,
        ops: Backend,
        graphs: DecodeGraphs | None = None,
        workers: Workers | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.ops = ops
        self.block_size = cache.spec.block_size
        self.graphs = graphs
        self.workers = workers

    def inputs(
        self, batch: Batch, feed: TokenFeed | None = None
    ) -> tuple[StepInputs, list[tuple[int, int] | None], FeedRows | None]:
        """The step on the host; for each sequence that asked for prompt logprobs the
        (first, count) of its chunk's rows among the logits (the last rows of every sequence
        come first, in batch order, so the sampler takes logits[:B] without indexing); and
        the input rows whose ids are still on the device, in ``feed`` (overlapped steps)."""
        ids, positions, slots, tables, lens = [], [], [], [], []
        last, extra, chunks, dst, src = [], [], [], [], []
        bs, start = self.block_size, 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            first = seq.num_computed
            table = self.blocks.block_table(seq.seq_id)
            ids.extend(seq.token_ids[first : first + n])
            if first + n == len(seq.token_ids) and seq.token_ids[-1] == PLACEHOLDER:
                dst.append(start + n - 1)
                src.append(feed.rows[seq.seq_id])
            for pos in range(first, first + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
            lens.append(first + n)
            last.append(start + n - 1)
            if seq.params.prompt_logprobs is not None and first < seq.num_prompt:
                chunks.append((len(batch.seqs) + len(extra), n))
                extra.extend(range(start, start + n))
            else:
                chunks.append(None)
            start += n
        step = StepInputs(
            ids, positions, slots, tables, lens, list(batch.num_tokens), last + extra, bs
        )
        return step, chunks, FeedRows(feed, dst, src) if dst else None

    def warm_up(self, max_rows: int, max_context: int) -> None:
        """Compile the kernels before the first request, for backends that compile
        (``ops.warmup_tokens``, row counts ascending): a prefill of each row count up to the
        first that holds the largest step (``max_rows``), as fresh sequences of at most
        ``max_context`` tokens (no position past the rotary table, which holds that many),
        then decode steps at the shortest and the longest context (long ones take the
        split-context kernels). The outputs are dropped, and the blocks written are free:
        whoever gets them writes their KV before reading it."""
        tokens = self.ops.warmup_tokens
        for n in tokens[: bisect.bisect_left(tokens, max_rows) + 1]:
            whole, rest = divmod(n, max_context)
            lens = [max_context] * whole + ([rest] if rest else [])
            self.forward(self._warm_step([(m, m) for m in lens]))
        for ctx in sorted({1, max_context}) if tokens else ():
            self.forward(self._warm_step([(ctx, 1)]))

    def _warm_step(self, seqs: list[tuple[int, int]]) -> StepInputs:
        """Sequences of (context, new tokens), each over the pool's first blocks, wrapping
        past its end (a warm-up may outgrow a small pool; what it computes is never read)."""
        bs, pool = self.block_size, self.cache.num_blocks
        tables = [[b % pool for b in range(-(-ctx // bs))] for ctx, _ in seqs]
        positions, slots = [], []
        for (ctx, n), table in zip(seqs, tables, strict=True):
            positions += range(ctx - n, ctx)
            slots += [table[p // bs] * bs + p % bs for p in range(ctx - n, ctx)]
        ends = list(itertools.accumulate(n for _, n in seqs))
        return StepInputs(
            [0] * ends[-1],
            positions,
            slots,
            tables,
            [ctx for ctx, _ in seqs],
            [n for _, n in seqs],
            [e - 1 for e in ends],
            bs,
        )

    def forward(self, step: StepInputs, fed: FeedRows | None = None) -> torch.Tensor:
        """The model over one step, eagerly (every rank's slice of it under TP, which takes
        no ``fed`` rows: the other ranks could not read them)."""
        if self.workers is not None:
            self.workers.send(step)
        tensors = self.ops.prepare_step(step)
        if fed is not None:
            fed.apply(tensors.input_ids)
        with step_context(tensors, self.cache):
            return self.model()

    def step(self, step: StepInputs, fed: FeedRows | None = None) -> torch.Tensor:
        """Logits of the step's ``logits_indices`` rows: replayed from a captured graph when
        one holds the step, else eagerly."""
        if self.graphs is not None and self.graphs.holds(step):
            return self.graphs.run(step, fed)
        return self.forward(step, fed)

    def run(
        self, batch: Batch, feed: TokenFeed | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Logits of each sequence's last new token ([B, V], float32, on the device), and for
        sequences that asked for prompt logprobs the logits of every new token of the chunk.
        Placeholder ids (runtime.engine.overlap) are taken from ``feed`` on the device."""
        step, chunks, fed = self.inputs(batch, feed)
        logits = self.step(step, fed)
        last = logits[: len(batch.seqs)]
        return last, [None if c is None else logits[c[0] : c[0] + c[1]] for c in chunks]
