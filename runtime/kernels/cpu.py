"""The CPU backend's ops. Int4 linear: the C int4 x int8 kernel (cpu_qlinear.c), torch's int4
weight-only matmul, or dequantize + dense matmul, whichever this host measured fastest at the
row count (cpu_dispatch.py). Decode attention, RMSNorm, the logits GEMV and the quantized KV
write: the C kernels of cpu_decode.c when native.py could build them, else torch.

The artifact's layout is for the GPU; on the CPU the weights are repacked once at load, into
the forms the host's chosen paths read: the C kernel's nibbles (half a byte a weight), torch's
`_weight_int4pack_mm_for_cpu` pack only where that kernel wins somewhere (on hosts with native
bf16 it is fast in bf16 only: 30x slower in fp32). The dense path dequantizes from the nibbles.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.artifact.layout import pack_qparams, pack_qweight, unpack_qparams, unpack_qweight
from runtime.kernels import cpu_dispatch, cpu_layer, native, omp_threads, reference
from runtime.kernels.cpu_dispatch import Choice
from runtime.kernels.cpu_layer import FusedLayer
from runtime.kernels.ops import Backend, LayerParts, StepInputs, StepTensors
from runtime.kv.format import QMAX
from runtime.kv.layer import LayerKV

log = logging.getLogger(__name__)

INT4_PATHS, LOGITS_PATHS = cpu_dispatch.PATHS["int4"], cpu_dispatch.PATHS["logits"]
# the paths that quantize activations (LITESERVE_CPU_INT8=0 drops them)
INT8_PATHS = {"int8", "int8-unpacked"}
# the shapes the dispatch is measured on: a mid-size linear (n, k, group) and lm_head (n, k)
CALIBRATION_INT4 = (2048, 1024, 64)
CALIBRATION_LOGITS = (16384, 1024)
_TORCH_ZERO_OFFSET = 8  # torch's int4 kernels compute (q - 8) * scale + zero


@dataclass
class CpuInt4Weight:
    nibbles: torch.Tensor | None  # uint8 [N padded to 16, Kp / 2] in the C kernel's tiles
    codes: torch.Tensor | None  # uint8 [N padded, Kp]: only where there are no nibbles
    packed: torch.Tensor | None  # torch's CPU int4 pack, where its kernel is one of the paths
    scales_zeros: torch.Tensor | None  # [Kp / gs, N, 2] in torch's (scale, zero) convention
    scale: torch.Tensor  # fp16 [N padded to 16, Kp / gs], the artifact's values, tile_params'd
    offset: torch.Tensor  # fp16, the artifact's -z*s, laid out as scale
    n: int
    k: int
    group_size: int

    @property
    def kp(self) -> int:
        return self.scale.shape[1] * self.group_size


def prepare_int4(
    parts: list[tuple[torch.Tensor, torch.Tensor, int]],
    k: int,
    group_size: int,
    dtype: torch.dtype,
    lib: ctypes.CDLL | None = None,
    paths: tuple[str, ...] | set[str] = INT4_PATHS,
) -> CpuInt4Weight:
    """Repack once at load: the artifact stays untouched, the CPU gets its own forms, only
    those the `paths` that may run need (each form of the codes costs half a byte a weight).

    `parts` are (qweight, qparams, n) of linears sharing an input (q/k/v, gate/up): they are
    fused along N into one matmul. N is padded to 16 for torch's kernel; outputs are sliced.
    """
    codes, scales, offsets = [], [], []
    for qweight, qparams, n in parts:
        q = torch.zeros(n, qweight.shape[0] * 16, dtype=torch.uint8)
        q[:, :k] = unpack_qweight(qweight, n, k)
        s, b = unpack_qparams(qparams, n)  # fp16 [n, G] each
        codes.append(q)
        scales.append(s.float())
        offsets.append(b.float())
    n = sum(part[2] for part in parts)
    pad = -n % 16
    q = torch.nn.functional.pad(torch.cat(codes), (0, 0, 0, pad))
    s = torch.nn.functional.pad(torch.cat(scales), (0, 0, 0, pad))
    b = torch.nn.functional.pad(torch.cat(offsets), (0, 0, 0, pad))
    nibbles = tile_codes(q, group_size) if lib is not None else None
    packed = scales_zeros = None
    if "torch-int4" in paths:
        torch_zero = b + _TORCH_ZERO_OFFSET * s
        scales_zeros = torch.stack([s.T, torch_zero.T], dim=-1).to(dtype).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return CpuInt4Weight(
        nibbles,
        q if nibbles is None else None,
        packed,
        scales_zeros,
        tile_params(s.half()),  # exact (the artifact stores fp16), half the bytes of fp32
        tile_params(b.half()),
        n,
        k,
        group_size,
    )


TILE = 8  # columns the C kernels' weight tiles interleave (cpu_qlinear.c's header)


def tile_codes(q: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Codes [N, Kp] two a byte in the C kernel's tiles: in each chunk of 32, byte i holds
    element i (low nibble) and i + 16 (high); a tile's 8 columns keep their chunks of the same
    inputs together, in pairs (c, c + 4). N is padded to the tile with zero codes."""
    if group_size % 32 or group_size > 256 or q.shape[1] % group_size:  # int16 sums: <= 8 chunks
        return None
    q = _pad_rows(q, TILE)
    n, c = q.shape[0], q.shape[1] // 32
    chunks = q.view(n, c, 2, 16)
    nib = chunks[:, :, 0] | (chunks[:, :, 1] << 4)  # [N, C, 16]
    tiles = nib.view(n // TILE, 2, TILE // 2, c, 16).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(n, c * 16)


def _untile_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """tile_codes' inverse: uint8 [N padded to the tile, Kp]."""
    n, c = nibbles.shape[0], nibbles.shape[1] // 16
    nib = nibbles.view(n // TILE, c, TILE // 2, 2, 16).permute(0, 3, 2, 1, 4).reshape(n, c, 1, 16)
    return torch.cat((nib & 15, nib >> 4), dim=2).view(n, c * 32)


def tile_params(t: torch.Tensor) -> torch.Tensor:
    """Per-column group values [N, G] as the C kernels read them: [N / 8, G, 8], one vector
    load a group for a tile's 8 columns (N padded to the tile with zeros), viewed as [N, G]."""
    t = _pad_rows(t, TILE)
    n, g = t.shape
    return t.view(n // TILE, TILE, g).transpose(1, 2).contiguous().view(n, g)


def untile_params(t: torch.Tensor) -> torch.Tensor:
    """tile_params' inverse."""
    n, g = t.shape
    return t.view(n // TILE, g, TILE).transpose(1, 2).reshape(n, g)


def tile_head(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 head's codes [V, Kp] and scales [V, Kp / 32] as the C kernel reads them: a tile's
    8 columns' 32-byte chunks of the same inputs together, in column order; scales as
    tile_params. V is padded to the tile."""
    codes = _pad_rows(codes, TILE)
    v, kp = codes.shape
    tiles = codes.view(v // TILE, TILE, kp // 32, 32).transpose(1, 2)
    return tiles.contiguous().view(v, kp), tile_params(scales)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0, 0, -t.shape[0] % multiple))


def _codes(w: CpuInt4Weight) -> torch.Tensor:
    """uint8 [N padded, Kp], from the nibbles when the weight keeps only those."""
    return w.codes if w.codes is not None else _untile_codes(w.nibbles)


def dequantize_dense(w: CpuInt4Weight, dtype: torch.dtype) -> torch.Tensor:
    """[N, Kp] in `dtype`."""
    q = _codes(w)[: w.n].view(w.n, -1, w.group_size).to(dtype)
    scale, offset = (untile_params(t)[: w.n].to(dtype).unsqueeze(-1) for t in (w.scale, w.offset))
    return (q * scale + offset).view(w.n, -1)


def int4_paths(w: CpuInt4Weight) -> tuple[str, ...]:
    """The paths this weight's forms can run."""
    int8 = w.nibbles is not None
    have = {"int8": int8, "int8-unpacked": int8, "torch-int4": w.packed is not None, "dense": True}
    return tuple(p for p in INT4_PATHS if have[p])


def int4_linear(
    x: torch.Tensor, w: CpuInt4Weight, path: str = "dense", lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype through `path` (one of int4_paths(w); int8 needs `lib`);
    K is zero-padded to the packed width (padded codes meet zeros)."""
    if x.shape[-1] != w.kp:
        x = torch.nn.functional.pad(x, (0, w.kp - x.shape[-1]))
    if path in INT8_PATHS:
        return _int8_linear(lib, x, w, unpack=path == "int8-unpacked")
    m, rows = x.shape[0], bucket_rows(x.shape[0])
    if rows != m:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows - m))
    if path == "dense":
        return (x @ dequantize_dense(w, x.dtype).T)[:m]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group_size, w.scales_zeros)
    return y[:m, : w.n]


def bucket_rows(m: int) -> int:
    """The row count torch's GEMMs run at: m up to 8, then rounded up to 4 steps an octave
    (at most 25% padding rows). torch keeps per-shape kernels for every distinct row count it
    has seen, about 2-3 MB each for good (oneDNN primitives and brgemm kernels; measured in
    evals/bench/RESULTS.md, soak), so a server meeting every prompt length grew without bound;
    with buckets it meets at most 4 shapes an octave."""
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - 3)
    return -(-m // step) * step


def _int8_linear(
    lib: ctypes.CDLL, x: torch.Tensor, w: CpuInt4Weight, unpack: bool = False
) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    lib.int4_int8_linear(
        x.data_ptr(),
        x.stride(0),
        native.DTYPE_CODES[x.dtype],
        w.nibbles.data_ptr(),
        w.scale.data_ptr(),
        w.offset.data_ptr(),
        native.DTYPE_CODES[w.scale.dtype],
        out.data_ptr(),
        x.shape[0],
        w.n,
        w.kp,
        w.group_size,
        unpack,
    )
    return out if x.dtype == torch.float32 else out.to(x.dtype)


@dataclass
class DecodeBatch:
    """The step's single-token sequences, laid out for one batched attention per layer."""

    rows: torch.Tensor  # int64 [B]: their rows in the step
    blocks: torch.Tensor  # int64 [B, NB]: block tables, padded with block 0
    valid: torch.Tensor  # bool [B, NB * block_size]: real (and in-window) positions
    lens: torch.Tensor  # int64 [B]: tokens in each sequence's KV after this step


@dataclass
class CpuAttention:
    """The CPU backend's attention metadata: per-sequence tables and lengths for the prefill
    reference, and the decoding sequences batched for one call per layer."""

    block_tables: list[torch.Tensor]  # int64 per sequence
    context_lens: list[int]
    query_lens: list[int]
    decode: DecodeBatch | None
    chunks: torch.Tensor | None = None  # prefill_chunks' table for the fused layer


def prefill_chunks(
    tables: list[torch.Tensor], ctx_lens: list[int], query_lens: list[int]
) -> torch.Tensor | None:
    """int64 [P, 4]: (first row, tokens, context length, block table address) of each prefill
    chunk, as cpu_layer.c reads them; the tables must outlive it (CpuAttention holds them)."""
    rows, start = [], 0
    for table, ctx, n in zip(tables, ctx_lens, query_lens, strict=True):
        if n > 1:
            rows.append((start, n, ctx, table.data_ptr()))
        start += n
    return torch.tensor(rows, dtype=torch.int64) if rows else None


def decode_batch(
    tables: list[torch.Tensor],
    ctx_lens: list[int],
    num_tokens: list[int],
    block_size: int,
) -> DecodeBatch | None:
    """Padded block tables of every decoding sequence, built once per step for all layers:
    attention gathers whole blocks (contiguous runs of block_size tokens), not single slots.
    Sliding windows are masked per layer (``_window_valid``)."""
    picked = [i for i, n in enumerate(num_tokens) if n == 1]
    if not picked:
        return None
    ends = list(itertools.accumulate(num_tokens))
    lens = [ctx_lens[i] for i in picked]
    needed = -(-max(lens) // block_size)
    blocks = torch.zeros(len(picked), needed, dtype=torch.int64)
    for row, i in enumerate(picked):  # every step: fewer torch ops than pad_sequence and cumsum
        n = min(needed, tables[i].shape[0])
        blocks[row, :n] = tables[i][:n]
    lens_t = torch.tensor(lens)
    valid = torch.arange(needed * block_size)[None, :] < lens_t[:, None]
    return DecodeBatch(torch.tensor([ends[i] - 1 for i in picked]), blocks, valid, lens_t)


def _window_valid(d: DecodeBatch, window: int | None) -> torch.Tensor:
    if window is None:
        return d.valid
    pos = torch.arange(d.valid.shape[1])
    return d.valid & (pos[None, :] > (d.lens[:, None] - 1 - window))


def paged_attention(
    q: torch.Tensor,
    kv: LayerKV,
    attn: CpuAttention,
    scale: float,
    sliding_window: int | None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """Decoding sequences in one call per layer (the C kernel when `lib` is loaded, else a
    few batched torch ops); prefill chunks one sequence at a time, through the C kernel's
    blocks of tokens when loaded, else the reference."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = attn.decode
    if d is not None and lib is not None:
        _native_decode(lib, q, out, kv, d, scale, sliding_window)
    elif d is not None:
        valid = _window_valid(d, sliding_window)
        out[d.rows] = _batched_decode(q[d.rows], kv, d, valid, scale)
    start = 0
    for table, length, n in zip(attn.block_tables, attn.context_lens, attn.query_lens, strict=True):
        if n != 1 and lib is not None:  # every single-token sequence is in the decode batch
            _native_prefill(lib, q, out, kv, (table, length, n, start), scale, sliding_window)
        elif n != 1:
            out[start : start + n] = reference.paged_attention(
                q[start : start + n], kv, [table], [length], [n], scale, sliding_window
            )
        start += n
    return out


def _native_prefill(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    out: torch.Tensor,
    kv: LayerKV,
    seq: tuple[torch.Tensor, int, int, int],
    scale: float,
    window: int | None,
) -> None:
    """One sequence's chunk: `seq` is (block table, context length, chunk length, first row)."""
    table, length, n, row0 = seq
    q, table, spec = _heads_contiguous(q), table.contiguous(), kv.spec
    params = (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)
    lib.prefill_attention(
        q.data_ptr(),
        q.stride(0),
        native.DTYPE_CODES[q.dtype],
        out.data_ptr(),
        row0,
        n,
        kv.k.data_ptr(),
        kv.v.data_ptr(),
        *(None if t is None else t.data_ptr() for t in params),
        spec.storage_kind,
        table.data_ptr(),
        length,
        window or 0,
        q.shape[1],
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        scale,
    )


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with heads and dims packed (the token stride may be anything): what the C
    kernels index."""
    d = x.shape[-1]
    return x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous()


def _native_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    out: torch.Tensor,
    kv: LayerKV,
    d: DecodeBatch,
    scale: float,
    window: int | None,
) -> None:
    q = _heads_contiguous(q)
    spec = kv.spec
    params = (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)
    lib.decode_attention(
        q.data_ptr(),
        q.stride(0),
        native.DTYPE_CODES[q.dtype],
        out.data_ptr(),
        d.rows.data_ptr(),
        kv.k.data_ptr(),
        kv.v.data_ptr(),
        *(None if t is None else t.data_ptr() for t in params),
        spec.storage_kind,
        d.blocks.data_ptr(),
        d.blocks.stride(0),
        d.lens.data_ptr(),
        window or 0,
        d.rows.shape[0],
        q.shape[1],
        spec.num_kv_heads,
        spec.head_dim,
        spec.block_size,
        scale,
    )


def kv_write(
    kv: LayerKV,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Quantized pools through the C quantizer (bit-identical to quantize_kv) when loaded;
    everything else through LayerKV.write."""
    spec = kv.spec
    if lib is None or not kv.quantized or k.dtype not in native.DTYPE_CODES:
        kv.write(k, v, slots)
        return
    expected = (slots.shape[0], spec.num_kv_heads, spec.head_dim)
    shapes = (tuple(k.shape), tuple(v.shape))
    if shapes != (expected, expected) or v.dtype != k.dtype or slots.dtype != torch.int64:
        kv.write(k, v, slots)  # its checks name the problem
        return
    k, v, slots = _heads_contiguous(k), _heads_contiguous(v), slots.contiguous()
    lib.kv_write_quantized(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        native.DTYPE_CODES[k.dtype],
        slots.data_ptr(),
        slots.shape[0],
        *(t.data_ptr() for t in (kv.k, kv.k_scale, kv.k_zero, kv.v, kv.v_scale, kv.v_zero)),
        spec.num_kv_heads,
        spec.head_dim,
        QMAX[spec.kv_quant],
    )


def _batched_decode(
    q: torch.Tensor, kv: LayerKV, d: DecodeBatch, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, D] over each sequence's padded context: [B, H, D] in q's dtype.

    Quantized K/V are never dequantized: with x = c * s + z per token and head,
    q . k = s (q . c) + z sum(q), and sum_t p_t v_t = (p s) @ c + sum_t p_t z_t, so the codes
    are only widened to fp32 and the scales and zeros act on the [B, H, L] scores."""
    k, v = kv.read_blocks(d.blocks)  # [B, L, Hkv, D] (+ [B, L, Hkv] scale, zero)
    b, h, dim = q.shape
    hkv = k[0].shape[2]
    qg = q.float().view(b, hkv, h // hkv, dim)
    scores = qg @ _widen(k[0].permute(0, 2, 3, 1))  # [B, Hkv, group, L]
    if kv.quantized:
        ks, kz = (t.float().transpose(1, 2)[:, :, None, :] for t in k[1:])  # [B, Hkv, 1, L]
        scores = scores * ks + qg.sum(-1, keepdim=True) * kz
    scores = (scores * scale).masked_fill_(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if not kv.quantized:
        o = p @ _widen(v[0].transpose(1, 2))  # [B, Hkv, group, D]
    else:
        vs, vz = (t.float().transpose(1, 2)[:, :, None, :] for t in v[1:])
        o = (p * vs) @ _widen(v[0].transpose(1, 2)) + (p * vz).sum(-1, keepdim=True)
    return o.reshape(b, h, dim).to(q.dtype)


def _widen(x: torch.Tensor) -> torch.Tensor:
    """fp32 and contiguous in x's (permuted) order, in the one copy the widening makes anyway:
    bmm on strided operands copies them again, slowly."""
    return x.to(torch.float32, memory_format=torch.contiguous_format)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """Rows of a 2-D x through the C kernel when loaded (torch's fused RMSNorm's single rounding
    in bf16/fp16, so equal but where summation order moves a rare element by one step; within
    fp32 rounding in fp32; at a quarter of its dispatch cost at decode sizes); anything else
    (q/k norms over heads) through torch's."""
    if (
        lib is None
        or x.dim() != 2
        or x.stride(1) != 1
        or weight.dtype != x.dtype
        or x.dtype not in native.DTYPE_CODES
    ):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=x.dtype)
    weight = weight.contiguous()
    lib.rms_norm(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        native.DTYPE_CODES[x.dtype],
        rows,
        dim,
        eps,
    )
    return out


@dataclass
class CpuHead:
    """The lm_head: the dense weight, and its int8 form where the int8 path may run."""

    weight: torch.Tensor  # [V, K] in the activations' dtype
    codes: torch.Tensor | None = None  # int8 [V padded to 8, K padded to 32], tile_head's
    scales: torch.Tensor | None = None  # fp32 [V padded to 8, K padded / 32], tile_head's


HEAD_CHUNK_ROWS = 8192  # rows quantized at a time: bounds the fp32 copy a large vocabulary needs


def prepare_head(weight: torch.Tensor, paths: tuple[str, ...] | set[str] = LOGITS_PATHS) -> CpuHead:
    """The int8 form, if `paths` has it: per 32 inputs, scale = max|w| / 127, codes =
    round(w / scale) (llama.cpp's Q8_0), zero-padded to a multiple of 32 inputs."""
    if "int8" not in paths:
        return CpuHead(weight)
    v, k = weight.shape
    kp = -(-k // 32) * 32
    codes = torch.empty(v, kp, dtype=torch.int8)
    scales = torch.empty(v, kp // 32, dtype=torch.float32)
    for start in range(0, v, HEAD_CHUNK_ROWS):
        rows = weight[start : start + HEAD_CHUNK_ROWS].float()
        blocks = torch.nn.functional.pad(rows, (0, kp - k)).view(rows.shape[0], -1, 32)
        step = blocks.abs().amax(-1) / 127
        inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
        codes[start : start + rows.shape[0]] = (
            torch.round(blocks * inv[..., None]).view(rows.shape[0], kp).to(torch.int8)
        )
        scales[start : start + rows.shape[0]] = step
    return CpuHead(weight, *tile_head(codes, scales))


def logits_paths(head: CpuHead, lib: ctypes.CDLL | None) -> tuple[str, ...]:
    """The paths this head's forms can run (the C ones need the library)."""
    have = {"int8": lib is not None and head.codes is not None, "c": lib is not None}
    return tuple(p for p in LOGITS_PATHS if have.get(p, True))


def logits(
    x: torch.Tensor, head: CpuHead, path: str = "torch", lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """float32 [M, V] = x @ weight.T. "int8": the C int8 x int8 kernel on the Q8_0 form; "c":
    the C GEMV (it streams the weight once and keeps fp32 sums, where torch's bf16 matmul
    rounds the logits to bf16), taken where the operands are ones it reads; anything else goes
    through torch's matmul."""
    weight = head.weight
    rows, k = x.shape
    if path == "int8":
        return _int8_logits(lib, x, head)
    if (
        path != "c"
        or lib is None
        or x.dtype not in native.DTYPE_CODES
        or weight.dtype not in native.DTYPE_CODES
        or x.stride(1) != 1
        or not weight.is_contiguous()
    ):
        return (x @ weight.T).float()
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    lib.dense_linear(
        x.data_ptr(),
        x.stride(0),
        native.DTYPE_CODES[x.dtype],
        weight.data_ptr(),
        native.DTYPE_CODES[weight.dtype],
        out.data_ptr(),
        rows,
        weight.shape[0],
        k,
    )
    return out


def _int8_logits(lib: ctypes.CDLL, x: torch.Tensor, head: CpuHead) -> torch.Tensor:
    kp = head.codes.shape[1]
    if x.shape[1] != kp or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, kp - x.shape[1])).contiguous()
    vocab = head.weight.shape[0]
    out = torch.empty(x.shape[0], vocab, dtype=torch.float32)
    lib.int8_int8_linear(
        x.data_ptr(),
        x.stride(0),
        native.DTYPE_CODES[x.dtype],
        head.codes.data_ptr(),
        head.scales.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        vocab,
        kp,
    )
    return out


def _int4_candidates(lib: ctypes.CDLL | None, dtype: torch.dtype) -> cpu_dispatch.Candidates:
    """Each int4 path on a random weight of the calibration shape."""
    n, k, gs = CALIBRATION_INT4
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // gs, generator=g) / 64 + 1e-3
    zero = torch.randint(0, 16, (n, k // gs), generator=g)
    part = (pack_qweight(q, gs), pack_qparams(scale, zero, gs, k), n)
    w = prepare_int4([part], k, gs, dtype, lib=lib)

    def make(path: str) -> Callable[[int], Callable[[], object]]:
        def at(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, k, generator=g).to(dtype)
            return lambda: int4_linear(x, w, path, lib)

        return at

    return {path: make(path) for path in int4_paths(w)}


def _logits_candidates(lib: ctypes.CDLL | None, dtype: torch.dtype) -> cpu_dispatch.Candidates:
    n, k = CALIBRATION_LOGITS
    g = torch.Generator().manual_seed(1)
    head = prepare_head((torch.randn(n, k, generator=g) / 32).to(dtype))

    def make(path: str) -> Callable[[int], Callable[[], object]]:
        def at(rows: int) -> Callable[[], object]:
            x = torch.randn(rows, k, generator=g).to(dtype)
            return lambda: logits(x, head, path, lib)

        return at

    return {path: make(path) for path in logits_paths(head, lib)}


def measure_dispatch(
    lib: ctypes.CDLL | None, dtype: torch.dtype, int8: bool = True
) -> dict[str, Choice]:
    """This host's fastest paths per row count for int4 linears and for the logits.

    An op's table never mixes int8-activation and float paths: their results differ by more
    than rounding, so a switch at some row count would make a sequence's tokens depend on the
    batch it shares. The side that is faster at one row (decode) takes the op; the fastest of
    its paths runs at each row count (`int8` is off altogether when `int8` is False)."""
    ops = {
        "int4": (_int4_candidates(lib, dtype), cpu_dispatch.ROW_POINTS),
        "logits": (_logits_candidates(lib, dtype), cpu_dispatch.ROW_POINTS[:6]),
    }
    table = {}
    for op, (candidates, points) in ops.items():
        if not int8:
            candidates = {p: c for p, c in candidates.items() if p not in INT8_PATHS}
        one_row = cpu_dispatch.measure(candidates, points[:1])[points[0]]
        quantized = min(one_row, key=one_row.get) in INT8_PATHS
        side = {p: c for p, c in candidates.items() if (p in INT8_PATHS) == quantized}
        table[op] = cpu_dispatch.choose(cpu_dispatch.measure(side, points))
    return table


class CpuBackend(Backend):
    """torch on the CPU, with the C kernels of cpu_decode.c and cpu_qlinear.c where they could
    be built, each op on the path this host measured fastest (cpu_dispatch.py)."""

    name = "cpu"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # a step's activations past the caches cost more than its extra rows save: on SmolLM2
    # (2-core Xeon with AMX) 32 prompts of 128 tokens prefilled at 2421 tok/s in steps of 512
    # against 1516 in one of 4096, one 2048-token prompt at 1198 against 697
    step_tokens = 512

    def __init__(self, int8_activations: bool = True) -> None:
        self.device = torch.device("cpu")
        self.lib, kernels = native.load()
        if self.lib is None:
            log.warning("CPU backend without its C kernels: %s", kernels)
        # int8 activations (llama.cpp's Q8 scheme) where measured faster; else float math only
        by_env = os.environ.get("LITESERVE_CPU_INT8", "1") == "0"
        self.int8 = int8_activations and not by_env
        self.threads = omp_threads.engine_threads()  # the steps', also when loading with one
        self.detail = f"torch {torch.__version__} on the CPU ({self.threads} threads), {kernels}"
        if not self.int8:
            why = "LITESERVE_CPU_INT8=0" if by_env else "int8_activations=False"
            self.detail += f", float activations only ({why})"
        self._dispatch: dict[torch.dtype, dict[str, Choice]] = {}

    @property
    def fuses_layers(self) -> bool:
        """Whether fp32 steps run a whole decoder layer per C call (cpu_layer.py)."""
        return self.lib is not None and self.int8 and cpu_layer.enabled()

    def default_dtype(self) -> torch.dtype:
        """fp32 where the C kernels run the int8 linear path (its fused layer, cpu_layer.py,
        decodes faster than bf16 even where bf16 is native: 97-104 against 81 tok/s on SmolLM2
        at batch 1 on AVX-512 with bf16, evals/bench/RESULTS.md); else bf16 where it is native
        (torch's int4 kernel is fast only in bf16), fp32 elsewhere."""
        if self.fuses_layers:
            return torch.float32
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32

    def dispatch(self, dtype: torch.dtype) -> dict[str, Choice]:
        """The measured table for activations of `dtype` (from the cache after the first run
        on this host), logged once per process."""
        if dtype not in self._dispatch:
            lib = "torch-only" if self.lib is None else Path(self.lib._name).stem
            key = f"{lib}-torch{torch.__version__}-{str(dtype).removeprefix('torch.')}"
            key += f"-{self.threads}t" + ("" if self.int8 else "-float")
            measure = functools.partial(measure_dispatch, self.lib, dtype, self.int8)
            measure = functools.partial(omp_threads.with_threads, self.threads, measure)
            table = cpu_dispatch.cached_choices(key, measure, self.threads)
            self._dispatch[dtype] = table
            log.info(
                "CPU dispatch for %s activations (measured on this host): int4 linears %s; "
                "logits %s",
                str(dtype).removeprefix("torch."),
                table["int4"].describe(),
                table["logits"].describe(),
            )
        return self._dispatch[dtype]

    def prepare_int4(self, parts, k, group_size, dtype) -> CpuInt4Weight:
        paths = self.dispatch(dtype)["int4"].paths()
        return prepare_int4(parts, k, group_size, dtype, lib=self.lib, paths=paths)

    def int4_linear(self, x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
        path = self.dispatch(x.dtype)["int4"].pick(x.shape[0])
        if path not in int4_paths(w):  # e.g. a group size the C kernel does not take
            path = "dense"
        return int4_linear(x, w, path, lib=self.lib)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, lib=self.lib)

    def prepare_logits(self, weight: torch.Tensor) -> CpuHead:
        return prepare_head(weight, self.dispatch(weight.dtype)["logits"].paths())

    def logits(self, x: torch.Tensor, head: CpuHead) -> torch.Tensor:
        path = self.dispatch(x.dtype)["logits"].pick(x.shape[0])
        if path not in logits_paths(head, self.lib):
            path = "torch"
        return logits(x, head, path, lib=self.lib)

    def prepare_layer(self, parts: LayerParts) -> FusedLayer | None:
        return cpu_layer.prepare_layer(parts, self.lib)

    def _fused_unpack(self, x: torch.Tensor) -> bool | None:
        """Whether the fused layers' linears unpack their tiles for this step's rows (the
        dispatch's "int8-unpacked" path); None where the linears are not on an int8 path."""
        path = self.dispatch(x.dtype)["int4"].pick(x.shape[0])
        return None if path not in INT8_PATHS else path == "int8-unpacked"

    def decoder_layer(self, x, layer: FusedLayer, rope, kv: LayerKV, step: StepTensors):
        unpack = self._fused_unpack(x)
        if unpack is None:
            return None
        return cpu_layer.decoder_layer(self.lib, x, layer, rope, kv, step, unpack)

    def decoder_layers(self, x, layers: list[FusedLayer], rope, cache, step: StepTensors):
        unpack = self._fused_unpack(x)
        if unpack is None:
            return None
        return cpu_layer.decoder_layers(self.lib, x, layers, rope, cache, step, unpack)

    def kv_write(self, kv: LayerKV, k, v, slot_mapping) -> None:
        kv_write(kv, k, v, slot_mapping, lib=self.lib)

    def attention(self, q, kv: LayerKV, attn: CpuAttention, scale, sliding_window):
        return paged_attention(q, kv, attn, scale, sliding_window, lib=self.lib)

    def prepare_step(self, step: StepInputs) -> StepTensors:
        """Host tensors (no copy to make); the decoding rows batched once for every layer."""
        tables = [torch.tensor(t, dtype=torch.int64) for t in step.block_tables]
        attn = CpuAttention(
            tables,
            step.context_lens,
            step.query_lens,
            decode_batch(tables, step.context_lens, step.query_lens, step.block_size),
            prefill_chunks(tables, step.context_lens, step.query_lens),
        )
        return StepTensors(
            input_ids=torch.tensor(step.input_ids, dtype=torch.int64),
            positions=torch.tensor(step.positions, dtype=torch.int64),
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64),
            logits_indices=torch.tensor(step.logits_indices, dtype=torch.int64),
            attn=attn,
        )
