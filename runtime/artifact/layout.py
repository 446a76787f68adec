"""Int4 weight layout of the model artifact: ``lsq4-mma16x16-v1`` (pure-torch reference).

This module is the source of truth for how AWQ int4 weights are stored; every kernel is tested
against it. The full specification is ``docs/artifact-layout.md``. In short:

* The packed matrix is B = q^T (K x N), padded to Kp = ceil(K / gs) * gs rows and
  Np = ceil(N / 64) * 64 columns with nibble 0, and cut into 16 x 16 tiles.
* Inside a tile, element (k, n) with bits k3 k2 k1 k0 / n3 n2 n1 n0 goes to
  word t = (n2 n1 n0 k2 k1) and nibble p = (k0 n3 k3), so that the word of warp lane t is
  exactly its ``mma.m16n8k16`` B fragment (both n8 halves), with nibbles interleaved
  0,2,4,6,1,3,5,7 for the fp16x2 magic-number conversion.
* ``qweight`` is int32 [Kp / 16, 2 * Np]; ``qweight[kt, 32 * nt + t]`` is word t of tile (kt, nt).
* ``qparams`` is fp16 [Kp / gs, Np, 2] holding (s, -z * s), so w = q * s + (-z * s).

Packing and unpacking are one reshape + permute of index bits (no per-element loops), the same
way a Triton kernel undoes it.
"""

from __future__ import annotations

import torch

LAYOUT_NAME = "lsq4-mma16x16-v1"
LAYOUT_VERSION = 1
TILE = 16
N_ALIGN = 64
GROUP_SIZES = (32, 64, 128)

_WORDS_PER_TILE = TILE * TILE // 8  # 32 words of 8 nibbles = one word per warp lane
_NIBBLES_PER_WORD = 8

# Axes of B[Kp, Np] viewed as [KT, k3, k2, k1, k0, NT, n3, n2, n1, n0] (most significant first).
_B_AXES = ("kt", "k3", "k2", "k1", "k0", "nt", "n3", "n2", "n1", "n0")
# Axes of the packed nibbles: row kt, then column 32 * nt + t with t = (n2 n1 n0 k2 k1), then
# nibble p = (k0 n3 k3). Reading this tuple left to right *is* the layout.
_PACKED_AXES = ("kt", "nt", "n2", "n1", "n0", "k2", "k1", "k0", "n3", "k3")
_PACK_PERM = tuple(_B_AXES.index(a) for a in _PACKED_AXES)
_UNPACK_PERM = tuple(_PACKED_AXES.index(a) for a in _B_AXES)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def _check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def _check_dims(n: int, k: int) -> None:
    if n < 1 or k < 1:
        raise ValueError(f"logical shape must be positive, got N={n}, K={k}")


def padded_shape(n: int, k: int, group_size: int) -> tuple[int, int]:
    """Return (Np, Kp): N rounded up to 64 (N-sharding unit), K up to whole groups."""
    _check_group_size(group_size)
    _check_dims(n, k)
    return _ceil_to(n, N_ALIGN), _ceil_to(k, group_size)


def qweight_shape(n: int, k: int, group_size: int) -> tuple[int, int]:
    """The stored int32 qweight's shape, [Kp / 16, 2 * Np], for a logical [N, K]: what a
    reader checks a manifest against, since a shape that disagrees reads the wrong words."""
    np_, kp = padded_shape(n, k, group_size)
    return kp // TILE, 2 * np_


def qparams_shape(n: int, k: int, group_size: int) -> tuple[int, int, int]:
    """The stored fp16 qparams' shape, [Kp / gs, Np, 2], for a logical [N, K]."""
    np_, kp = padded_shape(n, k, group_size)
    return kp // group_size, np_, 2


def words_to_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [...] -> uint8 [..., 8]; nibble p is bits 4p..4p+3 of the word.

    Done on the words' bytes (little-endian, as safetensors stores them and every host torch
    runs on is): byte j holds nibbles 2j (low) and 2j+1 (high). Byte-wide ops move a quarter
    of the memory that shifting int32 words would, which is what conversion time is made of.
    """
    b = words.contiguous().view(torch.uint8).reshape(*words.shape, 4)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*words.shape, _NIBBLES_PER_WORD)


def nibbles_to_words(nib: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 8] (values 0..15) -> int32 [...]: the inverse of words_to_nibbles."""
    pairs = nib.reshape(*nib.shape[:-1], 4, 2)
    b = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()
    return b.view(torch.int32).reshape(nib.shape[:-1])


