"""The CPU backend's ops. Int4 linear: torch's int4 weight-only matmul for small batches,
dequantize + dense matmul for large ones. Decode attention and the quantized KV write: the C
kernels of cpu_decode.c when native.py could build them, else the torch formulation below.

The artifact's layout is for the GPU; on the CPU the weights are repacked once at load into
torch's `_weight_int4pack_mm_for_cpu` format. Measured on the 2-core AVX-512 (bf16-capable)
development machine with SmolLM2's shapes (evals/bench/RESULTS.md):
- with bf16 activations that kernel wins up to about 48 rows (3072x576 at one row: 0.05 ms,
  against 0.67 ms to dequantize and multiply densely) and loses beyond (512 rows: 10.8 ms
  against 5.3 ms), so the row count picks the path;
- with fp32 activations it has no fast path (1.6 ms at one row, 30x its bf16 time), so fp32
  always dequantizes and uses the dense GEMM.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from runtime.artifact.layout import unpack_qparams, unpack_qweight
from runtime.kernels import native, reference
from runtime.kernels.ops import Backend, StepInputs, StepTensors
from runtime.kv.format import QMAX
from runtime.kv.layer import LayerKV

log = logging.getLogger(__name__)

INT4_KERNEL_MAX_ROWS = {torch.bfloat16: 47}  # above this, dequantize + dense GEMM wins
# SmolLM2's lm_head (49152 x 576), C GEMV against torch's matmul, ms: bf16 1 row 1.6 / 4.3,
# 4 rows 2.9 / 4.7, 6 rows 3.7 / 4.5, 8 rows 6.1 / 4.9; fp32 1 row 3.6 / 11.2, 8 rows 6.9 / 19.8
LOGITS_C_MAX_ROWS = {torch.bfloat16: 6, torch.float32: 8}
# The C int4 GEMV, for activations torch's int4 kernel has no fast path for. 3072x576, C
# against dequantize + dense GEMM, ms: fp32 4 rows 0.26 / 8.2, 32 rows 2.4 / 8.6, 128 rows
# 6.7 / 9.1; fp16 4 rows 0.18 / 1.2, 128 rows 8.7 / 17.9. In bf16 torch's int4 kernel is 2-4x
# faster than it at every row count (1 row 0.06 / 0.19, 32 rows 0.76 / 2.0), so bf16 keeps it.
INT4_C_MAX_ROWS = {torch.float32: 128, torch.float16: 128}
_TORCH_ZERO_OFFSET = 8  # torch's int4 kernels compute (q - 8) * scale + zero


@dataclass
class CpuInt4Weight:
    packed: torch.Tensor  # torch's CPU int4 pack of q [N, Kp]
    scales_zeros: torch.Tensor  # [Kp / gs, N, 2] in torch's (scale, zero) convention
    codes: torch.Tensor  # uint8 [N padded to 16, Kp], for the dense path
    nibbles: torch.Tensor | None  # uint8 [N padded, Kp / 2] in the C GEMV's chunk layout
    scale: torch.Tensor  # [N padded to 16, Kp / gs]
    offset: torch.Tensor  # [N padded to 16, Kp / gs], the artifact's -z*s
    n: int
    k: int
    group_size: int

    @property
    def kp(self) -> int:
        return self.codes.shape[1]


def prepare_int4(
    parts: list[tuple[torch.Tensor, torch.Tensor, int]],
    k: int,
    group_size: int,
    dtype: torch.dtype,
    lib: ctypes.CDLL | None = None,
) -> CpuInt4Weight:
    """Repack once at load: the artifact stays untouched, the CPU gets its own format.

    `parts` are (qweight, qparams, n) of linears sharing an input (q/k/v, gate/up): they are
    fused along N into one matmul. N is padded to 16 for torch's kernel; outputs are sliced.
    The C GEMV's copy of the codes is made only where it will run (`lib` loaded and an
    activation dtype it serves): half a byte per weight otherwise wasted.
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
    torch_zero = b + _TORCH_ZERO_OFFSET * s
    scales_zeros = torch.stack([s.T, torch_zero.T], dim=-1).to(dtype).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    nibbles = _nibbles(q, group_size) if lib is not None and dtype in INT4_C_MAX_ROWS else None
    return CpuInt4Weight(
        packed, scales_zeros, q, nibbles, s.to(dtype), b.to(dtype), n, k, group_size
    )


