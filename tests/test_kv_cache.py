"""The paged KV pool: layout, byte accounting, and online int8/int4 quantization accuracy.

Quantization tolerance, per token-head vector x (step = (max(x) - min(x)) / qmax, qmax 255 or
15): |gather - x| <= step / 2 * (1 + 2**-8)      half a step, the scale rounded up to fp16
                     + max|x| * 2**-10 + 2**-23    fp16 rounding of the zero (offset) and scale
                     + eps(spec.dtype) * |x|       the final cast to the KV dtype
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.kv.cache import KVCache
from runtime.kv.format import KV_QUANT, KVSpec, dequantize_kv, quantize_kv

QMAX = {"int8": 255, "int4": 15}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_spec(kv_quant="none", dtype=torch.float32, layers=2, heads=2, head_dim=16, block_size=4):
    return KVSpec(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        block_size=block_size,
        kv_quant=kv_quant,
        dtype=dtype,
    )


def random_kv(t, spec, gen, scale=3.0):
    shape = (t, spec.num_kv_heads, spec.head_dim)
    k = (torch.randn(shape, generator=gen) * scale + 1.0).to(spec.dtype)
    v = (torch.randn(shape, generator=gen) * scale - 0.5).to(spec.dtype)
    return k, v


def quant_tolerance(x: torch.Tensor, kv_quant: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound of the module docstring for x [..., D]; broadcastable to x."""
    x = x.double()
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    step = (hi - lo) / QMAX[kv_quant]
    maxabs = x.abs().amax(-1, keepdim=True)
    return step / 2 * (1 + 2**-8) + maxabs * 2**-10 + 2**-23 + torch.finfo(dtype).eps * x.abs()


def assert_within_quant_tolerance(got, want, kv_quant, dtype):
    err = (got.double() - want.double()).abs()
    tol = quant_tolerance(want, kv_quant, dtype)
    worst = (err - tol).max().item()
    assert worst <= 0, f"quantization error exceeds the bound by {worst}"


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_quant", KV_QUANT)
def test_write_gather_round_trip(kv_quant, dtype):
    gen = torch.Generator().manual_seed(0)
    spec = make_spec(kv_quant, dtype, head_dim=16, block_size=4)
    cache = KVCache(spec, num_blocks=8)
    t = 11
    table = torch.tensor([5, 2, 7])
    k, v = random_kv(t, spec, gen)
    # a constant vector not representable in fp16, one that is, and a zero one
    k[3, 1, :] = 0.37
    v[4, 0, :] = 2.0
    k[5, 0, :] = 0.0
    slots = cache.layer(0).slots_for(table, t)
    for layer in range(spec.num_layers):
        cache.layer(layer).write(k + layer, v - layer, slots)
    for layer in range(spec.num_layers):
        gk, gv = cache.layer(layer).gather(table, t)
        assert gk.shape == gv.shape == (t, spec.num_kv_heads, spec.head_dim)
        assert gk.dtype == gv.dtype == dtype
        wk, wv = k + layer, v - layer
        if kv_quant == "none":
            assert torch.equal(gk, wk) and torch.equal(gv, wv)
        else:
            assert_within_quant_tolerance(gk, wk, kv_quant, dtype)
            assert_within_quant_tolerance(gv, wv, kv_quant, dtype)
            assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
            if layer == 0:
                # an fp16-representable constant comes back exactly
                assert torch.equal(gv[4, 0], v[4, 0]) and torch.equal(gk[5, 0], k[5, 0])
                bound = 0.37 * (2**-10 + torch.finfo(dtype).eps)
                assert (gk[3, 1].double() - k[3, 1].double()).abs().max() <= bound


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
def test_quantization_is_not_trivially_lossless(kv_quant):
    """The error is real and of the expected order, so the bound above is meaningful."""
    gen = torch.Generator().manual_seed(1)
    spec = make_spec(kv_quant, head_dim=64)
    cache = KVCache(spec, num_blocks=4)
    k, v = random_kv(16, spec, gen)
    cache.layer(0).write(k, v, torch.arange(16))
    gk, _ = cache.layer(0).gather(torch.arange(4), 16)
    step = (k.amax(-1) - k.amin(-1)) / QMAX[kv_quant]
    rel = ((gk - k).abs().amax(-1) / step).max().item()
    assert 0.3 < rel <= 0.51


