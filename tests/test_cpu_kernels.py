"""The CPU backend's kernels against the torch reference (random inputs, stated tolerances)."""

from __future__ import annotations

import pytest
import torch

from lite.quantizer import QuantSpec, quantize
from runtime.artifact import layout
from runtime.kernels import cpu, native, reference
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec


def _packed(n: int, k: int, gs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    qw = quantize(w, QuantSpec(group_size=gs))
    return layout.pack_qweight(qw.q, gs), layout.pack_qparams(qw.scale, qw.zero, gs, k), n


@pytest.mark.parametrize("path", cpu.INT4_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# torch's GEMMs pad 17, 45 and 67 rows to a bucket; the C kernel tiles 4 rows and 2 columns
@pytest.mark.parametrize("rows", [1, 3, 17, 45, 64, 67])
@pytest.mark.parametrize(
    ("ns", "k", "gs"), [((70,), 100, 32), ((96, 32, 32), 160, 64), ((200,), 576, 128)]
)
def test_int4_linear_matches_reference_dequantize(path, dtype, rows, ns, k, gs) -> None:
    """Every path on fused parts, N not a multiple of 16, K not a multiple of the group.
    Tolerance: exact math in fp32 (1e-5 relative); bf16 and fp16 activations and scales round
    at 2^-8 and 2^-11 (2e-2); the int8 path rounds each group of activations to 1/254 of its
    largest magnitude, about 0.6% relative error on Gaussian inputs (bound 1.5e-2)."""
    parts = [_packed(n, k, gs, seed=i) for i, n in enumerate(ns)]
    lib = native.library() if path in cpu.INT8_PATHS else None
    w = cpu.prepare_int4(parts, k, gs, dtype, lib=lib, paths={path})
    assert path in cpu.int4_paths(w)
    assert (w.packed is not None) == (path == "torch-int4")
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9))
    ref = x @ torch.cat([layout.dequantize(q, p, n, k, gs) for q, p, n in parts]).T
    got = cpu.int4_linear(x.to(dtype), w, path, lib=lib)
    assert got.shape == ref.shape and got.dtype == dtype
    rel = float((got.float() - ref).norm() / ref.norm())
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel < (1.5e-2 if path in cpu.INT8_PATHS else bound), rel


@pytest.mark.skipif(not native.load()[0], reason="the C kernels do not build on this machine")
@pytest.mark.parametrize("op", ["linear", "int8-unpacked", "logits"])
def test_int8_paths_keep_nan_and_tiny_activations(op: str) -> None:
    """Activations quantized per group of 32 to int8: a NaN (skipped by the group's max) was
    converted to int32, undefined in C: finite garbage of -4.9e6 in that row, different per
    ISA, where float math gives NaN; a group whose largest value is near FLT_MIN overflowed
    127 / amax to inf, the same garbage. Now: that row NaN, tiny groups about 0 (below 1e-30),
    the other rows as the reference (1.5e-2 relative, the int8 path's bound)."""
    lib = native.library()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 160, generator=g)
    x[1, 37] = float("nan")
    x[2] *= 1e-39  # subnormal: below FLT_MIN
    if op == "logits":
        weight = torch.randn(70, 160, generator=g)
        got = cpu.logits(x, cpu.prepare_head(weight), "int8", lib=lib)
    else:
        parts = [_packed(70, 160, 32, seed=4)]
        w = cpu.prepare_int4(parts, 160, 32, torch.float32, lib=lib, paths={op})
        got = cpu.int4_linear(x, w, "int8" if op == "linear" else op, lib=lib)
        weight = layout.dequantize(*parts[0][:2], 70, 160, 32)
    ref = x @ weight.T
    assert got[1].isnan().all(), got[1]
    assert got[2].abs().max() < 1e-30, got[2]
    for r in (0, 3):
        assert float((got[r] - ref[r]).norm() / ref[r].norm()) < 1.5e-2


def test_row_buckets_are_few_and_tight() -> None:
    """torch's GEMMs meet at most 4 row counts an octave (each costs it megabytes of kernels
    for good), never more than 25% padding, and every count up to 8 as it is."""
    buckets = [cpu.bucket_rows(m) for m in range(1, 4097)]
    assert all(b >= m and b <= 1.25 * m for m, b in zip(range(1, 4097), buckets, strict=True))
    assert buckets[:8] == list(range(1, 9))
    assert buckets == sorted(buckets)
    assert len(set(buckets)) == 8 + 4 * 9  # 9..16, ..., 2049..4096: four each


