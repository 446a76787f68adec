"""The cuda backend: the csrc library's W4A16 GEMM, paged decode attention and KV write.

Weights are the artifact's packed tensors as on disk (fused by concatenation, as for triton);
prefill attention is the Triton variable-length kernel (prefill is compute-bound and that
kernel handles chunked prefill over the paged pool), as is decode attention for a head_dim the
csrc kernel is not built for (said once in the log); norms and the lm_head are torch's.
Every kernel launches on torch's current stream, so the decode CUDA graphs capture them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.kernels.cuda import gemm_plan
from runtime.kernels.cuda.library import check
from runtime.kernels.gpu import (
    FusedInt4,
    GpuBackend,
    KernelTensors,
    fuse_int4,
    gemm_key,
    gpu_arch,
)
from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from runtime.kv.format import STORAGE_KINDS
from runtime.kv.layer import LayerKV

log = logging.getLogger("runtime.kernels")
HEAD_DIMS = (64, 96, 128)  # what the decode attention kernel is instantiated for


@dataclass
class CudaInt4Weight(FusedInt4):
    pinned: dict[int, dict[str, int]] = field(default_factory=dict)  # by m bucket


class CudaBackend(GpuBackend):
    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(
        self,
        device: torch.device,
        kernels: dict[str, dict[str, dict[str, int]]],
        lib: ctypes.CDLL,
    ) -> None:
        super().__init__(device)
        self.lib = lib
        self.arch = gpu_arch(device)
        self.pinned = kernels.get(f"cuda/{self.arch}", {})
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.configs = gemm_plan.configs(lib)
        self.warmup_tokens = gemm_plan.M_BUCKETS  # Triton's prefill attention compiles per size
        tuned = f"{len(self.pinned)} pinned GEMM configs" if self.pinned else "planned GEMM configs"
        self.detail = f"{self.arch}: csrc {Path(lib._name).name}, {tuned}"

    def prepare_int4(self, parts, k, group_size, dtype) -> CudaInt4Weight:  # noqa: ARG002
        fused = fuse_int4(parts, k, group_size, self.device)
        pinned = {
            b: self.pinned[gemm_key(fused.n, k, b)]
            for b in gemm_plan.M_BUCKETS
            if gemm_key(fused.n, k, b) in self.pinned
        }
        return CudaInt4Weight(**vars(fused), pinned=pinned)

    def int4_linear(self, x: torch.Tensor, w: CudaInt4Weight) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        plan = gemm_plan.plan(self.configs, m, w.n, w.k, w.group_size, self.sm_count, w.pinned)
        y = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
        workspace = (
            torch.empty(plan.workspace_floats, dtype=torch.float32, device=x.device)
            if plan.workspace_floats
            else None
        )
        status = self.lib.lsq_w4a16_gemm(
            x.data_ptr(),
            x.stride(0),
            w.qweight.data_ptr(),
            w.qparams.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            None if workspace is None else workspace.data_ptr(),
            m,
            w.n,
            w.k,
            w.group_size,
            STORAGE_KINDS[x.dtype],
            plan.config,
            plan.split_k,
            torch.cuda.current_stream(x.device).cuda_stream,
        )
        check(status, "lsq_w4a16_gemm")
        return self.linear_out(y, w)

    def kv_write(self, kv: LayerKV, k, v, slot_mapping) -> None:
        s = kv.spec
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        write = (
            self.lib.lsq_kv_write
            if slot_mapping.dtype == torch.int64
            else self.lib.lsq_kv_write_i32
        )
        status = write(
            k.data_ptr(),
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            STORAGE_KINDS[k.dtype],
            slot_mapping.data_ptr(),
            slot_mapping.shape[0],
            *(t.data_ptr() if t is not None else None for t in _pool(kv)),
            s.storage_kind,
            s.num_kv_heads,
            s.head_dim,
            s.block_size,
            torch.cuda.current_stream(k.device).cuda_stream,
        )
        check(status, "lsq_kv_write")

    def attention(self, q, kv: LayerKV, attn: KernelTensors, scale, sliding_window):
        if not attn.all_decode:
            return paged_prefill_attention(
                q, kv, attn.block_tables, attn.cu_query_lens, attn.context_lens, scale,
                sliding_window,
            )  # fmt: skip
        return self._decode(q, kv, attn, scale, sliding_window)

    def _decode(self, q, kv: LayerKV, attn: KernelTensors, scale, sliding_window):
        s = kv.spec
        if s.head_dim not in HEAD_DIMS or s.dtype == torch.float32:
            self._say_triton_decode(s.head_dim)
            return paged_decode_attention(
                q, kv, attn.block_tables, attn.context_lens, scale, sliding_window
            )
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        batch, max_blocks = attn.block_tables.shape
        heads = q.shape[1]
        partition = self.lib.lsq_paged_decode_partition_size(
            batch, heads, s.num_kv_heads, max_blocks, s.block_size, self.sm_count
        )  # from shapes only: a CUDA graph replays it whatever the context lengths
        floats = self.lib.lsq_paged_decode_workspace_floats(
            batch, heads, s.head_dim, max_blocks, s.block_size, partition
        )
        if partition < 0 or floats < 0:
            raise ValueError(f"the cuda decode attention refused {batch}x{heads} heads, {s}")
        workspace = torch.empty(floats, dtype=torch.float32, device=q.device) if floats else None
        status = self.lib.lsq_paged_decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            *(t.data_ptr() if t is not None else None for t in _pool(kv)),
            s.storage_kind, STORAGE_KINDS[q.dtype],
            attn.block_tables.data_ptr(), attn.block_tables.stride(0), max_blocks,
            attn.context_lens.data_ptr(),
            batch, q.shape[1], s.num_kv_heads, s.head_dim, s.block_size,
            sliding_window or 0, scale, partition,
            None if workspace is None else workspace.data_ptr(),
            torch.cuda.current_stream(q.device).cuda_stream,
        )  # fmt: skip
        check(status, "lsq_paged_decode_attention")
        return out

    @functools.cache  # noqa: B019 (one backend per engine; says it once)
    def _say_triton_decode(self, head_dim: int) -> None:
        log.warning(
            "cuda backend: decode attention for head_dim %d runs Triton's kernel (the csrc "
            "kernel is built for head_dim %s)",
            head_dim,
            ", ".join(map(str, HEAD_DIMS)),
        )


def _pool(kv: LayerKV) -> tuple[torch.Tensor | None, ...]:
    return (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)
