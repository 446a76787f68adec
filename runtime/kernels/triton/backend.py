"""The triton backend: the artifact's packed weights go to the GEMM as they are on disk
(fused by concatenation, ``runtime/kernels/gpu.py``).

Tile configs come from the artifact's pinned launch config for this GPU architecture (written
by ``lite tune``), so a server starts without autotuning and always runs the same kernels; on
an architecture the artifact was not tuned for, the GEMM's heuristic picks them, with a warning,
and prefill-sized steps (256+ rows) dequantize the weights for torch's dense GEMM
(``triton/gemm.py``'s DequantConfig), which a pin may also choose or overrule.

The pointwise work between the GEMMs runs as three Triton kernels instead of torch's several
per sublayer (at batch 1 a decode step's device time is mostly such small kernels, each costing
its launch and tail): rotary fused into the KV write (``triton/kv_write.py``, bit for bit
torch's result), the residual add with the RMSNorm after it and SiLU-and-mul
(``triton/pointwise.py``). As in the cuda backend, anything those kernels do not take (another
activation, mixed dtypes, rows whose last dimension is not contiguous) runs torch's ops, and
``LITESERVE_TRITON_FUSED=0`` runs torch's ops throughout (to measure the gain).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

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
from runtime.kernels.triton import pointwise
from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
from runtime.kernels.triton.gemm import (
    ACTIVATION_DTYPES,
    M_BUCKETS,
    WARMUP_ROWS,
    LinearConfig,
    choose_config,
    config_from_dict,
    m_bucket,
    w4a16_linear,
)
from runtime.kernels.triton.kv_write import kv_write, rotary_kv_write
from runtime.kernels.triton.launch import PDL_ENV
from runtime.kv.layer import LayerKV

FUSED_ENV = "LITESERVE_TRITON_FUSED"  # "0": torch's pointwise ops instead of the Triton kernels


@dataclass
class TritonInt4Weight(FusedInt4):
    pinned: dict[int, LinearConfig] = field(default_factory=dict)  # by m bucket

    def config(self, m: int) -> LinearConfig:
        cfg = self.pinned.get(m_bucket(m))
        return cfg or choose_config(m, self.n, self.k, self.group_size)


def prepare_weight(
    parts: list[tuple[torch.Tensor, torch.Tensor, int]],
    k: int,
    group_size: int,
    device: torch.device,
    pinned: dict[str, dict[str, int]],
) -> TritonInt4Weight:
    fused = fuse_int4(parts, k, group_size, device)
    configs = {
        b: config_from_dict(pinned[gemm_key(fused.n, k, b)])
        for b in M_BUCKETS
        if gemm_key(fused.n, k, b) in pinned
    }
    return TritonInt4Weight(**vars(fused), pinned=configs)


class TritonBackend(GpuBackend):
    """The Triton kernels on a GPU (under TRITON_INTERPRET=1 also on the CPU, for tests)."""

    name = "triton"
    dtypes = ACTIVATION_DTYPES
    fused_env = FUSED_ENV

    def __init__(self, device: torch.device, kernels: dict[str, dict[str, dict[str, int]]]) -> None:
        super().__init__(device)
        self.warmup_tokens = WARMUP_ROWS if device.type == "cuda" else ()
        arch = gpu_arch(device)
        self.pinned = kernels.get(arch, {})
        if device.type == "cuda":
            log_pinned(arch, self.pinned, kernels, "heuristic configs")
        self.fused = os.environ.get(FUSED_ENV) != "0"
        tuned = f"{len(self.pinned)} pinned GEMM configs" if self.pinned else "heuristics"
        unfused = "" if self.fused else f", torch's pointwise ops ({FUSED_ENV}=0)"
        pdl = f", programmatic launch ({PDL_ENV}=1)" if self.triton_pdl else ""
        self.detail = f"{arch}: {tuned}{unfused}{pdl}"

    def prepare_int4(self, parts, k, group_size, dtype) -> TritonInt4Weight:  # noqa: ARG002
        return prepare_weight(parts, k, group_size, self.device, self.pinned)  # x sets dtype

    def int4_linear(self, x: torch.Tensor, w: TritonInt4Weight) -> torch.Tensor:
        x = x.contiguous()
        y = w4a16_linear(x, w.qweight, w.qparams, w.n, w.k, w.group_size, w.config(x.shape[0]))
        return self.linear_out(y, w)

    def add_rms_norm(self, x, delta, weight, eps):
        tensors = (x, weight) if delta is None else (x, weight, delta)
        if not (self.fused and x.dim() == 2 and rows_of_one_dtype(self.dtypes, *tensors)):
            return super().add_rms_norm(x, delta, weight, eps)
        return pointwise.add_rms_norm(x, delta, weight, eps)

    def act_mul(self, gate_up, hidden_act):
        silu = self.fused and hidden_act == "silu" and gate_up.dim() == 2
        if not (silu and rows_of_one_dtype(self.dtypes, gate_up)):
            return super().act_mul(gate_up, hidden_act)
        return pointwise.silu_mul(gate_up)

    def rotary_kv_write(self, qk, v, rope, kv: LayerKV, slot_mapping):
        if not (self.fused and rows_of_one_dtype(self.dtypes, qk, v, *rope)):
            return super().rotary_kv_write(qk, v, rope, kv, slot_mapping)
        return rotary_kv_write(kv, qk, v, rope, slot_mapping)

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
