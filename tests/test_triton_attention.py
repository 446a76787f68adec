"""The Triton paged attention kernels against the reference ``paged_attention``.

Both read the same pool, written by ``KVCache.write`` into shuffled, non-contiguous blocks, so
for int8/int4 they see the same dequantized K/V and quantization error is not in the
comparison. Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so
shapes stay small.

Tolerances (``assert_close``: ``|out - ref| <= atol + rtol * |ref|``); the reference computes
in fp32 from the same K/V and rounds once, the kernels accumulate in fp32 but round the
probabilities to the KV dtype for ``P @ V`` and round the output:

* fp32: atol 1e-5, rtol 1e-5 (IEEE dots; observed < 1e-6);
* fp16: atol 2e-3, rtol 2e-3 (fp16 spacing is 9.8e-4 at 1; observed error <= 5e-4 * (1 + |ref|));
* bf16: atol 3e-2, rtol 3e-2, 4 bf16 ulps at 1 (observed <= 1.7e-2 * (1 + |ref|)): the
  interpreter truncates fp32 -> bf16 casts (dequantized K/V, probabilities, output) where a GPU
  rounds to nearest; the kernel's output equals a truncating torch emulation exactly.

fp16 and fp32 are the sharp checks: a position wrongly masked in or out moves an output by
about 1 / context (>= 1e-2 here), far above their tolerances.
"""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.reference import paged_attention
from runtime.kernels.triton.attention import (
    decode_partition_size,
    paged_decode_attention,
    paged_prefill_attention,
)
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (3e-2, 3e-2)}
SPARE_BLOCKS = 2  # table columns past the longest sequence: padding, and empty partitions


def build(kv_quant, dtype, block_size, context_lens, num_kv_heads, head_dim, seed):
    """A pool holding every sequence's K/V in shuffled blocks, and int32 block tables padded
    with 0 (itself a valid block id, as the engine pads)."""
    gen = torch.Generator().manual_seed(seed)
    spec = KVSpec(2, num_kv_heads, head_dim, block_size, kv_quant, dtype)
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    cache = KVCache(spec, num_blocks)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(context_lens), max(needed) + SPARE_BLOCKS, dtype=torch.int32)
    slots, start = [], 0
    for i, (n, nb) in enumerate(zip(context_lens, needed, strict=True)):
        tables[i, :nb] = perm[start : start + nb]
        start += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    slot_mapping = torch.cat(slots)
    slot_mapping = slot_mapping[torch.randperm(len(slot_mapping), generator=gen)]
    k = 2 * torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen) + 0.3
    v = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen) - 0.2
    cache.layer(1).write(k.to(dtype), v.to(dtype), slot_mapping)  # layer 0 stays zeros
    return cache, tables, gen


def reference(q, cache, tables, context_lens, query_lens, scale, window):
    rows = list(tables.long())
    return paged_attention(q, cache.layer(1), rows, context_lens, query_lens, scale, window)


def assert_close(out, ref):
    atol, rtol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def case_id(case) -> str:
    kv_quant, dtype, bs, heads, kv_heads, dim = case[:6]
    return f"{kv_quant}-{str(dtype)[6:]}-bs{bs}-g{heads // kv_heads}-d{dim}"


