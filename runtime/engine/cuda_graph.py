"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step of a small model is host-bound: hundreds of kernel launches and their Python
around them take longer than the GPU's work (95x the weight-streaming floor at batch 1, measured
on an H200). A CUDA graph records the whole decode forward once and relaunches it with one call.
Its inputs must live at fixed addresses, so every tensor the forward reads is a view of one
static int32 buffer, filled by one host-to-device copy per step; a batch runs in the smallest
captured bucket that holds it, its extra rows padded (slot -1: no KV write; context length 1;
block 0) and their logits dropped. Prefill and mixed steps run eagerly.

Without a GPU (tests under the Triton interpreter) nothing is captured: the same padded static
buffers feed an eager forward, so the bucketing and padding are checked on the CPU, and on a GPU
the capture is the only difference.
"""

from __future__ import annotations

import logging
import time

import torch

from runtime.engine.overlap import FeedRows
from runtime.kernels.gpu import HostStaging
from runtime.kernels.ops import Backend, StepInputs, StepTensors
from runtime.kv.cache import KVCache
from runtime.model.context import step_context
from runtime.model.llama import LlamaModel

log = logging.getLogger("liteserve")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_PAD = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "context_lens": 1}


def buckets_for(max_batch_size: int) -> tuple[int, ...]:
    """Buckets up to the smallest one that holds ``max_batch_size`` (at most 256: beyond it a
    step is GPU-bound and runs eagerly)."""
    top = next((b for b in BATCH_BUCKETS if b >= max_batch_size), BATCH_BUCKETS[-1])
    return tuple(b for b in BATCH_BUCKETS if b <= top)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        ops: Backend,
        max_batch_size: int,
        max_blocks: int,
        capture: bool,
    ) -> None:
        self.model, self.cache, self.ops = model, cache, ops
        self.buckets = buckets_for(max_batch_size)
        self.max_bs, self.width = self.buckets[-1], max_blocks
        device = ops.device
        size = self.max_bs * (len(_PAD) + max_blocks)
        self._staging = HostStaging(size, device)
        self._dev = torch.zeros(size, dtype=torch.int32, device=device)
        fields = self._dev.split([self.max_bs] * len(_PAD) + [self.max_bs * max_blocks])
        self._views = dict(zip(_PAD, fields, strict=False))
        self._tables = fields[-1].view(self.max_bs, max_blocks)
        self._rows = torch.arange(self.max_bs, dtype=torch.int32, device=device)
        self._capture = capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._steps = {bs: self._step_tensors(bs) for bs in self.buckets}
        self._fill(StepInputs([], [], [], [], [], [], [], cache.spec.block_size))

    def holds(self, step: StepInputs) -> bool:
        """Whether a step can replay a graph: every sequence decodes one token, the batch fits
        a bucket and each block table fits the captured width."""
        return (
            step.all_decode
            and len(step.logits_indices) == len(step.query_lens)  # no prompt-logprob rows
            and len(step.query_lens) <= self.max_bs
            and all(len(t) <= self.width for t in step.block_tables)
        )

    def _step_tensors(self, bs: int) -> StepTensors:
        v = self._views
        attn = self.ops.decode_attn(self._tables[:bs], v["context_lens"][:bs])
        return StepTensors(
            v["input_ids"][:bs], v["positions"][:bs], v["slot_mapping"][:bs], self._rows[:bs], attn
        )

    def _fill(self, step: StepInputs) -> None:
        """One copy of the step's metadata into the static buffers, padded to max_bs rows
        (built as one list: a tensor per row cost 2.9 ms of host time at batch 256)."""
        pad = self.max_bs - len(step.input_ids)
        columns = (step.input_ids, step.positions, step.slot_mapping, step.context_lens)
        flat: list[int] = []
        for name, values in zip(_PAD, columns, strict=True):
            flat += values
            flat += [_PAD[name]] * pad
        for table in step.block_tables:
            flat += table
            flat += [0] * (self.width - len(table))
        flat += [0] * (pad * self.width)
        self._staging.copy(flat, self._dev)

    def _forward(self, bs: int) -> torch.Tensor:
        with step_context(self._steps[bs], self.cache):
            return self.model()

    def capture(self) -> None:
        """Record every bucket's decode forward, largest first so the smaller graphs reuse its
        memory pool; logs the time and memory it took."""
        if not self._capture:
            return
        free_before = torch.cuda.mem_get_info(self.ops.device)[0]
        start, pool = time.perf_counter(), None
        for bs in reversed(self.buckets):
            self._forward(bs)  # warm-up: compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.ops.device)
        used = free_before - torch.cuda.mem_get_info(self.ops.device)[0]
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s, %.0f MiB",
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            used / 2**20,
        )

    def run(self, step: StepInputs, fed: FeedRows | None = None) -> torch.Tensor:
        """Float32 logits [B, V] of an all-decode step (``holds(step)``), rows in step order;
        ``fed`` input ids are taken from the previous step's ids on the device."""
        n = len(step.input_ids)
        bs = next(b for b in self.buckets if b >= n)
        self._fill(step)
        if fed is not None:
            fed.apply(self._views["input_ids"])
        if bs in self._graphs:
            self._graphs[bs].replay()
            return self._outputs[bs][:n]
        return self._forward(bs)[:n]
