"""The KV write as one Triton kernel: quantize (or store) the new tokens' K and V straight into
their pool slots.

Why a kernel: ``KVCache.write`` costs a dozen small torch ops per layer (stack, min, max, the
fp16 rounding fix-ups, divide, round, pack, six scatters); on the decode path that is pure
launch overhead. Here one program owns one (token, KV head) and does K and V end to end.

Bit-exactness with :func:`runtime.kv.format.quantize_kv` is the contract (the reference
attention and the CPU backend read the same pool), so every step is an exactly rounded
operation whose result does not depend on the backend:

* fp16 ``zero`` rounded down and ``scale`` rounded up are an RTNE conversion followed by a
  one-ulp step on the fp16 bit pattern (torch's ``nextafter``), done with integer arithmetic;
* both divisions use ``tl.math.div_rn`` (IEEE round-to-nearest; plain ``/`` lowers to an
  approximate divide on NVIDIA GPUs), subtractions are single fp32 ops;
* round-half-to-even is ``floor`` plus an exact look at the fraction: libdevice's ``rint``
  has no interpreter implementation, and ``floor(y + 0.5)`` is wrong just below a tie because
  the addition itself can round up.

The codes, scales and zeros therefore equal the reference bit for bit (the tests compare them
exactly). For ``kv_quant="none"`` the kernel only scatters: a dtype mismatch is converted with
torch beforehand, so the cast is torch's own (the interpreter truncates fp32 -> bf16).

int4 packs codes ``2i`` and ``2i + 1`` into one byte: the head vector is loaded as a
``[D / 2, 2]`` tile, so each byte is a row-sum of the two shifted codes (int8 uses ``[D, 1]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.device import check_devices
from runtime.kv.format import FP16_MAX, FP16_TINY, QMAX
from runtime.kv.layer import LayerKV

# the reference's constants, as the compile-time values a kernel may read
_MAX = tl.constexpr(FP16_MAX)
_TINY = tl.constexpr(FP16_TINY)
_MINUS_TINY_BITS = tl.constexpr(-32767)  # int16 view of 0x8001, the fp16 just below zero
_QMAX_INT8 = tl.constexpr(QMAX["int8"])
_QMAX_INT4 = tl.constexpr(QMAX["int4"])


@triton.jit
def _fp16_down(x):
    """fp32 scalar -> the largest fp16 <= x (torch: nextafter towards -inf after RTNE)."""
    h = x.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    below = tl.where(h > 0, bits - 1, tl.where(h < 0, bits + 1, _MINUS_TINY_BITS))
    return tl.where(h.to(tl.float32) > x, below.to(tl.int16).to(tl.float16, bitcast=True), h)


@triton.jit
def _fp16_up_positive(x):
    """fp32 scalar > 0 -> the smallest fp16 >= x."""
    h = x.to(tl.float16)
    above = (h.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < x, above, h)


@triton.jit
def _round_half_even(y):
    """fp32 y >= 0 -> int32 nearest integer, ties to even (exact: y - floor(y) never rounds)."""
    r = tl.floor(y)
    frac = y - r
    n = r.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((n & 1) == 1))
    return n + up.to(tl.int32)


@triton.jit
def _store_quantized(
    x_row,
    codes_row,
    scale_at,
    zero_at,
    slot,
    HEAD_DIM: tl.constexpr,
    QMAX_: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Quantize one head vector (``x_row`` points at element 0) into one slot (< 0: skip).

    Masks combine with the slot test as tensors (``d * 0 + slot``): triton 3.9's interpreter
    rejects a block mask made by ``&`` with a scalar."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, PACK)
    d = offs_p[:, None] * PACK + offs_j[None, :]  # [BLOCK_P, PACK]: element index
    in_dim = d < HEAD_DIM
    valid = slot >= 0
    x = tl.load(x_row + d, mask=in_dim & (d * 0 + slot >= 0), other=0.0).to(tl.float32)
    x = tl.minimum(tl.maximum(x, -_MAX), _MAX)
    lo = tl.min(tl.min(tl.where(in_dim, x, float("inf")), axis=1), axis=0)
    hi = tl.max(tl.max(tl.where(in_dim, x, float("-inf")), axis=1), axis=0)
    zero = _fp16_down(lo)
    zero_f = zero.to(tl.float32)
    step = tl.maximum(tl.math.div_rn(hi - zero_f, QMAX_ * 1.0), _TINY)
    scale = _fp16_up_positive(step)
    q = _round_half_even(tl.math.div_rn(x - zero_f, scale.to(tl.float32)))
    q = tl.minimum(tl.maximum(q, 0), QMAX_)
    shift = (offs_j * (8 // PACK))[None, :]
    packed = tl.sum(q << shift, axis=1).to(tl.uint8)  # disjoint bits: the sum is an OR
    tl.store(codes_row + offs_p, packed, mask=(offs_p * PACK < HEAD_DIM) & (offs_p * 0 + slot >= 0))
    tl.store(scale_at, scale, mask=valid)
    tl.store(zero_at, zero, mask=valid)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_co,
    stride_ch,
    stride_pb,
    stride_po,
    stride_ph,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,  # 0 none, 1 int8, 2 int4
    BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k_row = k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh
    v_row = v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh
    cache_row = block * stride_cb + offset * stride_co + h * stride_ch
    if QUANT == 0:
        offs = tl.arange(0, BLOCK_P)
        mask = (offs < HEAD_DIM) & (offs * 0 + slot >= 0)  # see _store_quantized
        tl.store(k_cache + cache_row + offs, tl.load(k_row + offs, mask=mask), mask=mask)
        tl.store(v_cache + cache_row + offs, tl.load(v_row + offs, mask=mask), mask=mask)
    else:
        qmax: tl.constexpr = _QMAX_INT8 if QUANT == 1 else _QMAX_INT4
        pack: tl.constexpr = 1 if QUANT == 1 else 2
        param = block * stride_pb + offset * stride_po + h * stride_ph
        _store_quantized(
            k_row, k_cache + cache_row, k_scale + param, k_zero + param, slot,
            HEAD_DIM, qmax, pack, BLOCK_P,
        )  # fmt: skip
        _store_quantized(
            v_row, v_cache + cache_row, v_scale + param, v_zero + param, slot,
            HEAD_DIM, qmax, pack, BLOCK_P,
        )  # fmt: skip


def _check(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    s = kv.spec
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be int32 or int64 [T]; got {slots.dtype} {list(slots.shape)}"
        )
    expected = (slots.shape[0], s.num_kv_heads, s.head_dim)
    if tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(
            f"kv_write expects k, v {list(expected)} for slot_mapping [{slots.shape[0]}]; got "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    check_devices(kv.device, k=k, v=v, slot_mapping=slots)
    # an out-of-range slot would write outside the pool; checked where it costs no GPU sync
    if slots.device.type == "cpu" and slots.numel() and int(slots.max()) >= kv.num_slots:
        raise ValueError(f"slot {int(slots.max())} out of range for {kv.num_slots} slots")


def kv_write(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[T, Hkv, D]`` at ``slot_mapping [T]`` (int32 or int64; slots < 0
    are padding and skipped), quantized like :meth:`LayerKV.write`, bit for bit. Slots past
    the pool are rejected when ``slot_mapping`` is on the CPU (on a GPU the check would sync
    every layer; the engine's block manager only hands out valid slots)."""
    _check(kv, k, v, slot_mapping)
    s = kv.spec
    if slot_mapping.shape[0] == 0:
        return
    if not kv.quantized:
        k, v = k.to(s.dtype), v.to(s.dtype)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    pool = kv.tensors()
    pack = 2 if s.kv_quant == "int4" else 1
    _kv_write_kernel[(slot_mapping.shape[0], s.num_kv_heads)](
        k, v, slot_mapping, *pool,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *pool[0].stride()[:3], *pool[2].stride()[:3],
        BLOCK_SIZE=s.block_size,
        HEAD_DIM=s.head_dim,
        QUANT=s.quant_id,
        BLOCK_P=triton.next_power_of_2(s.head_dim) // pack,
        num_warps=1,  # one head vector per program: a warp covers it, reductions stay in-warp
    )  # fmt: skip
