"""Tests of the int4 artifact layout lsq4-mma16x16-v1 (runtime/artifact/layout.py).

The key test is test_pack_matches_per_lane_reference: an explicit, loop-based packer written from
the mma.m16n8k16 lane/fragment semantics in docs/artifact-layout.md must agree bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.artifact.layout import (
    GROUP_SIZES,
    LAYOUT_NAME,
    LAYOUT_VERSION,
    N_ALIGN,
    TILE,
    dequantize,
    pack_qparams,
    pack_qweight,
    padded_shape,
    unpack_qparams,
    unpack_qweight,
)

INTERLEAVE = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble position p holds fragment index INTERLEAVE[p]
FP16_UNIT_ROUNDOFF = 2.0**-11
FEW = settings(max_examples=50, deadline=None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_q(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), generator=_gen(seed), dtype=torch.uint8)


def _random_qparams_inputs(n: int, g: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    scale = torch.rand((n, g), generator=gen) * 0.05 + 1e-3
    zero = torch.randint(0, 16, (n, g), generator=gen)
    return scale, zero


def _lane_fragment_coords(t: int, i: int) -> tuple[int, int]:
    """(k, n) inside a 16x16 tile of B held by lane t as fragment value i (0..7).

    mma.m16n8k16: lane t = 4*groupID + tig holds B rows 2*tig + {0,1} (b0, b1) and
    2*tig + 8 + {0,1} (b2, b3) of column groupID; i = 4*half + b-index over the two n8 halves.
    """
    group_id, tig = divmod(t, 4)
    half, b_index = divmod(i, 4)
    k = 2 * tig + 8 * (b_index // 2) + (b_index % 2)
    n = 8 * half + group_id
    return k, n


def _to_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _reference_pack(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Slow, explicit packer: per tile, per lane, per fragment value."""
    n, k = q.shape
    np_, kp = padded_shape(n, k, group_size)
    qs = q.tolist()
    out = torch.empty((kp // 16, 2 * np_), dtype=torch.int32)
    for kt in range(kp // 16):
        for nt in range(np_ // 16):
            for t in range(32):
                word = 0
                for p in range(8):
                    lk, ln = _lane_fragment_coords(t, INTERLEAVE[p])
                    gk, gn = 16 * kt + lk, 16 * nt + ln
                    nibble = qs[gn][gk] if gn < n and gk < k else 0
                    word |= nibble << (4 * p)
                out[kt, 32 * nt + t] = _to_int32(word)
    return out


def test_constants() -> None:
    assert (LAYOUT_NAME, LAYOUT_VERSION, TILE, N_ALIGN) == ("lsq4-mma16x16-v1", 1, 16, 64)
    assert GROUP_SIZES == (32, 64, 128)


@pytest.mark.parametrize(
    ("n", "k", "gs", "expected"),
    [
        (1, 1, 32, (64, 32)),
        (64, 128, 128, (64, 128)),
        (65, 129, 64, (128, 192)),
        (200, 300, 128, (256, 384)),
    ],
)
def test_padded_shape(n: int, k: int, gs: int, expected: tuple[int, int]) -> None:
    assert padded_shape(n, k, gs) == expected


@FEW
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    gs=st.sampled_from(GROUP_SIZES),
    seed=st.integers(0, 2**31),
)
def test_round_trip(n: int, k: int, gs: int, seed: int) -> None:
    q = _random_q(n, k, seed)
    qweight = pack_qweight(q, gs)
    np_, kp = padded_shape(n, k, gs)
    assert qweight.dtype == torch.int32
    assert qweight.shape == (kp // 16, 2 * np_)
    assert torch.equal(unpack_qweight(qweight, n, k), q)


@FEW
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    gs=st.sampled_from(GROUP_SIZES),
    seed=st.integers(0, 2**31),
)
def test_padded_region_is_zero_nibbles(n: int, k: int, gs: int, seed: int) -> None:
    q = torch.randint(1, 16, (n, k), generator=_gen(seed), dtype=torch.uint8)  # no zero codes
    qweight = pack_qweight(q, gs)
    np_, kp = padded_shape(n, k, gs)
    # Exactly N*K nonzero nibbles in the whole tensor: nothing leaks into the padding.
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (qweight.unsqueeze(-1) >> shifts) & 0xF
    assert int(nibbles.count_nonzero()) == n * k
    # The padded B, read back as a logical (Np, Kp) matrix, is q followed by zeros.
    full = unpack_qweight(qweight, np_, kp)
    assert torch.equal(full[:n, :k], q)
    assert int(full[n:].count_nonzero()) == 0 and int(full[:, k:].count_nonzero()) == 0


def test_int32_wraparound_round_trips() -> None:
    q = torch.full((64, 32), 15, dtype=torch.uint8)  # every word is 0xFFFFFFFF
    qweight = pack_qweight(q, 32)
    assert bool((qweight == -1).all())
    q = _random_q(64, 32, 7)
    qweight = pack_qweight(q, 32)
    assert bool((qweight < 0).any()) and bool((qweight > 0).any())
    assert torch.equal(unpack_qweight(qweight, 64, 32), q)


@pytest.mark.parametrize(("n", "k", "gs"), [(70, 40, 32), (130, 150, 64), (16, 200, 128)])
def test_pack_matches_per_lane_reference(n: int, k: int, gs: int) -> None:
    q = _random_q(n, k, n * 1000 + k)
    assert torch.equal(pack_qweight(q, gs), _reference_pack(q, gs))


def test_bit_formulas_match_lane_semantics() -> None:
    """t = (n2 n1 n0 k2 k1), p = (k0 n3 k3) is the same map as lane/fragment + interleave."""
    seen = set()
    for t in range(32):
        for p in range(8):
            k, n = _lane_fragment_coords(t, INTERLEAVE[p])
            assert t == 4 * (n & 7) + ((k >> 1) & 3)
            assert p == 4 * (k & 1) + 2 * (n >> 3) + (k >> 3)
            seen.add((k, n))
    assert len(seen) == 256


def test_worked_example_from_doc() -> None:
    # B[k=25, n=44] -> tile (1, 2), local (k=9, n=12) -> word 16 of the tile, nibble 7.
    q = _random_q(100, 64, 3)
    qweight = pack_qweight(q, 32)
    assert (int(qweight[1, 2 * 32 + 16]) >> 28) & 0xF == int(q[44, 25])


@pytest.mark.skipif(sys.byteorder != "little", reason="fp16x2 halves assume little-endian")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp16_pair_trick(seed: int) -> None:
    q = _random_q(64, 32, seed)
    qweight = pack_qweight(q, 32)
    gen = _gen(seed)
    for _ in range(8):
        kt = int(torch.randint(0, qweight.shape[0], (1,), generator=gen))
        col = int(torch.randint(0, qweight.shape[1], (1,), generator=gen))
        nt, t = divmod(col, 32)
        frag = []
        for i in range(8):
            lk, ln = _lane_fragment_coords(t, i)
            frag.append(int(q[16 * nt + ln, 16 * kt + lk]))
        word = qweight[kt, col].reshape(1)
        for j in range(4):
            masked = (word >> (4 * j)) & 0x000F000F
            halves = masked.view(torch.int16).tolist()
            assert halves == [frag[2 * j], frag[2 * j + 1]]
            # int4 -> fp16: OR the exponent of 1024.0 (0x6400) into each half, subtract 1024.
            as_fp16 = (masked | 0x64006400).view(torch.float16).float() - 1024.0
            assert as_fp16.tolist() == [float(frag[2 * j]), float(frag[2 * j + 1])]


@FEW
@given(
    n_tiles=st.integers(1, 4),
    cut=st.data(),
    extra=st.integers(0, 63),
    k=st.integers(1, 300),
    gs=st.sampled_from(GROUP_SIZES),
    seed=st.integers(0, 2**31),
)
def test_shard_along_n_is_column_slice(
    n_tiles: int, cut: st.DataObject, extra: int, k: int, gs: int, seed: int
) -> None:
    n = N_ALIGN * n_tiles + extra
    q = _random_q(n, k, seed)
    qweight = pack_qweight(q, gs)
    bounds = list(range(0, n, N_ALIGN)) + [n]
    i0 = cut.draw(st.integers(0, len(bounds) - 2))
    i1 = cut.draw(st.integers(i0 + 1, len(bounds) - 1))
    n0, n1 = bounds[i0], bounds[i1]
    shard = pack_qweight(q[n0:n1], gs)
    assert torch.equal(qweight[:, 2 * n0 : 2 * n0 + shard.shape[1]], shard)


@FEW
@given(
    n=st.integers(1, 150),
    groups=st.integers(1, 6),
    extra=st.integers(0, 127),
    gs=st.sampled_from(GROUP_SIZES),
    cut=st.data(),
    seed=st.integers(0, 2**31),
)
def test_shard_along_k_is_row_slice(
    n: int, groups: int, extra: int, gs: int, cut: st.DataObject, seed: int
) -> None:
    k = gs * groups + extra % gs
    q = _random_q(n, k, seed)
    qweight = pack_qweight(q, gs)
    bounds = list(range(0, k, gs)) + [k]
    i0 = cut.draw(st.integers(0, len(bounds) - 2))
    i1 = cut.draw(st.integers(i0 + 1, len(bounds) - 1))
    k0, k1 = bounds[i0], bounds[i1]
    shard = pack_qweight(q[:, k0:k1], gs)
    assert torch.equal(qweight[k0 // 16 : k0 // 16 + shard.shape[0]], shard)


@FEW
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 300),
    gs=st.sampled_from(GROUP_SIZES),
    seed=st.integers(0, 2**31),
)
def test_qparams_round_trip_and_dequantize(n: int, k: int, gs: int, seed: int) -> None:
    np_, kp = padded_shape(n, k, gs)
    g = kp // gs
    scale, zero = _random_qparams_inputs(n, g, seed)
    qparams = pack_qparams(scale, zero, gs, k)
    assert qparams.dtype == torch.float16
    assert qparams.shape == (g, np_, 2)
    assert int(qparams[:, n:].count_nonzero()) == 0  # padded columns are exactly (0, 0)

    s, b = unpack_qparams(qparams, n)
    assert torch.equal(s, scale.half())
    assert torch.equal(b, (-zero.float() * scale).half())

    q = _random_q(n, k, seed + 1)
    w_hat = dequantize(pack_qweight(q, gs), qparams, n, k, gs)
    assert w_hat.dtype == torch.float32 and w_hat.shape == (n, k)
    group = torch.arange(k) // gs
    s_k, z_k = scale[:, group].double(), zero[:, group].double()
    exact = (q.double() - z_k) * s_k
    # Tolerance: s and -z*s are each rounded once to fp16 (relative error <= 2^-11), so
    # |W_hat - (q - z) s| <= 2^-11 * s * (q + z), plus fp32 rounding of the sum (2^-24 * 15 s).
    bound = FP16_UNIT_ROUNDOFF * s_k * (q.double() + z_k) + 2.0**-24 * 16 * s_k
    assert bool(((w_hat.double() - exact).abs() <= bound).all())
    # And exactly the documented formula from the stored fp16 values.
    expected = q.float() * s.float()[:, group] + b.float()[:, group]
    assert torch.equal(w_hat, expected)


def test_dequantize_is_not_trivially_zero() -> None:
    n, k, gs = 70, 100, 32
    q = _random_q(n, k, 11)
    scale, zero = _random_qparams_inputs(n, padded_shape(n, k, gs)[1] // gs, 12)
    w_hat = dequantize(pack_qweight(q, gs), pack_qparams(scale, zero, gs, k), n, k, gs)
    assert float(w_hat.abs().mean()) > 1e-3


def _q(n: int = 8, k: int = 32) -> torch.Tensor:
    return _random_q(n, k, 5)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pack_qweight(_q(), 16), "group_size must be one of"),
        (lambda: pack_qweight(_q().float(), 32), "integer dtype"),
        (lambda: pack_qweight(_q()[0], 32), "2-D"),
        (lambda: pack_qweight(_q().long() + 1, 32), r"0\.\.15"),
        (lambda: pack_qweight(_q().to(torch.int8) - 1, 32), r"0\.\.15"),
        (lambda: pack_qweight(torch.zeros((0, 32), dtype=torch.uint8), 32), "positive"),
        (lambda: padded_shape(8, 32, 100), "group_size"),
        (lambda: unpack_qweight(pack_qweight(_q(), 32), 65, 32), "N mismatch"),
        (lambda: unpack_qweight(pack_qweight(_q(), 32), 8, 200), "K mismatch"),
        (lambda: unpack_qweight(pack_qweight(_q(), 32).long(), 8, 32), "int32"),
        (lambda: unpack_qweight(torch.zeros((2, 100), dtype=torch.int32), 8, 32), "2-D"),
        (
            lambda: pack_qparams(torch.rand(8, 1), torch.zeros(8, 2, dtype=torch.long), 32, 32),
            "shape of scale",
        ),
        (
            lambda: pack_qparams(torch.rand(8, 2), torch.zeros(8, 2, dtype=torch.long), 32, 32),
            "K mismatch",
        ),
        (lambda: pack_qparams(torch.rand(8, 1), torch.zeros(8, 1), 32, 32), "integer dtype"),
        (
            lambda: pack_qparams(
                torch.ones(8, 1, dtype=torch.long), torch.ones(8, 1, dtype=torch.long), 32, 32
            ),
            "float",
        ),
        (lambda: pack_qparams(torch.rand(8, 1), torch.full((8, 1), 16), 32, 32), r"0\.\.15"),
        (
            lambda: pack_qparams(
                torch.full((8, 1), 1e5), torch.ones(8, 1, dtype=torch.long), 32, 32
            ),
            "not finite",
        ),
        (lambda: unpack_qparams(torch.zeros(1, 64, 2), 8), "float16"),
        (lambda: unpack_qparams(torch.zeros(1, 64, 3, dtype=torch.half), 8), r"\[G, Np, 2\]"),
        (lambda: unpack_qparams(torch.zeros(1, 64, 2, dtype=torch.half), 65), "N mismatch"),
        (
            lambda: dequantize(
                pack_qweight(_q(8, 40), 32), torch.zeros(2, 64, 2).half(), 8, 40, 128
            ),
            "K mismatch",
        ),
        (
            lambda: dequantize(
                pack_qweight(_q(8, 40), 64), torch.zeros(2, 64, 2).half(), 8, 40, 64
            ),
            "qparams has G=2",
        ),
    ],
)
def test_errors(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
