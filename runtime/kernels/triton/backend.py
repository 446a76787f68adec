"""The triton backend: the artifact's packed weights go to the GEMM as they are on disk.

Linears that share an input (q/k/v, gate/up) are fused by concatenating their packed tensors
along N: every part is already padded to whole 64-column tiles, so the concatenation is itself
a valid ``lsq4-mma16x16-v1`` matrix and no weight is repacked. When a part's N is not a
multiple of 64 the fused output carries its padding columns, which one index_select drops.

Tile configs come from the artifact's pinned launch config for this GPU architecture (written
by ``lite tune``), so a server starts without autotuning and always runs the same kernels; on
an architecture the artifact was not tuned for, the GEMM's heuristic picks them, with a warning.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from runtime.kernels.ops import Backend, StepInputs, StepTensors
from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from runtime.kernels.triton.gemm import (
    M_BUCKETS,
    GemmConfig,
    heuristic_config,
    m_bucket,
    w4a16_gemm,
)
from runtime.kernels.triton.kv_write import kv_write
from runtime.kv.layer import LayerKV

log = logging.getLogger("runtime.kernels")
N_TILE = 64
_ALIGN = 4  # int32 elements in 16 bytes


def gpu_arch(device: torch.device) -> str:
    """The key tuned configs are stored under: the CUDA compute capability, e.g. ``sm_90``."""
    if device.type != "cuda":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def gemm_key(n: int, k: int, bucket: int) -> str:
    """Pinned-config key of one GEMM shape and row bucket: ``w4a16/N{n}xK{k}/m{bucket}``."""
    return f"w4a16/N{n}xK{k}/m{bucket}"


def fused_n(ns: list[int]) -> int:
    """Columns the GEMM of fused linears computes: one part's logical N, or the parts' padded
    widths side by side (their concatenated packed tensors)."""
    return ns[0] if len(ns) == 1 else sum(-(-n // N_TILE) * N_TILE for n in ns)


@dataclass
class TritonInt4Weight:
    qweight: torch.Tensor  # int32 [Kp / 16, 2 * Np_total], the artifact's words
    qparams: torch.Tensor  # fp16 [Kp / gs, Np_total, 2]
    n: int  # columns the GEMM computes (sum of padded parts, or the one part's logical N)
    k: int
    group_size: int
    columns: torch.Tensor | None  # logical columns to keep, None when all are
    pinned: dict[int, GemmConfig] = field(default_factory=dict)  # by m bucket

    def config(self, m: int) -> GemmConfig:
        bucket = m_bucket(m)
        cfg = self.pinned.get(bucket)
        return cfg or heuristic_config(m, self.n, self.k, self.group_size)


def prepare_weight(
    parts: list[tuple[torch.Tensor, torch.Tensor, int]],
    k: int,
    group_size: int,
    device: torch.device,
    pinned: dict[str, dict[str, int]],
) -> TritonInt4Weight:
    qweight = torch.cat([qw for qw, _, _ in parts], dim=1).to(device)
    qparams = torch.cat([qp for _, qp, _ in parts], dim=1).to(device)
    n = fused_n([part_n for *_, part_n in parts])
    columns = None
    if len(parts) > 1 and any(p % N_TILE for *_, p in parts):
        keep, start = [], 0
        for qw, _, part_n in parts:
            keep.append(torch.arange(start, start + part_n))
            start += qw.shape[1] // 2
        columns = torch.cat(keep).to(device)
    configs = {
        b: GemmConfig.from_dict(pinned[gemm_key(n, k, b)])
        for b in M_BUCKETS
        if gemm_key(n, k, b) in pinned
    }
    return TritonInt4Weight(qweight, qparams, n, k, group_size, columns, configs)


@dataclass
class KernelTensors:
    """The Triton kernels' attention metadata: views of one device buffer (see StepBuffer)."""

    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with block 0
    context_lens: torch.Tensor  # int32 [S]
    cu_query_lens: torch.Tensor  # int32 [S + 1]
    all_decode: bool  # every sequence has one new token: the flash-decoding kernel


