"""The KV write as one Triton kernel: quantize (or store) the new tokens' K and V straight into
their pool slots; and the same write with rotary fused in front of it.

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
exactly). For ``kv_quant="none"`` the kernel stores the values converted to the pool's dtype
by ``rounding.round_to``, torch's conversion bit for bit (the interpreter's own fp32 -> bf16
cast truncates).

int4 packs codes ``2i`` and ``2i + 1`` into one byte: the head vector is loaded as a
``[D / 2, 2]`` tile, so each byte is a row-sum of the two shifted codes (int8 uses ``[D, 1]``).

Rotary (:func:`rotary_kv_write`): the model's rotate-half rotation of the queries and K, then
the write, in one launch where ``apply_rotary`` and the write took about eight kernels. One
program per (token, head) over the query heads and then the KV heads: a query head is rotated
into the output, a KV head's K is rotated and written with its V. Each product and each sum is
rounded to the activations' dtype as ``apply_rotary``'s torch ops round them (each computes in
fp32 and rounds once: a product of two 16-bit values is exact in fp32, and fp32 carries more
than twice the 16-bit formats' precision, so the fp32 sum rounded again is the correctly
rounded 16-bit sum), so queries and pool equal ``apply_rotary`` then :func:`kv_write` bit for
bit. No fp32 product meets an add before its rounding, so the compiler has no multiply-add to
contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.device import check_devices
from runtime.kernels.triton.gemm import ACTIVATION_DTYPES
from runtime.kernels.triton.launch import pdl_launch, wait_for_producers
from runtime.kernels.triton.rounding import round_to
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
def _head_tile(HEAD_DIM: tl.constexpr, PACK: tl.constexpr, BLOCK_P: tl.constexpr):
    """A head vector's element indices as a ``[BLOCK_P, PACK]`` tile (PACK 2: int4's byte
    pairs, one row per byte), and which of them are in the head."""
    d = tl.arange(0, BLOCK_P)[:, None] * PACK + tl.arange(0, PACK)[None, :]
    return d, d < HEAD_DIM


@triton.jit
def _store_quantized(
    x,
    in_dim,
    codes_row,
    scale_at,
    zero_at,
    slot,
    HEAD_DIM: tl.constexpr,
    QMAX_: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Quantize one head vector (fp32, a ``_head_tile``) into one slot (< 0: skip).

    Masks combine with the slot test as tensors (``d * 0 + slot``): triton 3.9's interpreter
    rejects a block mask made by ``&`` with a scalar."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_j = tl.arange(0, PACK)
    valid = slot >= 0
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
def _write_kv(
    k,
    v,
    d,
    in_dim,
    slot,
    h,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
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
    """One token's K and V of KV head ``h`` (fp32 tiles of ``_head_tile``) into ``slot``
    (< 0: skipped)."""
    slot = slot.to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_row = block * stride_cb + offset * stride_co + h * stride_ch
    if QUANT == 0:
        mask = in_dim & (d * 0 + slot >= 0)  # see _store_quantized
        dtype = k_cache.dtype.element_ty
        tl.store(k_cache + cache_row + d, round_to(k, dtype), mask=mask)
        tl.store(v_cache + cache_row + d, round_to(v, dtype), mask=mask)
    else:
        qmax: tl.constexpr = _QMAX_INT8 if QUANT == 1 else _QMAX_INT4
        pack: tl.constexpr = 1 if QUANT == 1 else 2
        param = block * stride_pb + offset * stride_po + h * stride_ph
        _store_quantized(
            k, in_dim, k_cache + cache_row, k_scale + param, k_zero + param, slot,
            HEAD_DIM, qmax, pack, BLOCK_P,
        )  # fmt: skip
        _store_quantized(
            v, in_dim, v_cache + cache_row, v_scale + param, v_zero + param, slot,
            HEAD_DIM, qmax, pack, BLOCK_P,
        )  # fmt: skip


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
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d, in_dim = _head_tile(HEAD_DIM, 2 if QUANT == 2 else 1, BLOCK_P)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=in_dim, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=in_dim, other=0.0)
    _write_kv(
        k.to(tl.float32), v.to(tl.float32), d, in_dim, tl.load(slot_ptr + t), h,
        k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
        stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
        BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_P,
    )  # fmt: skip


@triton.jit
def _rotated(row, cos_row, sin_row, d, in_dim, HALF: tl.constexpr):
    """A head vector (``row`` points at element 0) rotated, rotate-half convention, as fp32
    values of its dtype: ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin``, each product and
    the sum rounded to the dtype as ``apply_rotary``'s torch ops round them."""
    dtype = row.dtype.element_ty
    first = d < HALF
    i = tl.where(first, d, d - HALF)  # the cos/sin element of d
    x = tl.load(row + d, mask=in_dim, other=0.0).to(tl.float32)
    y = tl.load(row + tl.where(first, d + HALF, i), mask=in_dim, other=0.0).to(tl.float32)
    c = tl.load(cos_row + i, mask=in_dim, other=0.0).to(tl.float32)
    s = tl.load(sin_row + i, mask=in_dim, other=0.0).to(tl.float32)
    a = round_to(x * c, dtype).to(tl.float32)
    b = round_to(y * s, dtype).to(tl.float32)
    return round_to(tl.where(first, a - b, a + b), dtype).to(tl.float32)


