"""The Triton paged attention kernels against the reference ``paged_attention``.

Both read the same pool, written by ``KVCache.write`` into shuffled, non-contiguous blocks, so
for int8/int4 they see the same dequantized K/V and quantization error is not in the
comparison. The pool is built and the reference computed on the CPU; the kernels read a copy of
the very same bytes on the test device: compiled on a GPU, interpreted (``TRITON_INTERPRET=1``,
set by conftest) on the CPU, so shapes stay small. On a GPU, where each case compiles, the cases
take turns over the partition and window variants (``spread``).

Tolerances (``assert_close``: ``|out - ref| <= atol + rtol * |ref|``); the reference computes
in fp32 from the same K/V and rounds once, the kernels accumulate in fp32 but round the
probabilities to the KV dtype for ``P @ V`` and round the output:

* fp32: atol 1e-5, rtol 1e-5 (IEEE dots; observed < 1e-6);
* fp16: atol 2e-3, rtol 2e-3 (fp16 spacing is 9.8e-4 at 1; observed error <= 5e-4 * (1 + |ref|));
* bf16: atol 3e-2, rtol 3e-2, 4 bf16 ulps at 1 (observed <= 1.7e-2 * (1 + |ref|)): the
  interpreter truncates fp32 -> bf16 casts (dequantized K/V, probabilities, output) where a GPU
  rounds to nearest; the kernel's output equals a truncating torch emulation exactly. On a GPU
  the casts round to nearest and multiply-adds may fuse: errors only shrink.

fp16 and fp32 are the sharp checks: a position wrongly masked in or out moves an output by
about 1 / context (>= 1e-2 here), far above their tolerances.
"""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.counters import arrival_counters
from runtime.kernels.reference import paged_attention
from runtime.kernels.triton import attention
from runtime.kernels.triton.attention import (
    decode_partition_size,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec
from tests.conftest import spread

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
POOL = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
PARTITIONS = ("one-partition", "partitions")
WINDOWS = ("full", "window")
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


def on_device(cache: KVCache, device: torch.device) -> KVCache:
    """A copy of the pool on ``device``: the kernels read the bytes the CPU reference reads."""
    if device.type == "cpu":
        return cache
    copy = KVCache(cache.spec, cache.num_blocks, device)
    for src, dst in zip(cache.layers, copy.layers, strict=True):
        for name in POOL:
            if getattr(src, name) is not None:
                getattr(dst, name).copy_(getattr(src, name))
    return copy


def reference(q, cache, tables, context_lens, query_lens, scale, window):
    rows = list(tables.long())
    return paged_attention(q, cache.layer(1), rows, context_lens, query_lens, scale, window)


def assert_close(out, ref):
    atol, rtol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)


def case_id(case) -> str | None:
    """A case's id; None (pytest's own) for the string-valued variant axes."""
    if not isinstance(case, tuple):
        return None
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
    # 32-token tiles with their nibbles joined (fp32 activations; head_dim 256 on 16-bit ones):
    # the join was wrong in 16 x 32 and 32 x 16 tiles on an H200, right in 64-token ones
    ("int4", F32, 32, 4, 2, 32, [70, 33], 30),
    ("int4", BF16, 32, 4, 2, 256, [70, 1], 40),
]


@pytest.mark.parametrize(
    ("case", "partitions", "windowed"), spread(CASES, PARTITIONS, WINDOWS), ids=case_id
)
def test_decode_matches_reference(case, partitions, windowed, device):
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window = case
    window = window if windowed == "window" else None
    cache, tables, gen = build(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=len(ctx) + bs)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = dim**-0.5
    # one block per partition: several per sequence, and empty ones past each context
    # (every table has SPARE_BLOCKS unused columns) and, with a window, before it
    partition = bs if partitions == "partitions" else None
    layer = on_device(cache, device).layer(1)
    out = paged_decode_attention(
        q.to(device), layer, tables.to(device), lens.to(device), scale, window, partition
    )
    assert_close(out, reference(q, cache, tables, ctx, [1] * len(ctx), scale, window))


@pytest.mark.parametrize("window", [None, 3])
def test_decode_strided_q_int64_metadata_and_odd_partitions(window, device):
    """q as a view of a fused qkv projection, int64 tables and lengths, 48-token partitions
    (3 blocks) that a 64-token tile overhangs, and a window so small that most partitions
    hold no valid token."""
    dtype, dim = F16, 32
    ctx = [97, 50]
    cache, tables, gen = build("int8", dtype, 16, ctx, 2, dim, seed=7)
    qkv = torch.randn(len(ctx), 6 + 2 + 2, dim, generator=gen).to(device, dtype)
    q = qkv[:, :6]
    assert not q.is_contiguous()
    lens = torch.tensor(ctx, device=device)
    layer = on_device(cache, device).layer(1)
    out = paged_decode_attention(q, layer, tables.to(device).long(), lens, 0.3, window, 48)
    assert_close(out, reference(q.cpu(), cache, tables, ctx, [1, 1], 0.3, window))


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
    ("int4", BF16, 32, 4, 2, 256, MIXED, 20),  # head_dim 256: joined tiles of 16 or 32 tokens
]