@pytest.mark.parametrize("path", ["torch", "c"])
@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("window", [None, 20])
def test_batched_decode_attention_matches_reference(
    path: str, kv_quant: str, window: int | None
) -> None:
    """A step mixing decodes and a prefill chunk over shuffled blocks; the CPU path batches
    the decodes (in torch ops, or in the C kernel). Tolerance 1e-5 (both fp32 over the same
    dequantized K/V)."""
    g = torch.Generator().manual_seed(1)
    spec = KVSpec(
        num_layers=1,
        num_kv_heads=2,
        head_dim=16,
        block_size=16,
        kv_quant=kv_quant,
        dtype=torch.float32,
    )
    cache = KVCache(spec, num_blocks=40)
    perm = torch.randperm(40, generator=g)
    lens, qlens = [1, 17, 50, 33, 16], [1, 1, 12, 1, 1]
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // 16)
        tables.append(perm[used : used + blocks])
        used += blocks
        slots = cache.layer(0).slots_for(tables[-1], n)
        kv = torch.randn(2, n, 2, 16, generator=g)
        cache.layer(0).write(kv[0], kv[1], slots)
    q = torch.randn(sum(qlens), 6, 16, generator=g)
    decode = cpu.decode_batch(tables, lens, qlens, 16)
    assert decode.rows.tolist() == [0, 1, 14, 15]
    attn = cpu.CpuAttention(tables, lens, qlens, decode)
    lib = native.library() if path == "c" else None
    got = cpu.paged_attention(q, cache.layer(0), attn, 0.25, window, lib=lib)
    want = reference.paged_attention(q, cache.layer(0), tables, lens, qlens, 0.25, window)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("window", [None, 7, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_in_c_matches_reference(kv_quant, window, dtype) -> None:
    """The C kernel's blocks of prefill tokens: whole prompts and chunks over a cached prefix,
    shorter than a block, one block, several and a partial last one, over shuffled pool blocks
    with GQA. Tolerance: 1e-5 in fp32 (the same dequantized K/V, sums in another order); bf16
    queries and outputs round at 2^-8 (3e-2 absolute on unit-scale outputs)."""
    g = torch.Generator().manual_seed(3)
    spec = KVSpec(
        num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, kv_quant=kv_quant,
        dtype=torch.float32,
    )  # fmt: skip
    cache = KVCache(spec, num_blocks=64)
    perm = torch.randperm(64, generator=g)
    lens, qlens = [5, 40, 70, 33, 90], [5, 40, 17, 16, 45]
    tables, used = [], 0
    for n in lens:
        blocks = -(-n // 16)
        tables.append(perm[used : used + blocks])
        used += blocks
        kv = torch.randn(2, n, 2, 32, generator=g)
        cache.layer(0).write(kv[0], kv[1], cache.layer(0).slots_for(tables[-1], n))
    q = torch.randn(sum(qlens), 6, 32, generator=g).to(dtype)
    attn = cpu.CpuAttention(tables, lens, qlens, cpu.decode_batch(tables, lens, qlens, 16))
    got = cpu.paged_attention(q, cache.layer(0), attn, 0.2, window, lib=native.library())
    want = reference.paged_attention(q, cache.layer(0), tables, lens, qlens, 0.2, window)
    assert got.dtype == dtype
    err = float((got.float() - want.float()).abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), err


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("window", [None, 7, 20])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_prefill_rows_get_the_decode_kernels_bits(kv_quant, window, head_dim) -> None:
    """Each prefilled token's attention is bit for bit what decoding it would give: a preempted
    request recomputes its KV through prefill, and a prefix-cache hit leaves one token to
    decode, so any difference changed greedy output (int8 activations grow ulps into other
    tokens over a long output)."""
    g = torch.Generator().manual_seed(5)
    spec = KVSpec(
        num_layers=1, num_kv_heads=2, head_dim=head_dim, block_size=16, kv_quant=kv_quant,
        dtype=torch.float32,
    )  # fmt: skip
    cache = KVCache(spec, num_blocks=16)
    table = torch.randperm(16, generator=g)[:6]
    length, n = 90, 37
    kv = torch.randn(2, length, 2, head_dim, generator=g)
    cache.layer(0).write(kv[0], kv[1], cache.layer(0).slots_for(table, length))
    q = torch.randn(n, 6, head_dim, generator=g)
    lib = native.library()
    chunk = cpu.CpuAttention([table], [length], [n], cpu.decode_batch([table], [length], [n], 16))
    got = cpu.paged_attention(q, cache.layer(0), chunk, 0.2, window, lib=lib)
    for i in range(n):
        at = length - n + i + 1
        one = cpu.CpuAttention([table], [at], [1], cpu.decode_batch([table], [at], [1], 16))
        want = cpu.paged_attention(q[i : i + 1], cache.layer(0), one, 0.2, window, lib=lib)
        assert torch.equal(got[i : i + 1], want), (i, float((got[i] - want[0]).abs().max()))
