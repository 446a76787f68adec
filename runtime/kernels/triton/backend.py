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

import logging
from dataclasses import dataclass, field

import torch

from runtime.kernels import cpu
from runtime.kernels.ops import Backend
from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from runtime.kernels.triton.gemm import (
    M_BUCKETS,
    GemmConfig,
    heuristic_config,
    m_bucket,
    w4a16_gemm,
)
from runtime.kernels.triton.kv_write import kv_write
from runtime.model.context import StepContext

log = logging.getLogger("runtime.kernels")
N_TILE = 64


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


def _linear(x: torch.Tensor, w: TritonInt4Weight) -> torch.Tensor:
    x = x.contiguous()
    y = w4a16_gemm(x, w.qweight, w.qparams, w.n, w.k, w.group_size, w.config(x.shape[0]))
    return y if w.columns is None else y.index_select(1, w.columns)


def _attention(
    q: torch.Tensor, ctx: StepContext, layer: int, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """All-decode steps take the flash-decoding kernel; anything with a prefill chunk takes the
    variable-length kernel, which handles decode rows mixed in."""
    t = ctx.tensors
    if t.all_decode:
        return paged_decode_attention(
            q, ctx.cache, layer, t.block_tables, t.context_lens, scale, sliding_window
        )
    return paged_prefill_attention(
        q, ctx.cache, layer, t.block_tables, t.cu_query_lens, t.context_lens, scale, sliding_window
    )


def triton_backend(device: torch.device, kernels: dict[str, dict[str, dict[str, int]]]) -> Backend:
    arch = gpu_arch(device)
    pinned = kernels.get(arch, {})
    if device.type == "cuda":
        if pinned:
            log.info("triton kernels: %d pinned GEMM configs for %s", len(pinned), arch)
        else:
            tuned = ", ".join(sorted(kernels)) or "none"
            log.warning(
                "the artifact has no tuned kernel configs for %s (tuned for: %s); using "
                "heuristics. `lite tune ARTIFACT` on this GPU pins them.",
                arch,
                tuned,
            )

    def prepare(parts, k, group_size, dtype):  # noqa: ARG001 (the GEMM takes x's dtype)
        return prepare_weight(parts, k, group_size, device, pinned)

    return Backend(
        name="triton",
        device=device,
        prepare_int4=prepare,
        int4_linear=_linear,
        paged_attention=_attention,
        rms_norm=cpu.rms_norm,  # torch's fused rms_norm runs on the GPU as well
        kv_write=kv_write,
        logits=cpu.logits,  # torch's matmul (cuBLAS on the GPU)
        dtypes=(torch.float16, torch.bfloat16),
        detail=f"{arch}: {len(pinned)} pinned GEMM configs" if pinned else f"{arch}: heuristics",
    )