@pytest.mark.parametrize(("case", "windowed"), spread(PREFILL_CASES, WINDOWS), ids=case_id)
def test_prefill_matches_reference(case, windowed, device):
    kv_quant, dtype, bs, heads, kv_heads, dim, seqs, window = case
    window = window if windowed == "window" else None
    ctx = [c for c, _ in seqs]
    qlens = [n for _, n in seqs]
    cache, tables, gen = build(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=len(seqs) + bs)
    q = torch.randn(sum(qlens), heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = dim**-0.5
    meta = [t.to(device) for t in (q, tables, cu, lens)]
    out = paged_prefill_attention(
        meta[0], on_device(cache, device).layer(1), *meta[1:], scale, window
    )
    assert_close(out, reference(q, cache, tables, ctx, qlens, scale, window))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(
    "case",
    [
        ("int8", BF16, 16, 8, 2, 32, MIXED, 20),
        ("int4", F16, 16, 4, 2, 136, MIXED, 20),
        ("none", BF16, 32, 6, 3, 136, MIXED, 20),
    ],
    ids=case_id,
)
def test_prefill_tiles_of_each_architecture(case, arch, device, monkeypatch):
    """The tiles chosen for sm_8x and for sm_90 (``prefill_tiles``: 32, 64 or 128 query rows;
    16, 32 or 64 KV tokens, within or past 128-wide heads) give the same attention."""
    monkeypatch.setattr(attention, "target_arch", lambda: arch)
    kv_quant, dtype, bs, heads, kv_heads, dim, seqs, window = case
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    cache, tables, gen = build(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=arch + dim)
    q = torch.randn(sum(qlens), heads, dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    meta = [t.to(device) for t in (q, tables, cu, lens)]
    out = paged_prefill_attention(
        meta[0], on_device(cache, device).layer(1), *meta[1:], 0.2, window
    )
    assert_close(out, reference(q, cache, tables, ctx, qlens, 0.2, window))


@pytest.mark.parametrize("seq_block", [4, 32])
def test_prefill_scans_for_each_tiles_sequence(seq_block, device, monkeypatch):
    """A query tile finds its sequence scanning ``BLOCK_S`` sequences at a time (so one kernel
    serves any number of them): 11 sequences, among them empty and one-token chunks, scanned 4
    at a time (three scans, the last one partial) and 32 at a time."""
    monkeypatch.setattr(attention, "_SEQ_BLOCK", seq_block)
    seqs = [(5, 5), (17, 1), (40, 20), (3, 0), (1, 1), (33, 16), (20, 3), (64, 1), (9, 9)]
    seqs += [(2, 2), (50, 17)]
    ctx, qlens = [c for c, _ in seqs], [n for _, n in seqs]
    cache, tables, gen = build("none", F32, 16, ctx, 2, 16, seed=seq_block)
    q = torch.randn(sum(qlens), 4, 16, generator=gen)
    cu = torch.tensor([0, *qlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    meta = [t.to(device) for t in (q, tables, cu, lens)]
    out = paged_prefill_attention(meta[0], on_device(cache, device).layer(1), *meta[1:], 0.25)
    assert_close(out, reference(q, cache, tables, ctx, qlens, 0.25, None))


def test_prefill_tiles_shrink_before_sm_90():
    opts = {"BLOCK_D": 128}
    assert prefill_tiles(opts, BF16, 90) == (128, 64, 8)
    assert prefill_tiles(opts, BF16, 80) == (64, 32, 8)
    assert prefill_tiles({"BLOCK_D": 256, "QUANT": 0}, F16, 89) == (64, 16, 8)
    assert prefill_tiles({"BLOCK_D": 256, "QUANT": 1}, F16, 86) == (32, 32, 8)
    assert prefill_tiles(opts, F32, 90) == (64, 32, 4)


def test_prefill_decode_rows_agree_with_decode_kernel(device):
    """All-decode batch through both kernels (different tilings, same math)."""
    ctx = [33, 1, 64]
    cache, tables, gen = build("int4", F32, 16, ctx, 2, 16, seed=3)
    layer = on_device(cache, device).layer(1)
    q = torch.randn(len(ctx), 4, 16, generator=gen).to(device)
    tables = tables.to(device)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(q, layer, tables, cu, lens, 0.25, 10)
    decode = paged_decode_attention(q, layer, tables, lens, 0.25, 10, partition_size=16)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_decode_partition_size():
    assert decode_partition_size(16) == 512  # whatever the table's width (one constexpr)
    assert decode_partition_size(48) == 528  # rounded up to whole blocks
    assert decode_partition_size(1024) == 1024


@pytest.fixture(scope="module")
def small():
    """A CPU pool of two sequences, with their q, tables and lengths."""
    cache, tables, gen = build("none", F16, 16, [20, 5], 2, 16, seed=0)
    q = torch.randn(2, 4, 16, generator=gen).to(F16)
    return cache, tables, q, torch.tensor([20, 5], dtype=torch.int32)


def placed(small, where: str, device: torch.device):
    """``small`` on the test device, or on the CPU for the checks that read metadata values:
    the kernels check those only on CPU metadata (on a GPU a check would sync per layer)."""
    dev = torch.device("cpu") if where == "cpu" else device
    cache, tables, q, lens = small
    return on_device(cache, dev), tables.to(dev), q.to(dev), lens.to(dev)


@pytest.mark.parametrize(
    ("change", "match", "where"),
    [
        ({"layer": 2}, "layer 2 out of range", "device"),  # KVCache.layer refuses it
        ({"q": lambda q: q.float()}, "must match", "device"),
        ({"q": lambda q: q[..., :8]}, "head_dim=16", "device"),
        ({"q": lambda q: q[:, :3]}, "multiple of 2 KV heads", "device"),
        ({"tables": lambda t: t[:1]}, "block_tables", "device"),
        ({"tables": lambda t: t.float()}, "block_tables must be int32 or int64", "device"),
        ({"lens": lambda n: n[:1]}, "context_lens", "device"),
        ({"lens": lambda n: n.to("meta")}, "context_lens is on meta, the KV cache on", "device"),
        ({"window": 0}, "sliding_window must be >= 1", "device"),
        ({"partition": 24}, "multiple of block size 16", "device"),
        ({"tables": lambda t: t + 100}, "ids outside", "cpu"),
        ({"lens": lambda n: n * 10}, "must be in \\[1, 64\\]", "cpu"),
        ({"lens": lambda n: n * 0}, "must be in \\[1, 64\\]", "cpu"),
    ],
)
def test_decode_rejects_bad_inputs(small, change, match, where, device):
    cache, tables, q, lens = placed(small, where, device)
    args = {"layer": 1, "q": q, "tables": tables, "lens": lens, "window": None, "partition": 16}
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(
            args["q"], cache.layer(args["layer"]), args["tables"], args["lens"], 0.25,
            args["window"], args["partition"],
        )  # fmt: skip


@pytest.mark.parametrize(
    ("cu", "match", "where"),
    [
        ([0, 3], "must be \\[S \\+ 1\\]|block_tables", "device"),  # one sequence, two tables
        ([[0, 3, 6]], "must be \\[S \\+ 1\\]", "device"),
        ([0.0, 3.0, 6.0], "int32 or int64", "device"),
        ([0, 3, 5], "from 0 to the 6 query tokens", "cpu"),
        ([0, 0, 6], "exceed context_lens", "cpu"),  # 6 new tokens in a 5-token context
        ([1, 3, 6], "from 0", "cpu"),
    ],
)
def test_prefill_rejects_bad_inputs(small, cu, match, where, device):
    cache, tables, q, lens = placed(small, where, device)
    q = torch.cat([q, q, q])  # 6 query tokens
    cu = torch.tensor(cu, device=q.device)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(q, cache.layer(1), tables, cu, lens, 0.25)


def test_prefill_rejects_metadata_on_another_device(small, device):
    cache, tables, q, lens = placed(small, "device", device)
    cu = torch.tensor([0, 1, 2], device="meta")
    with pytest.raises(ValueError, match="cu_query_lens is on meta, the KV cache on"):
        paged_prefill_attention(q, cache.layer(1), tables, cu, lens, 0.25)


@pytest.mark.gpu
def test_gpu_one_launch_merge_replays_in_a_cuda_graph(device):
    """The last partition to finish merges in the decode launch, counting in on counters that
    it sets back to 0: captured in a CUDA graph (as the engine's decode steps are) and replayed
    on new queries and longer contexts, the output equals an eager launch's, bit for bit, and
    the device's counters are 0 after every replay."""
    ctx = [700, 33, 1200]
    cache, tables, gen = build("int8", BF16, 16, ctx, 2, 64, seed=21)
    layer = on_device(cache, device).layer(1)
    tables = tables.to(device)
    q = torch.randn(len(ctx), 8, 64, generator=gen).to(device, BF16)
    lens = torch.tensor(ctx, dtype=torch.int32, device=device)
    paged_decode_attention(q, layer, tables, lens, 0.125)  # compiled outside the capture
    stream = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = paged_decode_attention(q, layer, tables, lens, 0.125)
    counters = arrival_counters(device)
    for step in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(device, BF16))
        lens.add_(step)
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(out, paged_decode_attention(q, layer, tables, lens, 0.125)), step
        assert not counters.any(), step
