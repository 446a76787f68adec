"""The cuda backend: the csrc library's W4A16 GEMM, paged decode attention and KV write.

Weights are the artifact's packed tensors as on disk (fused by concatenation, as for triton);
prefill attention is the Triton variable-length kernel (prefill is compute-bound and that
kernel handles chunked prefill over the paged pool), as is decode attention for a head_dim the
csrc kernel is not built for (said once in the log); Qwen3's q/k norms and the lm_head are
torch's.
Every kernel launches on torch's current stream, so the decode CUDA graphs capture them.

The pointwise work between the GEMMs runs as three csrc kernels per sublayer boundary instead
of torch's several: rotary with the KV write (``lsq_rotary_kv_write``, bit for bit torch's
result), the residual add with the RMSNorm after it (``lsq_add_rms_norm``) and SiLU-and-mul
(``lsq_silu_mul``). At batch 1 a decode step's kernels are mostly such small ones, each costing
its launch and tail. ``LITESERVE_CUDA_FUSED=0`` runs torch's ops instead (to measure the gain).
On sm_90 and newer the csrc kernels launch with programmatic dependent launch, each starting
while the one before it finishes (csrc/common.cuh); ``LITESERVE_CUDA_PDL=0`` turns that off
for the process. ``LITESERVE_CUDA_SWAP=0`` plans the GEMMs without the decode tiles that swap
the mma's operands (csrc/README.md), to time them against the others end to end.

Prefill-sized GEMMs may run as the weights dequantized plus a dense GEMM (cuBLAS) where the
planner finds that faster (runtime/kernels/cuda/gemm_plan.py; ``lite tune`` pins either).

On the CPU (only under TRITON_INTERPRET=1, for tests) the same backend calls the library's
``lsq_emulate_*`` twins, which run the kernels' own block bodies on host memory
(csrc/simt.cuh), and plans launches as for an H200: the engine's glue to the csrc kernels is
tested end to end without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.device import check_devices
from runtime.kernels.counters import arrival_counters
from runtime.kernels.cuda import gemm_plan, w4a16
from runtime.kernels.cuda.library import check, probe
from runtime.kernels.gpu import (
    FusedInt4,
    GpuBackend,
    KernelTensors,
    fuse_int4,
    gemm_key,
    gpu_arch,
    log_pinned,
    rows_of_one_dtype,
)
from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from runtime.kv.format import STORAGE_KINDS
from runtime.kv.layer import LayerKV

log = logging.getLogger("runtime.kernels")
HEAD_DIMS = (64, 96, 128)  # what the decode attention kernel is instantiated for
EMULATED_SMS, EMULATED_ARCH = 132, "sm_90"  # the emulated GPU plans its launches as an H200
FUSED_ENV = "LITESERVE_CUDA_FUSED"  # "0": torch's pointwise ops instead of the csrc kernels
PDL_ENV = "LITESERVE_CUDA_PDL"  # "0": plain stream order instead of programmatic launch
SWAP_ENV = "LITESERVE_CUDA_SWAP"  # "0": the GEMM planner without the swapped decode tiles


@dataclass
class CudaInt4Weight(FusedInt4):
    pinned: dict[int, dict[str, int]] = field(default_factory=dict)  # by m bucket


class CudaBackend(GpuBackend):
    name = "cuda"
    dtypes = (torch.float16, torch.bfloat16)
    fused_env = FUSED_ENV

    def __init__(
        self,
        device: torch.device,
        kernels: dict[str, dict[str, dict[str, int]]],
        lib: ctypes.CDLL,
    ) -> None:
        super().__init__(device)
        self.lib = lib
        self.emulated = device.type == "cpu"
        self.arch = gpu_arch(device)
        self.pinned = kernels.get(f"cuda/{self.arch}", {})
        if not self.emulated:
            log_pinned(f"cuda/{self.arch}", self.pinned, kernels, "the planner's configs")
        self.plan_arch = EMULATED_ARCH if self.emulated else self.arch
        self.sm_count = (
            EMULATED_SMS
            if self.emulated
            else torch.cuda.get_device_properties(device).multi_processor_count
        )
        self.swap = os.environ.get(SWAP_ENV) != "0"
        self.configs = tuple(c for c in gemm_plan.configs(lib) if self.swap or not c.swap_ab)
        self.fused = os.environ.get(FUSED_ENV) != "0"
        self.pdl = os.environ.get(PDL_ENV) != "0"
        lib.lsq_programmatic_launch(int(self.pdl))  # process-wide: this engine's choice
        # Triton's prefill attention compiles per size (nothing to warm up when emulated)
        self.warmup_tokens = () if self.emulated else gemm_plan.M_BUCKETS
        tuned = f"{len(self.pinned)} pinned GEMM configs" if self.pinned else "planned GEMM configs"
        where = ", emulated on the CPU" if self.emulated else f", {probe(lib).versions()}"
        unfused = "" if self.fused else f", torch's pointwise ops ({FUSED_ENV}=0)"
        serial = "" if self.pdl else f", no programmatic launch ({PDL_ENV}=0)"
        unswapped = "" if self.swap else f", no swapped GEMM tiles ({SWAP_ENV}=0)"
        self.detail = (
            f"{self.arch}: csrc {Path(lib._name).name}{where}, {tuned}{unfused}{serial}{unswapped}"
        )

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def prepare_int4(self, parts, k, group_size, dtype) -> CudaInt4Weight:  # noqa: ARG002
        fused = fuse_int4(parts, k, group_size, self.device)
        pinned = {}
        for b in gemm_plan.M_BUCKETS:
            entry = self.pinned.get(gemm_key(fused.n, k, b))
            if entry is None:
                continue
            try:  # checked once here, not on every call
                gemm_plan.plan(self.configs, b, fused.n, k, group_size, 1, {b: entry})
            except ValueError as e:
                log.warning("ignoring a pinned GEMM config of the artifact: %s", e)
                continue
            pinned[b] = entry
        return CudaInt4Weight(**vars(fused), pinned=pinned)

    def int4_linear(self, x: torch.Tensor, w: CudaInt4Weight) -> torch.Tensor:
        m = x.shape[0]
        pin = w.pinned.get(gemm_plan.m_bucket(m))
        plan = self._plan(m, w.n, w.k, w.group_size, None if pin is None else tuple(pin.items()))
        y = w4a16.linear(
            self.lib, x, w.qweight, w.qparams, w.n, w.k, w.group_size, plan, self.emulated
        )
        return self.linear_out(y, w)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one backend per engine)
    def _plan(self, m: int, n: int, k: int, group_size: int, pin: tuple | None) -> gemm_plan.Plan:
        """The plan of one call, remembered: ranking the candidates takes about 0.5 ms of
        Python, paid per linear per eager step otherwise."""
        pinned = None if pin is None else {gemm_plan.m_bucket(m): dict(pin)}
        return gemm_plan.plan(
            self.configs, m, n, k, group_size, self.sm_count, pinned, self.plan_arch
        )

    def _call(self, name: str, *args) -> None:
        """The library's entry point ``name`` on torch's current stream, or its emulated twin."""
        if self.emulated:
            status = getattr(self.lib, f"lsq_emulate_{name[4:]}")(*args)
        else:
            status = getattr(self.lib, name)(*args, self._stream())
        check(self.lib, status, name)

    def add_rms_norm(self, x, delta, weight, eps):
        tensors = (x, weight) if delta is None else (x, weight, delta)
        if not (self.fused and x.dim() == 2 and rows_of_one_dtype(STORAGE_KINDS, *tensors)):
            return super().add_rms_norm(x, delta, weight, eps)
        if weight.shape != x.shape[1:] or (delta is not None and delta.shape != x.shape):
            shapes = f"x {list(x.shape)}, weight {list(weight.shape)}"
            extra = "" if delta is None else f", delta {list(delta.shape)}"
            raise ValueError(f"add_rms_norm: shapes do not match: {shapes}{extra}")
        given = {"x": x, "weight": weight} | ({} if delta is None else {"delta": delta})
        check_devices(self.device, owner="the backend", **given)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        x_out = x if delta is None else torch.empty_like(out)
        rows, n = x.shape
        self._call(
            "lsq_add_rms_norm",
            x.data_ptr(), x.stride(0),
            None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
            x_out.data_ptr(), x_out.stride(0),
            weight.data_ptr(), out.data_ptr(), out.stride(0),
            rows, n, STORAGE_KINDS[x.dtype], eps,
        )  # fmt: skip
        return x_out, out

    def act_mul(self, gate_up, hidden_act):
        silu = self.fused and hidden_act == "silu" and gate_up.dim() == 2
        if not (silu and rows_of_one_dtype(STORAGE_KINDS, gate_up)):
            return super().act_mul(gate_up, hidden_act)
        if gate_up.shape[1] % 2:
            raise ValueError(f"act_mul: gate_up {list(gate_up.shape)} is not gate and up halves")
        check_devices(self.device, owner="the backend", gate_up=gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
        self._call(
            "lsq_silu_mul",
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
            rows, n, STORAGE_KINDS[gate_up.dtype],
        )  # fmt: skip
        return out

    def rotary_kv_write(self, qk, v, rope, kv: LayerKV, slot_mapping):
        cos, sin = (t.squeeze(1) for t in rope)
        if (
            not (self.fused and rows_of_one_dtype(STORAGE_KINDS, qk, v, cos, sin))
            or cos.stride() != sin.stride()
        ):
            return super().rotary_kv_write(qk, v, rope, kv, slot_mapping)
        s = kv.spec
        t, heads = qk.shape[0], qk.shape[1] - v.shape[1]
        want = (t, s.num_kv_heads, s.head_dim)
        if v.shape != want or qk.shape[2] != s.head_dim or heads < 1 or slot_mapping.shape != (t,):
            raise ValueError(
                f"rotary_kv_write: qk {list(qk.shape)}, v {list(v.shape)}, slot_mapping "
                f"{list(slot_mapping.shape)} do not fit the pool's {s.num_kv_heads} KV heads of "
                f"{s.head_dim}"
            )
        if cos.shape != (t, s.head_dim // 2):
            raise ValueError(f"rotary_kv_write: cos {list(cos.shape)} for {t} tokens of {s}")
        check_devices(kv.device, qk=qk, v=v, cos=cos, sin=sin, slot_mapping=slot_mapping)
        q = torch.empty(t, heads, qk.shape[2], dtype=qk.dtype, device=qk.device)
        k = qk[:, heads:]
        self._call(
            "lsq_rotary_kv_write",
            qk.data_ptr(), qk.stride(0), qk.stride(1), q.data_ptr(), q.stride(0), q.stride(1),
            heads, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            STORAGE_KINDS[qk.dtype], slot_mapping.data_ptr(), slot_mapping.element_size(), t,
            *_pool(kv),
            s.storage_kind, s.num_kv_heads, s.head_dim, s.block_size,
        )  # fmt: skip
        return q

    def kv_write(self, kv: LayerKV, k, v, slot_mapping) -> None:
        s = kv.spec
        check_devices(kv.device, k=k, v=v, slot_mapping=slot_mapping)
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        inputs = (k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1))
        inputs += (STORAGE_KINDS[k.dtype], slot_mapping.data_ptr())
        rest = (
            slot_mapping.shape[0],
            *_pool(kv),
            s.storage_kind,
            s.num_kv_heads,
            s.head_dim,
            s.block_size,
        )
        if self.emulated:  # one entry point, told the slots' width
            status = self.lib.lsq_emulate_kv_write(*inputs, slot_mapping.element_size(), *rest)
        elif slot_mapping.dtype == torch.int64:
            status = self.lib.lsq_kv_write(*inputs, *rest, self._stream())
        else:
            status = self.lib.lsq_kv_write_i32(*inputs, *rest, self._stream())
        check(self.lib, status, "lsq_kv_write")

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
        check_devices(
            kv.device, q=q, block_tables=attn.block_tables, context_lens=attn.context_lens
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
        # the partitions merge in the decode launch itself, counting in on these
        stream = 0 if self.emulated else self._stream()
        counters = arrival_counters(q.device)
        args = (
            q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            *_pool(kv),
            s.storage_kind, STORAGE_KINDS[q.dtype],
            attn.block_tables.data_ptr(), attn.block_tables.stride(0), max_blocks,
            attn.context_lens.data_ptr(),
            batch, q.shape[1], s.num_kv_heads, s.head_dim, s.block_size,
            sliding_window or 0, scale, partition,
            None if workspace is None else workspace.data_ptr(),
            counters.data_ptr(), counters.numel(),
        )  # fmt: skip
        if self.emulated:
            status = self.lib.lsq_emulate_paged_decode_attention(*args)
        else:
            status = self.lib.lsq_paged_decode_attention(*args, stream)
        check(self.lib, status, "lsq_paged_decode_attention")
        return out

    @functools.cache  # noqa: B019 (one backend per engine; says it once)
    def _say_triton_decode(self, head_dim: int) -> None:
        log.warning(
            "cuda backend: decode attention for head_dim %d runs Triton's kernel (the csrc "
            "kernel is built for head_dim %s)",
            head_dim,
            ", ".join(map(str, HEAD_DIMS)),
        )


def _pool(kv: LayerKV) -> tuple[int | None, ...]:
    """The layer's pool as the entry points take it: k, v, k_scale, k_zero, v_scale, v_zero
    (None where an unquantized pool has no scales)."""
    tensors = (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)
    return tuple(None if t is None else t.data_ptr() for t in tensors)