def test_int8_codes_layout():
    spec = make_spec("int8", head_dim=16, heads=1, layers=1, block_size=4)
    cache = KVCache(spec, num_blocks=2)
    x = (torch.arange(16, dtype=torch.float32) * 17 - 100.0).reshape(1, 1, 16)  # min -100, step 1
    cache.layer(0).write(x, x, torch.tensor([6]))
    assert torch.equal(cache.layer(0).k[1, 2, 0], torch.arange(16, dtype=torch.uint8) * 17)
    assert cache.layer(0).k_scale[1, 2, 0].item() == 1.0
    assert cache.layer(0).k_zero[1, 2, 0].item() == -100.0
    assert cache.layer(0).k_scale.dtype == cache.layer(0).k_zero.dtype == torch.float16


def test_int4_packing_low_nibble_is_even_index():
    spec = make_spec("int4", head_dim=16, heads=1, layers=1, block_size=4)
    cache = KVCache(spec, num_blocks=2)
    x = torch.arange(16, dtype=torch.float32).reshape(1, 1, 16)  # codes 0..15, scale 1, zero 0
    cache.layer(0).write(x, x.flip(-1), torch.tensor([1]))
    codes = cache.layer(0).k[0, 1, 0]
    assert codes.shape == (8,) and codes.dtype == torch.uint8
    even, odd = torch.arange(0, 16, 2), torch.arange(1, 16, 2)
    assert torch.equal(codes, (even | (odd << 4)).to(torch.uint8))
    gk, gv = cache.layer(0).gather(torch.tensor([0]), 2)
    assert torch.equal(gk[1], x[0]) and torch.equal(gv[1], x[0].flip(-1))


@settings(max_examples=60, deadline=None)
@given(
    kv_quant=st.sampled_from(["int8", "int4"]),
    center=st.floats(-1000, 1000),
    spread=st.sampled_from([0.0, 1e-6, 1e-3, 1.0, 50.0, 3000.0]),
    seed=st.integers(0, 2**16),
)
def test_quantize_bound_property(kv_quant, center, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    x = center + spread * torch.randn(3, 4, 8, generator=gen)
    codes, scale, zero = quantize_kv(x, kv_quant)
    got = dequantize_kv(codes, scale, zero, kv_quant, torch.float32)
    assert torch.isfinite(got).all()
    assert_within_quant_tolerance(got, x, kv_quant, torch.float32)


# ---------------------------------------------------------------- slots and padding


def snapshot(cache):
    return [t.clone() for kv in cache.layers for t in kv.tensors()]


def flat_tensors(cache, layer):
    kv = cache.layer(layer)
    tensors = [kv.k, kv.v]
    if cache.quantized:
        tensors += [kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero]
    return [t.reshape(cache.num_slots, -1) for t in tensors]


@pytest.mark.parametrize("kv_quant", KV_QUANT)
def test_padding_slots_leave_pool_untouched(kv_quant):
    gen = torch.Generator().manual_seed(2)
    spec = make_spec(kv_quant, torch.float16, block_size=4)
    cache = KVCache(spec, num_blocks=4)
    # fill every slot of layer 0 first, so a stray write would be visible
    k0, v0 = random_kv(cache.num_slots, spec, gen)
    cache.layer(0).write(k0, v0, torch.arange(cache.num_slots))
    before = [t.clone() for t in flat_tensors(cache, 0)]
    other_layer = [t.clone() for t in flat_tensors(cache, 1)]

    k, v = random_kv(6, spec, gen)
    slot_mapping = torch.tensor([5, -1, 9, -1, -1, 2])
    cache.layer(0).write(k, v, slot_mapping)
    after = flat_tensors(cache, 0)
    written = torch.zeros(cache.num_slots, dtype=torch.bool)
    written[torch.tensor([5, 9, 2])] = True
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a[~written], b[~written])
    for b, a in zip(other_layer, flat_tensors(cache, 1), strict=True):
        assert torch.equal(a, b)
    # the real rows landed where they were sent
    gk, gv = cache.layer(0).gather(torch.arange(4), cache.num_slots)
    keep = slot_mapping >= 0
    if kv_quant == "none":
        assert torch.equal(gk[slot_mapping[keep]], k[keep])
        assert torch.equal(gv[slot_mapping[keep]], v[keep])
    else:
        assert_within_quant_tolerance(gk[slot_mapping[keep]], k[keep], kv_quant, spec.dtype)
        assert_within_quant_tolerance(gv[slot_mapping[keep]], v[keep], kv_quant, spec.dtype)