def _nibbles(q: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """Codes [N, Kp] two a byte for the C GEMV: in each chunk of 32, byte i holds element i
    (low nibble) and i + 16 (high), so one load widens into two runs of 16 lanes."""
    if group_size % 32 or q.shape[1] % group_size:
        return None
    chunks = q.view(q.shape[0], -1, 2, 16)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def dequantize_dense(w: CpuInt4Weight) -> torch.Tensor:
    """[N, Kp] in the scales' dtype."""
    q = w.codes[: w.n].view(w.n, -1, w.group_size).to(w.scale.dtype)
    return (q * w.scale[: w.n].unsqueeze(-1) + w.offset[: w.n].unsqueeze(-1)).view(w.n, -1)


def int4_linear(x: torch.Tensor, w: CpuInt4Weight, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N]; K is zero-padded to the packed width (padded codes meet zeros)."""
    if x.shape[-1] != w.kp:
        x = torch.nn.functional.pad(x, (0, w.kp - x.shape[-1]))
    if lib is not None and x.shape[0] <= INT4_C_MAX_ROWS.get(x.dtype, 0) and w.nibbles is not None:
        return _c_int4_linear(lib, x, w)
    m, rows = x.shape[0], bucket_rows(x.shape[0])
    if rows != m:
        x = torch.nn.functional.pad(x, (0, 0, 0, rows - m))
    if m > INT4_KERNEL_MAX_ROWS.get(x.dtype, 0):
        return (x @ dequantize_dense(w).T)[:m]
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


def _c_int4_linear(lib: ctypes.CDLL, x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], w.n, dtype=x.dtype)
    lib.int4_linear(
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
    )
    return out


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
    rows = torch.tensor(num_tokens).cumsum(0)[picked] - 1
    lens = torch.tensor([ctx_lens[i] for i in picked])
    needed = -(-int(lens.max()) // block_size)
    blocks = torch.nn.utils.rnn.pad_sequence([tables[i] for i in picked], batch_first=True)
    pos = torch.arange(needed * block_size)
    valid = pos[None, :] < lens[:, None]
    return DecodeBatch(rows, blocks[:, :needed].contiguous(), valid, lens)


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
    few batched torch ops); prefill chunks through the reference, one sequence at a time (they
    are compute-bound)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    d = attn.decode
    if d is not None and lib is not None:
        _native_decode(lib, q, out, kv, d, scale, sliding_window)
    elif d is not None:
        valid = _window_valid(d, sliding_window)
        out[d.rows] = _batched_decode(q[d.rows], kv, d, valid, scale)
    start = 0
    for table, length, n in zip(attn.block_tables, attn.context_lens, attn.query_lens, strict=True):
        if n != 1:  # every single-token sequence is in the decode batch
            out[start : start + n] = reference.paged_attention(
                q[start : start + n], kv, [table], [length], [n], scale, sliding_window
            )
        start += n
    return out


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
    """Rows of a 2-D x through the C kernel when loaded (bit-identical to torch's fused RMSNorm
    in bf16, within fp32 rounding in fp32, at a quarter of its dispatch cost at decode sizes);
    anything else (q/k norms over heads) through torch's."""
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


def logits(x: torch.Tensor, weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """float32 [M, V] = x @ weight.T. Decode-sized batches through the C GEMV (it streams the
    weight once and keeps fp32 sums, where torch's bf16 matmul rounds the logits to bf16);
    everything else through torch's matmul."""
    rows, k = x.shape
    if (
        lib is None
        or rows > LOGITS_C_MAX_ROWS.get(weight.dtype, 0)
        or x.dtype not in native.DTYPE_CODES
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


class CpuBackend(Backend):
    """torch on the CPU, with the C decode kernels of cpu_decode.c where they could be built."""

    name = "cpu"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.lib, kernels = native.load()
        if self.lib is None:
            log.warning("CPU backend without its C decode kernels: %s", kernels)
        self.detail = (
            f"torch {torch.__version__} on the CPU ({torch.get_num_threads()} threads), {kernels}"
        )

    def prepare_int4(self, parts, k, group_size, dtype) -> CpuInt4Weight:
        return prepare_int4(parts, k, group_size, dtype, lib=self.lib)

    def int4_linear(self, x: torch.Tensor, w: CpuInt4Weight) -> torch.Tensor:
        return int4_linear(x, w, lib=self.lib)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, lib=self.lib)

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return logits(x, weight, lib=self.lib)

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
        )
        return StepTensors(
            input_ids=torch.tensor(step.input_ids, dtype=torch.int64),
            positions=torch.tensor(step.positions, dtype=torch.int64),
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64),
            logits_indices=torch.tensor(step.logits_indices, dtype=torch.int64),
            attn=attn,
        )