@triton.jit
def _rotary_kv_write_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out,
    slot_ptr,
    k_cache,
    v_cache,
    k_scale,
    k_zero,
    v_scale,
    v_zero,
    heads,
    stride_qkt,
    stride_qkh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_ot,
    stride_oh,
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
    PDL: tl.constexpr,
):
    """Program (t, h): query head h of token t (h < heads), else KV head h - heads."""
    wait_for_producers(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d, in_dim = _head_tile(HEAD_DIM, 2 if QUANT == 2 else 1, BLOCK_P)
    x = _rotated(
        qk_ptr + t * stride_qkt + h * stride_qkh,
        cos_ptr + t * stride_cos,
        sin_ptr + t * stride_sin,
        d,
        in_dim,
        HEAD_DIM // 2,
    )
    if h < heads:
        out_row = q_out + t * stride_ot + h * stride_oh
        tl.store(out_row + d, round_to(x, q_out.dtype.element_ty), mask=in_dim)
    else:
        kv_head = h - heads
        v = tl.load(v_ptr + t * stride_vt + kv_head * stride_vh + d, mask=in_dim, other=0.0)
        _write_kv(
            x, v.to(tl.float32), d, in_dim, tl.load(slot_ptr + t), kv_head,
            k_cache, v_cache, k_scale, k_zero, v_scale, v_zero,
            stride_cb, stride_co, stride_ch, stride_pb, stride_po, stride_ph,
            BLOCK_SIZE, HEAD_DIM, QUANT, BLOCK_P,
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself if its last dimension is contiguous (the kernels index elements from there)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _pool(kv: LayerKV) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """The pool's six tensors, and the block, offset and head strides of its codes and then of
    its parameters."""
    tensors = kv.tensors()
    return tensors, (*tensors[0].stride()[:3], *tensors[2].stride()[:3])


def _launch_options(kv: LayerKV) -> dict[str, int | bool]:
    s = kv.spec
    pack = 2 if s.kv_quant == "int4" else 1
    return {
        "BLOCK_SIZE": s.block_size,
        "HEAD_DIM": s.head_dim,
        "QUANT": s.quant_id,
        "BLOCK_P": triton.next_power_of_2(s.head_dim) // pack,
        "num_warps": 1,  # one head vector per program: a warp covers it, reductions in-warp
        **pdl_launch(kv.device),
    }


def kv_write(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[T, Hkv, D]`` at ``slot_mapping [T]`` (int32 or int64; slots < 0
    are padding and skipped), quantized like :meth:`LayerKV.write`, bit for bit. Slots past
    the pool are rejected when ``slot_mapping`` is on the CPU (on a GPU the check would sync
    every layer; the engine's block manager only hands out valid slots)."""
    _check(kv, k, v, slot_mapping)
    if slot_mapping.shape[0] == 0:
        return
    k, v = _rows(k), _rows(v)
    pool, strides = _pool(kv)
    _kv_write_kernel[(slot_mapping.shape[0], kv.spec.num_kv_heads)](
        k, v, slot_mapping, *pool,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides,
        **_launch_options(kv),
    )  # fmt: skip


def _check_rotary(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The query heads in ``qk``, after the checks the write itself does not make."""
    t, d = v.shape[0], v.shape[-1]
    heads = qk.shape[1] - v.shape[1] if qk.dim() == 3 else 0
    if qk.dim() != 3 or qk.shape[0] != t or qk.shape[2] != d or heads < 1:
        raise ValueError(
            f"rotary_kv_write expects qk [T, H + Hkv, D] with H >= 1 beside v {list(v.shape)}; "
            f"got qk {list(qk.shape)}"
        )
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != (t, 1, d // 2):
            raise ValueError(
                f"rotary_kv_write expects {name} [{t}, 1, {d // 2}], got {list(c.shape)}"
            )
    dtypes = {name: x.dtype for name, x in (("qk", qk), ("v", v), ("cos", cos), ("sin", sin))}
    if len(set(dtypes.values())) != 1 or qk.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"rotary_kv_write expects one dtype, float16 or bfloat16; got {dtypes}")
    return heads


def rotary_kv_write(
    kv: LayerKV,
    qk: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The queries of ``qk [T, H + Hkv, D]`` (query heads, then K's) rotated, ``[T, H, D]``,
    after K rotated and ``v [T, Hkv, D]`` were written as :func:`kv_write` writes them. rope:
    cos and sin ``[T, 1, D/2]`` of the tokens' positions. All in one activation dtype; bit for
    bit ``apply_rotary`` followed by :func:`kv_write` (module docstring)."""
    cos, sin = rope
    heads = _check_rotary(qk, v, cos, sin)
    _check(kv, qk[:, heads:], v, slot_mapping)
    check_devices(kv.device, cos=cos, sin=sin)
    t = slot_mapping.shape[0]
    q = torch.empty(t, heads, qk.shape[2], dtype=qk.dtype, device=qk.device)
    if t == 0:
        return q
    qk, v, cos, sin = (_rows(x) for x in (qk, v, cos, sin))
    pool, strides = _pool(kv)
    _rotary_kv_write_kernel[(t, heads + kv.spec.num_kv_heads)](
        qk, v, cos, sin, q, slot_mapping, *pool,
        heads,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), *strides,
        **_launch_options(kv),
    )  # fmt: skip
    return q