# kv_quant, dtype, block_size, heads, kv heads, head_dim, context_lens, sliding window
CASES = [
    ("none", F16, 16, 6, 2, 16, [1, 17, 70], 20),
    ("none", BF16, 32, 4, 4, 32, [33, 1, 70], 40),
    ("none", F32, 16, 8, 2, 32, [70, 17], 5),
    ("int8", F16, 32, 9, 3, 32, [1, 17, 70], 40),
    ("int8", BF16, 16, 16, 2, 16, [17, 70, 2], 1),  # window 1: only the token itself
    ("int8", F32, 64, 4, 1, 16, [130, 65], 33),
    ("int4", F16, 16, 8, 2, 32, [70, 1, 40], 17),
    ("int4", BF16, 32, 9, 3, 16, [1, 17, 70], 20),
    ("int4", F16, 128, 6, 2, 24, [150, 3], 70),  # head_dim 24: padded to a 32-wide tile
]


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("partitioned", [False, True], ids=["one-partition", "partitions"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_decode_matches_reference(case, partitioned, windowed):
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window = case
    window = window if windowed else None
    cache, tables, gen = build(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=len(ctx) + bs)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5
    # one block per partition: several per sequence, and empty ones past each context
    # (every table has SPARE_BLOCKS unused columns) and, with a window, before it
    partition = bs if partitioned else None
    out = paged_decode_attention(
        q, cache.layer(1), tables, torch.tensor(ctx, dtype=torch.int32), scale, window, partition
    )
    assert_close(out, reference(q, cache, tables, ctx, [1] * len(ctx), scale, window))


@pytest.mark.parametrize("window", [None, 3])
def test_decode_strided_q_int64_metadata_and_odd_partitions(window):
    """q as a view of a fused qkv projection, int64 tables and lengths, 48-token partitions
    (3 blocks) that a 64-token tile overhangs, and a window so small that most partitions
    hold no valid token."""
    dtype, dim = F16, 32
    ctx = [97, 50]
    cache, tables, gen = build("int8", dtype, 16, ctx, 2, dim, seed=7)
    qkv = torch.randn(len(ctx), 6 + 2 + 2, dim, generator=gen).to(dtype)
    q = qkv[:, :6]
    assert not q.is_contiguous()
    lens = torch.tensor(ctx)
    out = paged_decode_attention(q, cache.layer(1), tables.long(), lens, 0.3, window, 48)
    assert_close(out, reference(q, cache, tables, ctx, [1, 1], 0.3, window))


# sequences: (context_len, query_len): chunked prefill over a longer cached prefix, a full
# prefill, a decode row, and (in some cases) a sequence with no new token this step
MIXED = [(70, 30), (45, 45), (17, 1)]
PREFILL_CASES = [
    ("none", F16, 16, 6, 2, 32, MIXED, 25),
    ("none", BF16, 32, 4, 1, 16, MIXED + [(5, 0)], 16),
    ("none", F32, 16, 9, 3, 16, MIXED, 7),
    ("int8", F16, 32, 8, 2, 16, [(5, 0)] + MIXED, 33),
    ("int8", BF16, 16, 9, 3, 32, MIXED, 1),
    ("int8", F32, 16, 16, 2, 16, MIXED, 30),
    ("int4", F16, 16, 4, 4, 16, MIXED, 20),
    ("int4", BF16, 32, 6, 2, 16, MIXED, 64),
    ("int4", F16, 64, 8, 1, 24, [(150, 150), (17, 1)], 40),  # several query tiles per sequence
]


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[case_id(c) for c in PREFILL_CASES])
def test_prefill_matches_reference(case, windowed):
    kv_quant, dtype, bs, heads, kv_heads, dim, seqs, window = case
    window = window if windowed else None
    ctx = [c for c, _ in seqs]
    qlens = [n for _, n in seqs]
    cache, tables, gen = build(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=len(seqs) + bs)
    q = torch.randn(sum(qlens), heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = dim**-0.5
    out = paged_prefill_attention(
        q, cache.layer(1), tables, cu, torch.tensor(ctx, dtype=torch.int32), scale, window
    )
    assert_close(out, reference(q, cache, tables, ctx, qlens, scale, window))


def test_prefill_decode_rows_agree_with_decode_kernel():
    """All-decode batch through both kernels (different tilings, same math)."""
    ctx = [33, 1, 64]
    cache, tables, gen = build("int4", F32, 16, ctx, 2, 16, seed=3)
    q = torch.randn(len(ctx), 4, 16, generator=gen)
    lens = torch.tensor(ctx, dtype=torch.int32)
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32)
    prefill = paged_prefill_attention(q, cache.layer(1), tables, cu, lens, 0.25, 10)
    decode = paged_decode_attention(q, cache.layer(1), tables, lens, 0.25, 10, partition_size=16)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_decode_partition_size():
    assert decode_partition_size(16, 48) == 48  # short context: one partition
    assert decode_partition_size(16, 4096) == 512
    assert decode_partition_size(48, 4096) == 528  # rounded up to whole blocks
    assert decode_partition_size(1024, 4096) == 1024


@pytest.fixture(scope="module")
def small():
    cache, tables, gen = build("none", F16, 16, [20, 5], 2, 16, seed=0)
    q = torch.randn(2, 4, 16, generator=gen).to(F16)
    return cache, tables, q, torch.tensor([20, 5], dtype=torch.int32)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer": 2}, "layer 2 out of range"),  # KVCache.layer refuses it
        ({"q": lambda q: q.float()}, "must match"),
        ({"q": lambda q: q[..., :8]}, "head_dim=16"),
        ({"q": lambda q: q[:, :3]}, "multiple of 2 KV heads"),
        ({"tables": lambda t: t[:1]}, "block_tables"),
        ({"tables": lambda t: t.float()}, "block_tables must be int32 or int64"),
        ({"tables": lambda t: t + 100}, "ids outside"),
        ({"lens": lambda n: n[:1]}, "context_lens"),
        ({"lens": lambda n: n * 10}, "must be in \\[1, 64\\]"),
        ({"lens": lambda n: n * 0}, "must be in \\[1, 64\\]"),
        ({"window": 0}, "sliding_window must be >= 1"),
        ({"partition": 24}, "multiple of block size 16"),
    ],
)
def test_decode_rejects_bad_inputs(small, change, match):
    cache, tables, q, lens = small
    args = {"layer": 1, "q": q, "tables": tables, "lens": lens, "window": None, "partition": 16}
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(
            args["q"], cache.layer(args["layer"]), args["tables"], args["lens"], 0.25,
            args["window"], args["partition"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        ([0, 3], "must be \\[S \\+ 1\\]|block_tables"),  # one sequence for two tables
        ([0, 3, 5], "from 0 to the 6 query tokens"),
        ([0, 0, 6], "exceed context_lens"),  # 6 new tokens in a 5-token context
        ([1, 3, 6], "from 0"),
        ([[0, 3, 6]], "must be \\[S \\+ 1\\]"),
    ],
)
def test_prefill_rejects_bad_inputs(small, cu, match):
    cache, tables, q, lens = small
    q = torch.cat([q, q, q])  # 6 query tokens
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, cache.layer(1), tables, torch.tensor(cu), lens, 0.25)


def test_prefill_rejects_float_cu_query_lens(small):
    cache, tables, q, lens = small
    with pytest.raises(ValueError, match="int32 or int64"):
        paged_prefill_attention(
            q, cache.layer(1), tables, torch.tensor([0.0, 1.0, 2.0]), lens, 0.25
        )
