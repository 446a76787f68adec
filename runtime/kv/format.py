"""The paged KV pool's format, with online per-token, per-KV-head asymmetric int8/int4
quantization: what a block holds, how codes are made and read back, and the storage codes the
C and Triton kernels take.

The pool is a fixed set of blocks, each holding ``block_size`` token slots. A token's slot is
``block_id * block_size + offset``; the block manager hands out block ids and the model runner
turns positions into slots (``slot_mapping``) and per-sequence ``block_tables``.

Storage, per layer ``l`` (Python lists indexed by layer, every tensor claimed up front with
``torch.zeros`` so the pool's memory is taken when the engine starts):

``kv_quant == "none"``
    ``k_cache[l]``, ``v_cache[l]``: ``[num_blocks, block_size, H, D]`` in ``spec.dtype``.
    ``k_scale``/``k_zero``/``v_scale``/``v_zero`` are empty lists.

``kv_quant == "int8"``
    ``k_cache[l]``, ``v_cache[l]``: uint8 codes ``[num_blocks, block_size, H, D]``;
    ``k_scale[l]``, ``k_zero[l]``, ``v_scale[l]``, ``v_zero[l]``: fp16
    ``[num_blocks, block_size, H]``, one (scale, zero) per token per KV head.

``kv_quant == "int4"``
    as int8, but codes are ``[num_blocks, block_size, H, D // 2]`` uint8 with two 4-bit codes
    per byte: element ``2i`` in the low nibble, element ``2i + 1`` in the high nibble.

Quantization (one token's ``D``-vector of one KV head at a time, ``qmax`` = 255 or 15):

* ``zero`` is the **additive offset**, not an integer zero-point: ``zero = fp16(min(x))``
  rounded *down* (towards -inf), and ``scale = fp16((max(x) - zero) / qmax)`` rounded *up*
  (never below the smallest positive fp16, so a constant vector never divides by zero).
* ``q = clamp(round((x - zero) / scale), 0, qmax)`` (round half to even).
* **Dequantization is ``x = q * scale + zero``** (one fused multiply-add; this is the
  ``(s, -z*s)`` form of ``(q - z) * s`` with ``z = -zero / scale``). Compute it in fp32 and
  cast to ``spec.dtype``.

Because ``zero <= min`` and ``zero + qmax * scale >= max`` (up to fp32 rounding), no code is
clamped by more than rounding, and the error per element is at most ``scale / 2``, where
``scale`` exceeds the ideal ``(max - min) / qmax`` only by fp16 rounding (relative 2**-10,
plus the rounding of ``min`` divided by ``qmax``, plus 2**-24 absolute in the subnormal
range). A constant vector never divides by zero and comes back within fp16 rounding; when its
value is representable in fp16 (always, for fp16 KV) ``zero`` is that value, ``q = 0`` and it
comes back exactly. Values beyond the fp16 range (|x| > 65504) saturate; NaN/inf are not
supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_QUANT = ("none", "int8", "int4")
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QMAX = {"int8": 255, "int4": 15}
# Storage kinds, the enum of cpu_decode.c: an unquantized pool by its dtype, else its codes.
# Activation dtypes passed to the C kernels use the same numbers.
STORAGE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, "int8": 3, "int4": 4}
# bytes of per-token, per-head quantization parameters: fp16 scale + fp16 zero
PARAM_BYTES = 4
FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive (subnormal) fp16


@dataclass(frozen=True)
class KVSpec:
    """Shape and policy of the KV pool. ``dtype`` is the dtype of unquantized K/V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_quant: str
    dtype: torch.dtype

    def validate(self) -> None:
        if self.kv_quant not in KV_QUANT:
            raise ValueError(
                f"unknown kv_quant {self.kv_quant!r}: expected one of {', '.join(KV_QUANT)}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be float16, bfloat16 or float32, got {self.dtype}")
        if self.kv_quant == "int4" and self.head_dim % 2:
            raise ValueError(
                f"kv_quant int4 packs two codes per byte: head_dim {self.head_dim} is odd"
            )

    def bytes_per_token(self) -> int:
        """K and V of one token over all layers, including scale/zero storage."""
        self.validate()
        if self.kv_quant == "none":
            per_head = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        elif self.kv_quant == "int8":
            per_head = self.head_dim + PARAM_BYTES
        else:
            per_head = self.head_dim // 2 + PARAM_BYTES
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    @property
    def storage_kind(self) -> int:
        """The C kernels' code for what the pool stores (STORAGE_KINDS)."""
        return STORAGE_KINDS[self.dtype if self.kv_quant == "none" else self.kv_quant]

    @property
    def quant_id(self) -> int:
        """The Triton kernels' QUANT constant: the index in KV_QUANT."""
        return KV_QUANT.index(self.kv_quant)


def quantize_kv(x: torch.Tensor, kv_quant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` along its last dim; returns uint8 codes (packed for int4) and
    fp16 ``scale``, ``zero`` of shape ``x.shape[:-1]``. See the module docstring."""
    qmax = QMAX[kv_quant]
    x = x.float().clamp(-FP16_MAX, FP16_MAX)
    lo, hi = torch.aminmax(x, dim=-1)
    zero = lo.half()
    down = torch.tensor(-FP16_MAX, dtype=torch.float16, device=x.device)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, down), zero)
    step = ((hi - zero.float()) / qmax).clamp_min(FP16_TINY)
    scale = step.half()
    up = torch.tensor(float("inf"), dtype=torch.float16, device=x.device)
    scale = torch.where(scale.float() < step, torch.nextafter(scale, up), scale)
    q = torch.round((x - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, qmax)
    q = q.to(torch.uint8)
    if kv_quant == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale, zero


def dequantize_kv(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kv_quant: str, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: ``q * scale + zero`` in fp32, cast to ``dtype``."""
    if kv_quant == "int4":
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    x = codes.float() * scale.float()[..., None] + zero.float()[..., None]
    return x.to(dtype)