def pack_qweight(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pack int4 codes q [N, K] (values 0..15) into the int32 qweight [Kp / 16, 2 * Np]."""
    _check_group_size(group_size)
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {tuple(q.shape)}")
    if q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
        raise ValueError(f"q must have an integer dtype, got {q.dtype}")
    n, k = q.shape
    _check_dims(n, k)
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise ValueError(f"q values must be in 0..15, got range {int(q.min())}..{int(q.max())}")
    np_, kp = padded_shape(n, k, group_size)
    b = torch.zeros((kp, np_), dtype=torch.uint8, device=q.device)
    b[:k, :n] = q.t().to(torch.uint8)
    nib = (
        b.reshape(kp // TILE, 2, 2, 2, 2, np_ // TILE, 2, 2, 2, 2)
        .permute(_PACK_PERM)
        .reshape(*qweight_shape(n, k, group_size), _NIBBLES_PER_WORD)
    )
    return nibbles_to_words(nib)


def _check_qweight(qweight: torch.Tensor, n: int, k: int) -> tuple[int, int]:
    """Validate qweight against the logical (N, K); return its (Np, Kp)."""
    _check_dims(n, k)
    if qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32, got {qweight.dtype}")
    if qweight.dim() != 2 or qweight.shape[1] % (2 * N_ALIGN) != 0:
        raise ValueError(
            f"qweight must be 2-D [Kp/16, 2*Np] with Np a multiple of {N_ALIGN}, "
            f"got shape {tuple(qweight.shape)}"
        )
    kp, np_ = qweight.shape[0] * TILE, qweight.shape[1] // 2
    if np_ != _ceil_to(n, N_ALIGN):
        raise ValueError(
            f"N mismatch: qweight holds Np={np_} columns, N={n} needs {_ceil_to(n, N_ALIGN)}"
        )
    if kp not in {_ceil_to(k, gs) for gs in GROUP_SIZES}:
        raise ValueError(
            f"K mismatch: qweight holds Kp={kp} rows, which is not K={k} padded to a "
            f"group size in {GROUP_SIZES}"
        )
    return np_, kp


def unpack_qweight(qweight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of pack_qweight: return the uint8 codes [N, K] of the logical region."""
    np_, kp = _check_qweight(qweight, n, k)
    nib = words_to_nibbles(qweight)
    b = (
        nib.reshape(kp // TILE, np_ // TILE, 2, 2, 2, 2, 2, 2, 2, 2)
        .permute(_UNPACK_PERM)
        .reshape(kp, np_)
    )
    return b[:k, :n].t().contiguous()


def pack_qparams(scale: torch.Tensor, zero: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """Pack scale [N, G] and integer zero [N, G] into fp16 qparams [G, Np, 2] = (s, -z*s).

    Storing -z*s instead of z makes dequantization one FMA. -z*s is computed in fp32 from the
    original scale and then rounded to fp16 once.
    """
    _check_group_size(group_size)
    if scale.dim() != 2 or not scale.dtype.is_floating_point:
        raise ValueError(
            f"scale must be a 2-D float tensor [N, G], got {scale.dtype} {tuple(scale.shape)}"
        )
    if zero.shape != scale.shape:
        raise ValueError(
            f"zero must have the shape of scale {tuple(scale.shape)}, got {tuple(zero.shape)}"
        )
    if zero.dtype.is_floating_point or zero.dtype.is_complex or zero.dtype == torch.bool:
        raise ValueError(f"zero must have an integer dtype, got {zero.dtype}")
    n, g = scale.shape
    shape = qparams_shape(n, k, group_size)
    if g != shape[0]:
        raise ValueError(
            f"K mismatch: scale has G={g} groups, K={k} with group_size={group_size} "
            f"needs {shape[0]}"
        )
    if int(zero.min()) < 0 or int(zero.max()) > 15:
        raise ValueError(
            f"zero values must be in 0..15, got range {int(zero.min())}..{int(zero.max())}"
        )
    s32 = scale.to(torch.float32)
    pair = torch.stack((s32, -zero.to(torch.float32) * s32), dim=-1).to(torch.float16)
    if not bool(torch.isfinite(pair).all()):
        raise ValueError("scale or -zero*scale is not finite in fp16 (inf/nan or > 65504)")
    qparams = torch.zeros(shape, dtype=torch.float16, device=scale.device)
    qparams[:, :n] = pair.transpose(0, 1)
    return qparams


def unpack_qparams(qparams: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (s, b) fp16 [N, G] of the logical rows, where b = -z*s."""
    if n < 1:
        raise ValueError(f"N must be positive, got {n}")
    if qparams.dtype != torch.float16:
        raise ValueError(f"qparams must be float16, got {qparams.dtype}")
    if qparams.dim() != 3 or qparams.shape[2] != 2:
        raise ValueError(f"qparams must have shape [G, Np, 2], got {tuple(qparams.shape)}")
    if qparams.shape[1] != _ceil_to(n, N_ALIGN):
        raise ValueError(
            f"N mismatch: qparams holds Np={qparams.shape[1]} columns, "
            f"N={n} needs {_ceil_to(n, N_ALIGN)}"
        )
    s = qparams[:, :n, 0].t().contiguous()
    b = qparams[:, :n, 1].t().contiguous()
    return s, b


def dequantize(
    qweight: torch.Tensor, qparams: torch.Tensor, n: int, k: int, group_size: int
) -> torch.Tensor:
    """Reference W_hat [N, K] fp32: q * s + b with the stored fp16 s and b = -z*s.

    q * s is exact in fp32 (4-bit times 11-bit mantissa), so this equals an fp32 FMA.
    """
    _check_group_size(group_size)
    _, kp = _check_qweight(qweight, n, k)
    if kp != _ceil_to(k, group_size):
        raise ValueError(
            f"K mismatch: qweight holds Kp={kp} rows, K={k} with group_size={group_size} "
            f"needs {_ceil_to(k, group_size)}"
        )
    s, b = unpack_qparams(qparams, n)
    if s.shape[1] != kp // group_size:
        raise ValueError(
            f"K mismatch: qparams has G={s.shape[1]} groups, qweight has {kp // group_size}"
        )
    q = unpack_qweight(qweight, n, k).to(torch.float32)
    group = torch.arange(k, device=qweight.device) // group_size
    return q * s.to(torch.float32)[:, group] + b.to(torch.float32)[:, group]


def tile_order() -> tuple[torch.Tensor, torch.Tensor]:
    """(k, n) inside a 16 x 16 tile of the code that nibble p of word t holds, each [32, 8]:
    the layout's permutation read as a table, for kernels that pack from other formats."""
    index = torch.arange(TILE * TILE).reshape(1, 2, 2, 2, 2, 1, 2, 2, 2, 2).permute(_PACK_PERM)
    index = index.reshape(_WORDS_PER_TILE, _NIBBLES_PER_WORD)
    return index // TILE, index % TILE