@pytest.mark.parametrize("kv_quant", KV_QUANT)
def test_write_all_padding_is_a_no_op(kv_quant):
    spec = make_spec(kv_quant)
    cache = KVCache(spec, num_blocks=2)
    before = snapshot(cache)
    k = torch.randn(3, spec.num_kv_heads, spec.head_dim)
    cache.layer(1).write(k, k, torch.full((3,), -1))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache), before, strict=True))


@pytest.mark.parametrize("kv_quant", KV_QUANT)
def test_shuffled_noncontiguous_blocks(kv_quant):
    gen = torch.Generator().manual_seed(3)
    spec = make_spec(kv_quant, torch.bfloat16, block_size=4, head_dim=8)
    cache = KVCache(spec, num_blocks=16)
    lengths = [13, 1, 4, 5]
    perm = torch.randperm(16, generator=gen)
    tables, start = [], 0
    for n in lengths:
        nb = -(-n // 4)
        tables.append(perm[start : start + nb])
        start += nb
    data = [random_kv(n, spec, gen) for n in lengths]
    # slots computed here, independently of LayerKV.slots_for
    slots = [
        torch.tensor([int(t[p // 4]) * 4 + p % 4 for p in range(n)])
        for t, n in zip(tables, lengths, strict=True)
    ]
    k = torch.cat([d[0] for d in data])
    v = torch.cat([d[1] for d in data])
    s = torch.cat(slots)
    order = torch.randperm(len(s), generator=gen)  # tokens arrive in any order
    cache.layer(1).write(k[order], v[order], s[order])
    for (wk, wv), table, n in zip(data, tables, lengths, strict=True):
        gk, gv = cache.layer(1).gather(table, n)
        if kv_quant == "none":
            assert torch.equal(gk, wk) and torch.equal(gv, wv)
        else:
            assert_within_quant_tolerance(gk, wk, kv_quant, spec.dtype)
            assert_within_quant_tolerance(gv, wv, kv_quant, spec.dtype)
    # blocks nobody owns are still zero, and layer 0 was never touched
    unused = perm[start:]
    assert (cache.layer(1).k[unused] == 0).all() and (cache.layer(1).v[unused] == 0).all()
    assert all((t == 0).all() for t in flat_tensors(cache, 0))


def test_gather_rejects_short_block_table():
    cache = KVCache(make_spec(block_size=4), num_blocks=4)
    with pytest.raises(ValueError, match="block table"):
        cache.layer(0).gather(torch.tensor([0, 1]), 9)
    k, v = cache.layer(0).gather(torch.tensor([0, 1]), 0)
    assert k.shape == (0, 2, 16)


def test_write_rejects_bad_shapes():
    cache = KVCache(make_spec(), num_blocks=2)
    k = torch.randn(3, 2, 16)
    with pytest.raises(ValueError, match="write expects"):
        cache.layer(0).write(k, k[:, :1], torch.arange(3))
    with pytest.raises(ValueError, match="write expects"):
        cache.layer(0).write(k, k, torch.arange(2))


# ---------------------------------------------------------------- allocation and bytes


@pytest.mark.parametrize("kv_quant", KV_QUANT)
def test_allocation_shapes(kv_quant):
    spec = make_spec(kv_quant, torch.float16, layers=3, heads=2, head_dim=8, block_size=4)
    cache = KVCache(spec, num_blocks=5)
    assert len(cache.layers) == 3
    d = {"none": 8, "int8": 8, "int4": 4}[kv_quant]
    assert cache.layer(0).k.shape == (5, 4, 2, d)
    assert cache.layer(0).k.dtype == (torch.float16 if kv_quant == "none" else torch.uint8)
    if kv_quant == "none":
        kv = cache.layer(2)
        assert kv.k_scale is kv.k_zero is kv.v_scale is kv.v_zero is None
    else:
        kv = cache.layer(2)
        for params in (kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero):
            assert params.shape == (5, 4, 2) and params.dtype == torch.float16
    assert cache.nbytes() == 5 * spec.bytes_per_block()
    assert all((t == 0).all() for t in snapshot(cache))


def test_bytes_per_token_formulas():
    L, H, D, bs = 4, 3, 64, 16
    spec = {
        q: make_spec(q, torch.float16, layers=L, heads=H, head_dim=D, block_size=bs)
        for q in KV_QUANT
    }
    assert spec["none"].bytes_per_token() == 2 * L * H * D * 2
    assert make_spec("none", torch.float32, L, H, D).bytes_per_token() == 2 * L * H * D * 4
    assert make_spec("none", torch.bfloat16, L, H, D).bytes_per_token() == 2 * L * H * D * 2
    assert spec["int8"].bytes_per_token() == 2 * L * H * (D + 2 + 2)
    assert spec["int4"].bytes_per_token() == 2 * L * H * (D // 2 + 2 + 2)
    # quantized sizes do not depend on the unquantized dtype
    assert make_spec("int8", torch.float32, L, H, D).bytes_per_token() == (
        spec["int8"].bytes_per_token()
    )
    assert (
        spec["int4"].bytes_per_token()
        < spec["int8"].bytes_per_token()
        < spec["none"].bytes_per_token()
    )
    for s in spec.values():
        assert s.bytes_per_block() == s.bytes_per_token() * bs


def test_num_blocks_for():
    spec = make_spec("int8", torch.float16, layers=2, heads=2, head_dim=16, block_size=4)
    bpb = spec.bytes_per_block()
    assert bpb == 2 * 2 * 2 * (16 + 4) * 4
    assert KVCache.num_blocks_for(spec, 10 * bpb) == 10
    assert KVCache.num_blocks_for(spec, 10 * bpb + bpb - 1) == 10
    assert KVCache.num_blocks_for(spec, bpb - 1) == 0
    assert KVCache.num_blocks_for(spec, 0) == 0
    n = KVCache.num_blocks_for(spec, 1 << 16)
    assert KVCache(spec, n).nbytes() <= 1 << 16 < KVCache(spec, n + 1).nbytes()


def test_validate_errors():
    with pytest.raises(ValueError, match="none, int8, int4"):
        make_spec("fp8").validate()
    with pytest.raises(ValueError, match="odd"):
        make_spec("int4", head_dim=7).validate()
    make_spec("int8", head_dim=7).validate()  # int8 is fine with odd head_dim
    with pytest.raises(ValueError, match="block_size"):
        make_spec(block_size=0).validate()
    with pytest.raises(ValueError, match="dtype"):
        make_spec(dtype=torch.int8).validate()
    with pytest.raises(ValueError, match="none, int8, int4"):
        KVCache(make_spec("q4"), num_blocks=1)
    with pytest.raises(ValueError, match="none, int8, int4"):
        make_spec("q4").bytes_per_token()
    with pytest.raises(ValueError, match="num_blocks"):
        KVCache(make_spec(), num_blocks=0)
