"""W4A16 GEMM in Triton, reading the artifact's packed int4 layout (``lsq4-mma16x16-v1``) as is.

``y[M, N] = x[M, K] @ W_hat^T`` with ``W_hat[n, k] = q[n, k] * s + b`` taken straight from the
artifact's ``qweight`` / ``qparams`` (docs/artifact-layout.md); nothing is repacked at load.

Each program owns a ``BLOCK_M x BLOCK_N`` tile of y and one slice of K. Per ``BLOCK_K`` step it
loads the packed words of the weight tile (each word once), expands them to int4 codes in
registers, dequantizes every code with one fp32 FMA ``q * s + b`` (the group's fp16 ``(s, b)``
widened), rounds the weight once to x's dtype and accumulates ``tl.dot`` with the x tile in fp32.

Unpacking, and why this way. A word holds 8 codes of one 16 x 16 tile that differ only in the
local bits k3, k0 and n3 (docs section 4); the other bits (kt, k2, k1) and (nt, n2, n1, n0) pick
the word. So the words form a plain 2-D ``[BLOCK_K / 4, BLOCK_N / 2]`` grid, and broadcasting each
word over 4 rows (k3 k0) and 2 column halves (n3: the tile's first half of columns holds the
n3 = 0 codes of every word column, the second half the n3 = 1 codes) then shifting by
``4 * (4 k0 + 2 n3 + k3)`` yields a ``[BLOCK_K, BLOCK_N]`` code tile whose rows are k permuted
within each 16 and whose columns are n in runs of 8 adjacent outputs. A dot product is
indifferent to the order of k as long as x is loaded in the same order, and the permuted columns
only change where the qparams are read and the outputs stored (16 bytes at a time; with n and
n + 8 side by side, the dequantized weights went out as 2-byte stores), so the layout is consumed
with index arithmetic and one broadcast-reshape. Word loads stay contiguous in runs of 4
(16-byte vectors) and x in k0 pairs (4 bytes). The alternatives cost more: gathering every
element's word issues 8 loads per word, and restoring natural order means the rank-10
reshape/permute of the reference unpacker, a large layout shuffle in the kernel.

Config rules (:class:`GemmConfig`):

* ``block_m``, ``block_n``, ``block_k`` are powers of two >= 16 (``tl.dot``'s minimum and the
  16 x 16 tile), at most 256, 256 and 128;
* ``group_size % block_k == 0``: a k-step never straddles a quantization group, so the
  ``(s, b)`` of a step is one ``[BLOCK_N]`` vector per column instead of a full tile;
* ``split_k`` (1..64) cuts the k-steps into that many contiguous slices, one program each
  (fewer when there are fewer k-steps: no slice is left empty).
  Partial sums go to an fp32 buffer ``[split_k, M, N]``, and the last slice of a tile to
  finish (counted per tile, ``_write_sums``) adds them in split order in the same launch: the
  bits are reproducible, unlike ``tl.atomic_add`` on y, whose order of arrival varies, and the
  extra traffic is negligible at the decode-sized M where split-K pays;
* ``num_warps`` in {1, 2, 4, 8, 16}, ``num_stages`` 1..8 (software pipelining depth).

:func:`config_space` lists, per M bucket, the configs worth autotuning for a weight shape;
:func:`heuristic_config` picks one of them when the manifest pins none. One row runs
:func:`w4a16_gemv` instead (:class:`GemvConfig`, :func:`gemv_config`, :func:`gemv_space`): a
16-row dot tile would be 15 rows of padding there.

Under ``TRITON_INTERPRET=1`` (triton 3.6) ``tl.dot`` multiplies bf16 operands as their raw
uint16 storage, so there bf16 tiles are widened to fp32 for the dot: exact, since a product of
two bf16 values is exact in fp32. Compiled kernels always take the native bf16 dot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from itertools import product

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from runtime.artifact.layout import GROUP_SIZES, N_ALIGN, TILE, padded_shape
from runtime.device import same_device
from runtime.kernels.counters import arrival_counters
from runtime.kernels.triton.launch import pdl_launch, prefetch_l2, wait_for_producers
from runtime.kernels.triton.rounding import round_to

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # 512 means 512+
# Row counts that compile every GEMM kernel a step can launch. Triton compiles the row count
# argument once as a multiple of 16 and once not (and 1 as a constant), so a bucket of 16+
# rows is warmed at its size and one row below it. Left specialized, not `do_not_specialize`:
# that would cost the M = 1 and multiple-of-16 kernels 8-40 registers a thread at sm_90.
WARMUP_ROWS = tuple(sorted({*M_BUCKETS, *(b - 1 for b in M_BUCKETS if b >= 16)}))
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)

_GROUP_M = 8  # programs sharing a weight column block run back to back (L2 reuse)
_TARGET_PROGRAMS = 128  # about one wave on an H100/H200; split-K fills the GPU up to this
_MAX_BLOCK = {"block_m": 256, "block_n": 256, "block_k": 128}
_MAX_SPLIT_K = 64
# Accumulator plus expanded code tile, in elements per thread, that ptxas holds without spilling
# at sm_90 (found by compiling every config offline; 128x128x64 on 4 warps, 192, spills).
_MAX_LIVE_PER_THREAD = 160
_NUM_WARPS = (1, 2, 4, 8, 16)
_MAX_STAGES = 8


def _is_pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of :func:`w4a16_gemm`; the rules are in the module docstring."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{f.name} must be an int, got {v!r}")
        for name, hi in _MAX_BLOCK.items():
            v = getattr(self, name)
            if not (_is_pow2(v) and TILE <= v <= hi):
                raise ValueError(f"{name} must be a power of two in {TILE}..{hi}, got {v}")
        if not 1 <= self.split_k <= _MAX_SPLIT_K:
            raise ValueError(f"split_k must be in 1..{_MAX_SPLIT_K}, got {self.split_k}")
        if self.num_warps not in _NUM_WARPS:
            raise ValueError(f"num_warps must be one of {_NUM_WARPS}, got {self.num_warps}")
        if not 1 <= self.num_stages <= _MAX_STAGES:
            raise ValueError(f"num_stages must be in 1..{_MAX_STAGES}, got {self.num_stages}")

    def to_dict(self) -> dict[str, int]:
        """The manifest's pinned launch config form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> GemmConfig:
        """Inverse of :meth:`to_dict`; a ValueError names any missing, unknown or bad key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"GemmConfig needs a mapping, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in d]
        unknown = sorted(str(key) for key in d if key not in names)
        if missing:
            raise ValueError(f"GemmConfig is missing key(s) {missing}")
        if unknown:
            raise ValueError(f"GemmConfig got unknown key(s) {unknown}")
        return cls(**{name: d[name] for name in names})

    def check_group_size(self, group_size: int) -> None:
        """Raise ValueError unless every k-step lies inside one quantization group."""
        if group_size % self.block_k != 0:
            raise ValueError(
                f"block_k={self.block_k} does not divide group_size={group_size}: "
                "a k-step must lie inside one quantization group"
            )


@dataclass(frozen=True)
class DequantConfig:
    """Not a tile config: the weights dequantized by :func:`w4a16_dequantize` and torch's dense
    GEMM (cuBLAS) on them. This kernel's ``tl.dot`` runs 0.2-0.27x torch's bf16 matmul at 256+
    rows on an H200 (measured), while the dequantization costs one write and read of the
    weights, so prefill-sized M takes this path (vLLM's AWQ linear switches at 256 rows too)."""

    def to_dict(self) -> dict[str, int]:
        return {"dequant": 1}


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of :func:`w4a16_gemv`, the one-row kernel: each program owns
    ``block_n`` outputs of one row and a slice of K (``split_k`` slices of whole groups),
    unpacks each weight word once and multiplies its 8 codes by the activations on the CUDA
    cores, with no tensor core. At M = 1 :func:`w4a16_gemm` pads the row to a 16-row
    ``tl.dot`` tile and converts the dequantized tile into the dot's operand layout; on an
    H200 it ran 0.2-0.6x torch's dense matmul at M = 1 (2026-12-04), where the weights' bytes
    alone allow about 3.5x."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{f.name} must be an int, got {v!r}")
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if not (_is_pow2(v) and TILE <= v <= _MAX_BLOCK[name]):
                raise ValueError(f"{name} must be a power of two in {TILE}..{_MAX_BLOCK[name]}")
        if not 1 <= self.split_k <= _MAX_SPLIT_K:
            raise ValueError(f"split_k must be in 1..{_MAX_SPLIT_K}, got {self.split_k}")
        if self.num_warps not in _NUM_WARPS:
            raise ValueError(f"num_warps must be one of {_NUM_WARPS}, got {self.num_warps}")

    def to_dict(self) -> dict[str, int]:
        return {"gemv": 1, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> GemvConfig:
        names = {f.name for f in fields(cls)}
        if set(d) != names | {"gemv"} or d["gemv"] != 1:
            raise ValueError(f"GemvConfig takes gemv: 1 and {sorted(names)}, got {sorted(d)}")
        return cls(**{name: d[name] for name in names})

    check_group_size = GemmConfig.check_group_size


LinearConfig = GemmConfig | DequantConfig | GemvConfig
DEQUANT_FROM_BUCKET = 256  # row buckets from this one dequantize unless a pin says otherwise


def config_from_dict(d: Mapping[str, object]) -> LinearConfig:
    """A pinned entry: ``{"dequant": 1}``, a :class:`GemvConfig`'s dict (``gemv: 1``) or a
    :class:`GemmConfig`'s."""
    if isinstance(d, Mapping) and dict(d) == DequantConfig().to_dict():
        return DequantConfig()
    if isinstance(d, Mapping) and "gemv" in d:
        return GemvConfig.from_dict(d)
    return GemmConfig.from_dict(d)


def choose_config(m: int, n: int, k: int, group_size: int) -> LinearConfig:
    """Without a pinned entry: one row by :func:`gemv_config`, the dequantized path from
    DEQUANT_FROM_BUCKET rows, else :func:`heuristic_config`."""
    if m_bucket(m) == 1:
        return gemv_config(n, k, group_size)
    if m_bucket(m) >= DEQUANT_FROM_BUCKET:
        return DequantConfig()
    return heuristic_config(m, n, k, group_size)


# Row buckets where `lite tune` times the one-row kernel too, one program per row: the tile
# kernel pads every decode M to 16 rows, so its time hardly grows from 1 row to 4, while each
# row of the one-row kernel unpacks the weights again; which is faster is the GPU's to say.
GEMV_TUNED_BUCKETS = (1, 2, 4)


def tune_space(m: int, n: int, k: int, group_size: int, limit: int | None) -> list[LinearConfig]:
    """What `lite tune` times: the first ``limit`` of :func:`config_space`, in
    GEMV_TUNED_BUCKETS also :func:`gemv_space`, and past the decode rows the dequantized
    path."""
    space: list[LinearConfig] = list(config_space(m, n, k, group_size)[:limit])
    if m_bucket(m) in GEMV_TUNED_BUCKETS:
        space = list(gemv_space(n, k, group_size)[:limit]) + space
    return space + [DequantConfig()] if m_bucket(m) > 16 else space


# One-row programs are light (2-4 warps, few registers): many are resident per SM, which is
# how the kernel keeps enough weight bytes in flight; 8 per SM of an H200 (132 SMs).
_GEMV_TARGET_PROGRAMS = 1024
_GEMV_MAX_LIVE_PER_THREAD = 128  # codes a thread holds a step: <= 161 registers (sm_90, 3.6)


def gemv_config(n: int, k: int, group_size: int) -> GemvConfig:
    """The one-row launch without a pin: 64-output, 64-deep steps (a group of 32: 32) on two
    warps, split-K doubled until about _GEMV_TARGET_PROGRAMS programs while every slice keeps
    a whole group. Compiled for sm_90 without a GPU: 118 registers with triton 3.6 (72 with
    3.9), no spills, no barrier or shared memory in the loop, about 32 instructions a weight
    word; not yet timed on a GPU."""
    block_k = min(group_size, 64)
    blocks = triton.cdiv(n, 64)
    groups = triton.cdiv(k, group_size)
    split = 1
    while split < 16 and blocks * split < _GEMV_TARGET_PROGRAMS and groups >= 2 * split:
        split *= 2
    return GemvConfig(64, block_k, split, 2)


def gemv_space(n: int, k: int, group_size: int) -> list[GemvConfig]:
    """The one-row configs `lite tune` times: the default first, then tiles of 32-128 outputs
    and 32-128 deep (within the group) on 2 or 4 warps, unsplit or split 4 or 16 ways, where a
    thread holds at most _GEMV_MAX_LIVE_PER_THREAD codes and every slice has a group (the
    kernel's unit of K: a group's (s, b) is applied once)."""
    np_, _ = padded_shape(n, k, group_size)
    configs = [gemv_config(n, k, group_size)]
    for block_n, block_k, warps, split in product((32, 64, 128), (32, 64, 128), (2, 4), (1, 4, 16)):
        cfg = GemvConfig(block_n, block_k, split, warps)
        if (
            group_size % block_k == 0
            and block_n <= np_
            and split <= triton.cdiv(k, group_size)
            and block_n * block_k <= _GEMV_MAX_LIVE_PER_THREAD * 32 * warps
            and cfg not in configs
        ):
            configs.append(cfg)
    return configs


def m_bucket(m: int) -> int:
    """The bucket of a row count: the smallest bucket >= m, and 512 for every m > 256."""
    if m < 1:
        raise ValueError(f"row count must be >= 1, got {m}")
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _space_axes(bucket: int) -> dict[str, tuple[int, ...]]:
    """Candidate values per config field for one M bucket, before per-shape pruning."""
    if bucket <= 16:  # decode: one 16-row tile, parallelism and bandwidth come from split-K
        return {
            "block_m": (16,),
            "block_n": (32, 64, 128),
            "block_k": (32, 64, 128),
            "split_k": (1, 2, 4, 8),
            "num_warps": (4,),
            "num_stages": (2, 4),
        }
    if bucket <= 64:
        return {
            "block_m": (32, 64),
            "block_n": (64, 128),
            "block_k": (32, 64),
            "split_k": (1, 2, 4),
            "num_warps": (4,),
            "num_stages": (3, 4),
        }
    return {
        "block_m": (64, 128),
        "block_n": (64, 128),
        "block_k": (32, 64),
        "split_k": (1,),
        "num_warps": (4, 8),
        "num_stages": (3, 4),
    }


def _fits_registers(cfg: GemmConfig) -> bool:
    live = (cfg.block_m + cfg.block_k) * cfg.block_n  # fp32 accumulator + int32 code tile
    return live <= _MAX_LIVE_PER_THREAD * 32 * cfg.num_warps


def config_space(m: int, n: int, k: int, group_size: int) -> list[GemmConfig]:
    """The autotune space for m's bucket and the weight (n, k, group_size).

    Pruned to configs that are valid for group_size and not wasteful for the shape: block_m
    at most the bucket (16 minimum), block_n at most N padded to 64, split_k at most the
    number of k-steps, and no more live tile elements per thread than fit in registers.
    """
    np_, _ = padded_shape(n, k, group_size)
    bucket = m_bucket(m)
    axes = _space_axes(bucket)
    configs = []
    for values in product(*axes.values()):
        cfg = GemmConfig(**dict(zip(axes, values, strict=True)))
        if (
            group_size % cfg.block_k == 0
            and cfg.block_m <= max(TILE, bucket)
            and cfg.block_n <= np_
            and cfg.split_k <= triton.cdiv(k, cfg.block_k)
            and _fits_registers(cfg)
        ):
            configs.append(cfg)
    return configs


def _split_for(tiles: int, k_steps: int, max_split: int) -> int:
    """Double split_k while the grid is under one wave and each slice keeps >= 2 k-steps."""
    split = 1
    while split < max_split and tiles * split < _TARGET_PROGRAMS and k_steps >= 4 * split:
        split *= 2
    return split


def heuristic_config(m: int, n: int, k: int, group_size: int) -> GemmConfig:
    """A reasonable config when no pinned one exists; always a member of config_space."""
    np_, _ = padded_shape(n, k, group_size)
    bucket = m_bucket(m)
    if bucket <= 64:
        block_m = max(TILE, bucket)
        block_k = min(group_size, 128 if bucket <= 16 else 64)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
        split = _split_for(tiles, triton.cdiv(k, block_k), 8 if bucket <= 16 else 4)
        # four stages, but two of 128-deep k-steps: four of those spill 8 bytes a thread at
        # sm_80 (compiled offline: tests/triton_compile.py)
        stages = 3 if bucket > 16 else 2 if block_k == 128 else 4
        return GemmConfig(block_m, 64, block_k, split, 4, stages)
    block_m = 128 if bucket >= 256 else 64
    block_n = 128 if np_ >= 128 else 64
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(block_m, block_n, min(group_size, 64), 1, warps, 3)


# 2^23 and its fp32 bits: a code placed in the low bits of the mantissa reads as 2^23 + q. The
# kernels also take the bits as a run-time argument (_codes says why).
_TWO23 = tl.constexpr(8388608.0)
_TWO23_BITS = tl.constexpr(0x4B000000)


@triton.jit
def _tile_layout(
    qw_ptr, stride_qwk, stride_qwn, N, pid_n, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Index math of one [BLOCK_K, BLOCK_N] weight tile (module docstring): k and n of each tile
    row and column, the shifts that pick each code's nibble, and the word grid's pointers at
    k-step 0."""
    # Index arithmetic uses // and % (not shifts and masks) so that the compiler's axis analysis
    # sees the contiguous runs: the 4 words of a row quad, the k0 pairs of x.
    # Tile row i = 4 r + 2 k3 + k0 holds local k = 16 (i // 16) + 8 k3 + 2 (k2 k1) + k0.
    i = tl.arange(0, BLOCK_K)
    k_perm = (i // 16) * 16 + (i // 2 % 2) * 8 + (i // 4 % 4) * 2 + i % 2
    k_perm = tl.max_contiguous(tl.multiple_of(k_perm, 2), 2)
    row_shift = 16 * (i % 2) + 4 * (i // 2 % 2)  # nibble p = 4 k0 + 2 n3 + k3
    # Tile column j = n3 (BLOCK_N / 2) + c holds n = pid_n * BLOCK_N + 16 (c // 8) + 8 n3 + c % 8
    # (c = (nt, n2 n1 n0), the word column): runs of 8 columns are 8 adjacent outputs, so y and
    # the dequantized weights are stored 16 bytes at a time.
    j = tl.arange(0, BLOCK_N)
    col = j % (BLOCK_N // 2)
    offs_n = pid_n * BLOCK_N + (col // 8) * 16 + (j // (BLOCK_N // 2)) * 8 + col % 8
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, 8), 8)
    col_shift = 8 * (j // (BLOCK_N // 2))
    # Word grid: row r = (kt, k2 k1), column c = (nt, n2 n1 n0); word t = 4 (n2 n1 n0) + k2 k1.
    r = tl.arange(0, BLOCK_K // 4)
    c = tl.arange(0, BLOCK_N // 2)
    word_n = pid_n * BLOCK_N + (c // 8) * 16 + c % 8  # the n3 = 0 column of each word
    word_cols = (pid_n * (BLOCK_N // 16) + c // 8) * 32 + (c % 8) * 4
    word_ptrs = (
        qw_ptr
        + (r // 4)[:, None] * stride_qwk
        + ((r % 4)[:, None] + word_cols[None, :]) * stride_qwn
    )
    word_mask = (word_n < N)[None, :]
    return k_perm, row_shift, offs_n, col_shift, word_ptrs, word_mask


@triton.jit
def _group_params(
    qp_ptr, k0, offs_n, n_mask, stride_qpg, stride_qpn, stride_qpc, GROUP_SIZE: tl.constexpr
):
    """The fp16 (s, b) of the group holding input k0, for the columns offs_n, widened to fp32."""
    qp = qp_ptr + (k0 // GROUP_SIZE) * stride_qpg + offs_n * stride_qpn
    s = tl.load(qp, mask=n_mask, other=0.0).to(tl.float32)
    b = tl.load(qp + stride_qpc, mask=n_mask, other=0.0).to(tl.float32)
    return s, b


@triton.jit
def _codes(words, row_shift, col_shift, two23, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_K / 4, BLOCK_N / 2] word grid -> the [BLOCK_K, BLOCK_N] int4 codes as fp32.

    Each code goes into the low bits of 2^23's mantissa (fp32 2^23 + q, exact) and 2^23 is
    subtracted: the values of an int-to-float conversion, which runs at a quarter rate. The
    bits of 2^23 come as a run-time argument (_TWO23_BITS): as a constant, the compiler recognizes
    the pattern and emits the conversion."""
    rep = tl.broadcast_to(words[:, None, None, :], (BLOCK_K // 4, 4, 2, BLOCK_N // 2))
    rep = tl.reshape(rep, (BLOCK_K, BLOCK_N))
    # Arithmetic >> sign-extends negative words, but & 0xF keeps exactly the nibble.
    bits = (rep >> (row_shift[:, None] + col_shift[None, :])) & 0xF | two23
    return bits.to(tl.float32, bitcast=True) - _TWO23


@triton.jit
def _write_sums(sums, y_ptrs, part_offs, mask, parts_ptr, part_size, counter_ptr, pid_k, splits):
    """A program's fp32 sums to y: as they are without split-K; else stored as its split's
    partial (``parts_ptr``: [splits, M, N] contiguous), and the tile's last split to arrive,
    counted on ``counter_ptr`` (runtime/kernels/counters.py), adds the partials in split order,
    writes y and sets the counter back to 0. The sum's bits do not depend on which split came
    last, and no second kernel runs: at batch 1 a launch costs about what a GEMM does."""
    if splits == 1:
        tl.store(y_ptrs, round_to(sums, y_ptrs.dtype.element_ty), mask=mask)
    else:
        size = part_size.to(tl.int64)
        tl.store(parts_ptr + pid_k * size + part_offs, sums, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count releases them
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros_like(sums)
            for split in range(splits):
                # .cg: from L2, where the other splits' partials are, never a stale L1 line
                part = parts_ptr + split * size + part_offs
                total += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, round_to(total, y_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qw_ptr,
    qp_ptr,
    y_ptr,
    parts_ptr,
    counters_ptr,
    M,
    N,
    K,
    steps_per_split,
    splits,
    stride_xm,
    stride_xk,
    stride_qwk,
    stride_qwn,
    stride_qpg,
    stride_qpn,
    stride_qpc,
    stride_ym,
    two23,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grouped program order: GROUP_M row blocks sweep the same weight columns together.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    k_perm, row_shift, offs_n, col_shift, word_ptrs, word_mask = _tile_layout(
        qw_ptr, stride_qwk, stride_qwn, N, pid_n, BLOCK_K, BLOCK_N
    )
    n_mask = offs_n < N

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    m_mask = offs_m < M

    wait_for_producers(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step_begin = pid_k * steps_per_split
    step_end = tl.minimum(step_begin + steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(step_begin, step_end):
        k0 = step * BLOCK_K
        offs_k = k0 + k_perm
        xt = tl.load(
            x_rows + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        words = tl.load(word_ptrs + step * (BLOCK_K // 16) * stride_qwk, mask=word_mask, other=0)
        codes = _codes(words, row_shift, col_shift, two23, BLOCK_K, BLOCK_N)
        s, b = _group_params(
            qp_ptr, k0, offs_n, n_mask, stride_qpg, stride_qpn, stride_qpc, GROUP_SIZE
        )
        w = tl.fma(codes, s[None, :], b[None, :]).to(xt.dtype)
        if DOT_FP32:
            acc = tl.dot(xt.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w, acc)

    rows = offs_m.to(tl.int64)[:, None]
    _write_sums(
        acc,
        y_ptr + rows * stride_ym + offs_n[None, :],
        rows * N + offs_n[None, :],
        m_mask[:, None] & n_mask[None, :],
        parts_ptr,
        M * N,
        counters_ptr + pid,
        pid_k,
        splits,
    )


# The one-row kernel reads each code as an fp32 subnormal and carries its sums scaled by
# 2^-_SUM_SHIFT (_subnormal_code says why); 64 keeps every scaled x finite up to |x| = 2^42 and
# every product normal down to |x q| = 2^-62.
_SUM_SHIFT = tl.constexpr(64)


@triton.jit
def _subnormal_code(words, pos: tl.constexpr):
    """q 16^pos 2^-149 for the code q in bits 4 pos .. 4 pos + 3 of each word (pos <= 4): the
    masked bits read as an fp32 with no exponent bits, a subnormal, exactly. The caller
    multiplies by x 2^(149 - 4 pos - _SUM_SHIFT), so the FMA gives q x 2^-_SUM_SHIFT with the
    one rounding of q x: one AND and one FMA a code. A normal float needs a subtraction more
    (2^23 + q, then 2^23 off), an int-to-float conversion runs at a quarter rate. GPUs
    multiply subnormal fp32 at full rate (NVIDIA's FMA pipeline handles them in hardware since
    Fermi), and Triton compiles fp32 arithmetic without flush-to-zero (no ``.ftz`` in the
    PTX)."""
    return (words & (0xF << (4 * pos))).to(tl.float32, bitcast=True)


@triton.jit
def _x_for(x, pos: tl.constexpr):
    """x 2^(149 - 4 pos - _SUM_SHIFT): the factor of the code at nibble position pos."""
    return x * (2.0 ** (149 - 4 * pos - _SUM_SHIFT))


@triton.jit
def _halves(pairs, BF16: tl.constexpr):
    """The two 16-bit floats in each int32 word (the lower address in the low half), as fp32:
    activations, and the fp16 (s, b) of a column. bf16 widens by placing its bits in the high
    half, with no conversion."""
    if BF16:
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _w4a16_gemv_kernel(
    xp_ptr,
    qw_ptr,
    qpp_ptr,
    y_ptr,
    parts_ptr,
    counters_ptr,
    N,
    K2,
    groups_per_split,
    splits,
    stride_xm,
    stride_qwk,
    stride_qwn,
    stride_qpg,
    stride_ym,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of y: BLOCK_N outputs over one slice of K's groups, x read as int32 pairs (K2 a
    row, zero past K: the padded groups' codes multiply zeros).

    The weight word (r, c) of the [BLOCK_K / 4, BLOCK_N / 2] grid (``_tile_layout``) holds the
    codes of inputs k = 16 kt + 2 (k2 k1) + 8 k3 + k0 (r = (kt, k2 k1)) for outputs n and n + 8
    (n3): nibble 4 k0 + 2 n3 + k3. So the x pair (k0 = 0, 1) at k3 = 0 and the one at k3 = 1
    are the two activation pairs a word row needs, and every step is elementwise work on
    tensors of the word grid's shape: the words stay in the layout they were loaded in, where
    a layout change goes through shared memory with barriers (the first version of this kernel
    made ten a step). Each word row sums x q over a group's steps (unrolled: one FMA a code),
    then the group's (s, b) is applied once, s * sum(x q) + b * sum(x) (the algebra of
    sum_k x_k (s q_kn + b)), and the word rows are summed once, after the loop.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    _, _, _, _, word_ptrs, word_mask = _tile_layout(
        qw_ptr, stride_qwk, stride_qwn, N, pid_n, BLOCK_K, BLOCK_N
    )
    r = tl.arange(0, BLOCK_K // 4)
    c = tl.arange(0, BLOCK_N // 2)
    n0 = pid_n * BLOCK_N + (c // 8) * 16 + c % 8  # the output of nibbles with n3 = 0
    pair = (r // 4) * 8 + r % 4  # the pair of inputs k and k + 1 at k3 = 0
    x_row = xp_ptr + row * stride_xm

    group_begin = pid_k * groups_per_split
    group_end = tl.minimum(group_begin + groups_per_split, tl.cdiv(2 * K2, GROUP_SIZE))
    first = word_ptrs + group_begin * (GROUP_SIZE // 16) * stride_qwk
    for i in tl.static_range(GROUP_SIZE // BLOCK_K):  # weights: no kernel of the step writes them
        prefetch_l2(first + i * (BLOCK_K // 16) * stride_qwk, word_mask, qw_ptr, PDL)
    wait_for_producers(PDL)
    acc0 = tl.zeros((BLOCK_K // 4, BLOCK_N // 2), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_K // 4, BLOCK_N // 2), dtype=tl.float32)
    for group in range(group_begin, group_end):
        params = qpp_ptr + group * stride_qpg  # loaded first: in flight during the steps
        s0, b0 = _halves(tl.load(params + n0, mask=n0 < N, other=0), False)
        s1, b1 = _halves(tl.load(params + n0 + 8, mask=n0 + 8 < N, other=0), False)
        d0 = tl.zeros((BLOCK_K // 4, BLOCK_N // 2), dtype=tl.float32)
        d1 = tl.zeros((BLOCK_K // 4, BLOCK_N // 2), dtype=tl.float32)
        x_sum = tl.zeros((BLOCK_K // 4,), dtype=tl.float32)
        for i in tl.static_range(GROUP_SIZE // BLOCK_K):
            step = group * (GROUP_SIZE // BLOCK_K) + i
            at = step * (BLOCK_K // 2) + pair
            x00, x10 = _halves(tl.load(x_row + at, mask=at < K2, other=0), X_BF16)
            x01, x11 = _halves(tl.load(x_row + at + 4, mask=at + 4 < K2, other=0), X_BF16)
            words = tl.load(
                word_ptrs + step * (BLOCK_K // 16) * stride_qwk, mask=word_mask, other=0
            )
            high = words >> 12  # nibbles 5, 6, 7 at positions 2, 3, 4 (<= 4)
            # nibble 4 k0 + 2 n3 + k3 is x_{k0 k3}'s code for output n + 8 n3
            d0 = (
                d0
                + _subnormal_code(words, 0) * _x_for(x00, 0)[:, None]
                + _subnormal_code(words, 1) * _x_for(x01, 1)[:, None]
                + _subnormal_code(words, 4) * _x_for(x10, 4)[:, None]
                + _subnormal_code(high, 2) * _x_for(x11, 2)[:, None]
            )
            d1 = (
                d1
                + _subnormal_code(words, 2) * _x_for(x00, 2)[:, None]
                + _subnormal_code(words, 3) * _x_for(x01, 3)[:, None]
                + _subnormal_code(high, 3) * _x_for(x10, 3)[:, None]
                + _subnormal_code(high, 4) * _x_for(x11, 4)[:, None]
            )
            x_sum += x00 + x01 + x10 + x11
        # d is sum(x q) 2^-_SUM_SHIFT: the scales take the power of two back
        s0, s1 = s0 * 2.0**_SUM_SHIFT, s1 * 2.0**_SUM_SHIFT
        acc0 = tl.fma(d0, s0[None, :], tl.fma(x_sum[:, None], b0[None, :], acc0))
        acc1 = tl.fma(d1, s1[None, :], tl.fma(x_sum[:, None], b1[None, :], acc1))

    cols = n0[:, None] + 8 * tl.arange(0, 2)[None, :]  # [BLOCK_N / 2, 2]: n and n + 8
    _write_sums(
        tl.join(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0)),
        y_ptr + row * stride_ym + cols,
        row * N + cols,
        cols < N,
        parts_ptr,
        tl.num_programs(2) * N,
        counters_ptr + row * tl.num_programs(0) + pid_n,
        pid_k,
        splits,
    )


@triton.jit
def _dequant_kernel(
    qw_ptr,
    qp_ptr,
    w_ptr,
    N,
    K,
    stride_qwk,
    stride_qwn,
    stride_qpg,
    stride_qpn,
    stride_qpc,
    stride_wn,
    stride_wk,
    two23,
    GROUP_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """W_hat[n, k] for one [BLOCK_K, BLOCK_N] tile, with the GEMM's own unpacking and fma: the
    bits its ``tl.dot`` multiplies."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_perm, row_shift, offs_n, col_shift, word_ptrs, word_mask = _tile_layout(
        qw_ptr, stride_qwk, stride_qwn, N, pid_n, BLOCK_K, BLOCK_N
    )
    n_mask = offs_n < N
    words = tl.load(word_ptrs + pid_k * (BLOCK_K // 16) * stride_qwk, mask=word_mask, other=0)
    codes = _codes(words, row_shift, col_shift, two23, BLOCK_K, BLOCK_N)
    k0 = pid_k * BLOCK_K
    s, b = _group_params(qp_ptr, k0, offs_n, n_mask, stride_qpg, stride_qpn, stride_qpc, GROUP_SIZE)
    w = tl.fma(codes, s[None, :], b[None, :]).to(w_ptr.dtype.element_ty)
    offs_k = k0 + k_perm
    out = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    tl.store(out, w, mask=(offs_k < K)[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class DequantTile:
    """A launch of :func:`_dequant_kernel`: block_k divides the group size (one group's (s, b) a
    tile) and block_n holds whole 16-column units; both powers of two (``tl.arange``)."""

    block_k: int = 32  # 32 divides every group size
    block_n: int = 64
    num_warps: int = 4


def _check_weight(
    qweight: torch.Tensor, qparams: torch.Tensor, n: int, k: int, group_size: int
) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if n < 1 or k < 1:
        raise ValueError(f"n and k must be positive, got n={n}, k={k}")
    np_, kp = padded_shape(n, k, group_size)
    qw_shape = (kp // TILE, 2 * np_)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != qw_shape:
        raise ValueError(
            f"qweight must be int32 {list(qw_shape)} for N={n}, K={k}, group_size={group_size} "
            f"(N padded to {N_ALIGN}, K to the group), got {qweight.dtype} {list(qweight.shape)}"
        )
    qp_shape = (kp // group_size, np_, 2)
    if qparams.dtype != torch.float16 or tuple(qparams.shape) != qp_shape:
        raise ValueError(
            f"qparams must be float16 {list(qp_shape)} for N={n}, K={k}, "
            f"group_size={group_size}, got {qparams.dtype} {list(qparams.shape)}"
        )
    if not same_device(qweight.device, qparams.device):
        raise ValueError(
            f"qweight and qparams must share a device, got {qweight.device}, {qparams.device}"
        )


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
) -> None:
    _check_weight(qweight, qparams, n, k, group_size)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, K={k}], got shape {tuple(x.shape)}")
    if not same_device(x.device, qweight.device):
        raise ValueError(
            f"x, qweight and qparams must share a device, got {x.device}, {qweight.device}, "
            f"{qparams.device}"
        )


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] fp16 or bf16 (any strides) -> y [M, N] in x.dtype.

    qweight / qparams are the artifact's tensors for a linear of logical shape [n, k] (or an
    N-shard of them); config defaults to :func:`heuristic_config`.
    """
    _check_inputs(x, qweight, qparams, n, k, group_size)
    if config is not None:
        config.check_group_size(group_size)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    cfg = config if config is not None else heuristic_config(m, n, k, group_size)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    steps_per_split, y, parts, counters = _split_outputs(
        x, n, triton.cdiv(k, cfg.block_k), cfg.split_k, grid[0]
    )
    _w4a16_kernel[(grid[0], parts.shape[0])](
        x,
        qweight,
        qparams,
        y,
        parts,
        counters,
        m,
        n,
        k,
        steps_per_split,
        parts.shape[0],
        *x.stride(),
        *qweight.stride(),
        *qparams.stride(),
        y.stride(0),
        _TWO23_BITS.value,
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=_GROUP_M,
        DOT_FP32=isinstance(_w4a16_kernel, InterpretedFunction) and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(x.device),
    )
    return y


def _split_outputs(
    x: torch.Tensor, n: int, k_steps: int, split_k: int, tiles: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k-steps (the kernel's unit of K) per split, y [M, N] in x's dtype, the fp32 partials
    [splits, M, N] (y itself without split-K; no slice is left empty) and the stream's counters
    for ``tiles`` tiles."""
    steps_per_split = triton.cdiv(k_steps, split_k)
    splits = triton.cdiv(k_steps, steps_per_split)
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if splits == 1:
        return steps_per_split, y, y[None], y
    parts = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    return steps_per_split, y, parts, arrival_counters(x.device, tiles)


def w4a16_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    config: GemvConfig,
) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x.dtype, one program per row and block of outputs
    (:class:`GemvConfig`): for the decode rows where a 16-row dot tile would be mostly padding.
    Each row unpacks the weights again, so past a few rows :func:`w4a16_gemm` is the kernel."""
    _check_inputs(x, qweight, qparams, n, k, group_size)
    config.check_group_size(group_size)
    m = x.shape[0]
    if m == 0:
        return x.new_empty((0, n))
    tiles = m * triton.cdiv(n, config.block_n)
    groups = triton.cdiv(k, group_size)  # the slices' unit: a group's (s, b) is applied once
    groups_per_split, y, parts, counters = _split_outputs(x, n, groups, config.split_k, tiles)
    pairs = _activation_pairs(x)
    params = _param_pairs(qparams)
    _w4a16_gemv_kernel[(triton.cdiv(n, config.block_n), parts.shape[0], m)](
        pairs,
        qweight,
        params,
        y,
        parts,
        counters,
        n,
        pairs.shape[1],
        groups_per_split,
        parts.shape[0],
        pairs.stride(0),
        *qweight.stride(),
        params.stride(0),
        y.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        X_BF16=x.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        **pdl_launch(x.device),
    )
    return y


def _activation_pairs(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] viewed as int32 [M, K / 2], two adjacent activations a word: the one-row
    kernel loads the pairs a weight word row needs as 16-byte vectors. A row of odd length is
    zero-padded, and a view whose pairs are not 4-byte words is copied first."""
    if x.shape[1] % 2:
        x = torch.nn.functional.pad(x, (0, 1))
    if x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(torch.int32)


def _param_pairs(qparams: torch.Tensor) -> torch.Tensor:
    """qparams [G, N, 2] fp16 viewed as int32 [G, N], one (s, b) pair a word: the one-row
    kernel loads a column's pair in one 4-byte load (two 2-byte loads and their addresses
    before)."""
    if qparams.stride(2) != 1 or qparams.stride(1) % 2 or qparams.storage_offset() % 2:
        qparams = qparams.contiguous()
    return qparams.view(torch.int32).squeeze(2)


def w4a16_dequantize(
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    tile: DequantTile = DequantTile(),
) -> torch.Tensor:
    """W_hat [n, k] in ``dtype`` (fp16 or bf16; a transposed view of a contiguous [k, n]): the
    weights :func:`w4a16_gemm` multiplies, bit for bit (the fp32 fma of the reference
    dequantization, rounded once to ``dtype``). ``tile`` is for benchmarks to try others."""
    _check_weight(qweight, qparams, n, k, group_size)
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"the weights dequantize to float16 or bfloat16, not {dtype}")
    if (
        group_size % tile.block_k
        or min(tile.block_k, tile.block_n) < TILE
        or not _is_pow2(tile.block_n)
    ):
        raise ValueError(
            f"{tile}: block_k must divide the group size {group_size} and be at least {TILE}, "
            f"block_n a power of two from {TILE}"
        )
    # stored k-major ([k, n] contiguous, returned transposed): a tile row is then block_n adjacent
    # columns, where an [n, k] store would scatter 2-element runs; matmul reads either layout
    w = torch.empty(k, n, dtype=dtype, device=qweight.device).T
    grid = (triton.cdiv(k, tile.block_k), triton.cdiv(n, tile.block_n))
    _dequant_kernel[grid](
        qweight,
        qparams,
        w,
        n,
        k,
        *qweight.stride(),
        *qparams.stride(),
        *w.stride(),
        _TWO23_BITS.value,
        GROUP_SIZE=group_size,
        BLOCK_K=tile.block_k,
        BLOCK_N=tile.block_n,
        num_warps=tile.num_warps,
    )
    return w


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    config: LinearConfig,
) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x.dtype, by :func:`w4a16_gemm`, :func:`w4a16_gemv` for a
    GemvConfig or, for a DequantConfig, the dequantized weights and torch's matmul."""
    if isinstance(config, DequantConfig):
        _check_inputs(x, qweight, qparams, n, k, group_size)
        return torch.nn.functional.linear(
            x, w4a16_dequantize(qweight, qparams, n, k, group_size, x.dtype)
        )
    if isinstance(config, GemvConfig):
        return w4a16_gemv(x, qweight, qparams, n, k, group_size, config)
    return w4a16_gemm(x, qweight, qparams, n, k, group_size, config)