class StepBuffer:
    """A step's metadata in one int32 device buffer, filled by one host-to-device copy.

    Seven small copies and their allocations per step were host time the GPU waited on. The
    host side is pinned so the copy runs asynchronously; it is reused step after step, which is
    safe because every step ends with the sampled ids read back (a sync) before the next one
    fills it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)

    def _reserve(self, n: int) -> None:
        if self._host.numel() >= n:
            return
        size = max(n, 2 * self._host.numel(), 4096)
        pin = self.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.int32, pin_memory=pin)
        self._dev = torch.empty(size, dtype=torch.int32, device=self.device)

    def fill(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Device views of ``parts`` (lists of ints), in order, after one copy. Each part
        starts 16-byte aligned: Triton specializes kernels on pointer alignment, and a view
        whose alignment changed from step to step would compile a kernel variant mid-serving."""
        sizes = [len(x) for x in parts]
        padded = [-(-n // _ALIGN) * _ALIGN for n in sizes]
        total = sum(padded)
        self._reserve(total)
        flat = [
            v for x, room in zip(parts, padded, strict=True) for v in (*x, *[0] * (room - len(x)))
        ]
        self._host[:total] = torch.tensor(flat, dtype=torch.int32)
        dev = self._dev[:total]
        dev.copy_(self._host[:total], non_blocking=True)
        return [v[:n] for v, n in zip(dev.split(padded), sizes, strict=True)]


class TritonBackend(Backend):
    """The Triton kernels on a GPU (under TRITON_INTERPRET=1 also on the CPU, for tests)."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self, device: torch.device, kernels: dict[str, dict[str, dict[str, int]]]) -> None:
        self.device = device
        self.graphs = True  # captured on a GPU; under the interpreter the same buffers, eager
        self.warmup_tokens = M_BUCKETS if device.type == "cuda" else ()  # GEMM per row bucket
        arch = gpu_arch(device)
        self.pinned = kernels.get(arch, {})
        if device.type == "cuda":
            _log_pinned(arch, self.pinned, kernels)
        self.detail = (
            f"{arch}: {len(self.pinned)} pinned GEMM configs"
            if self.pinned
            else f"{arch}: heuristics"
        )
        self._buffer = StepBuffer(device)

    def prepare_int4(self, parts, k, group_size, dtype) -> TritonInt4Weight:  # noqa: ARG002
        return prepare_weight(parts, k, group_size, self.device, self.pinned)  # x sets dtype

    def int4_linear(self, x: torch.Tensor, w: TritonInt4Weight) -> torch.Tensor:
        x = x.contiguous()
        y = w4a16_gemm(x, w.qweight, w.qparams, w.n, w.k, w.group_size, w.config(x.shape[0]))
        return y if w.columns is None else y.index_select(1, w.columns)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)  # fused on GPUs

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x @ weight.T).float()  # cuBLAS

    def kv_write(self, kv: LayerKV, k, v, slot_mapping) -> None:
        kv_write(kv, k, v, slot_mapping)

    def attention(self, q, kv: LayerKV, attn: KernelTensors, scale, sliding_window):
        """All-decode steps take the flash-decoding kernel; anything with a prefill chunk takes
        the variable-length kernel, which handles decode rows mixed in."""
        if attn.all_decode:
            return paged_decode_attention(
                q, kv, attn.block_tables, attn.context_lens, scale, sliding_window
            )
        return paged_prefill_attention(
            q, kv, attn.block_tables, attn.cu_query_lens, attn.context_lens, scale, sliding_window
        )

    def prepare_step(self, step: StepInputs) -> StepTensors:
        width = max(len(t) for t in step.block_tables)
        tables = [t + [0] * (width - len(t)) for t in step.block_tables]
        cu = [0, *itertools.accumulate(step.query_lens)]
        ids, pos, slots, rows, lens, cu_t, flat = self._buffer.fill(
            [
                step.input_ids,
                step.positions,
                step.slot_mapping,
                step.logits_indices,
                step.context_lens,
                cu,
                [b for t in tables for b in t],
            ]
        )
        attn = KernelTensors(flat.view(len(tables), width), lens, cu_t, step.all_decode)
        return StepTensors(ids, pos, slots, rows, attn)

    def decode_attn(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> KernelTensors:
        """Metadata of an all-decode step over static buffers (what a CUDA graph replays)."""
        cu = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=self.device)
        return KernelTensors(block_tables, context_lens, cu, True)


def _log_pinned(arch: str, pinned: dict, kernels: dict) -> None:
    if pinned:
        log.info("triton kernels: %d pinned GEMM configs for %s", len(pinned), arch)
        return
    tuned = ", ".join(sorted(kernels)) or "none"
    log.warning(
        "the artifact has no tuned kernel configs for %s (tuned for: %s); using heuristics. "
        "`lite tune ARTIFACT` on this GPU pins them.",
        arch,
        tuned,
    )
