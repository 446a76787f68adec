"""The csrc paged decode attention and KV write on a GPU: ctypes calls with torch CUDA tensors
(``data_ptr()``) on torch's current stream, against the CPU references.

* Attention: ``runtime.kernels.reference.paged_attention`` (fp32, CPU) on random pools written
  by ``LayerKV.write`` into shuffled blocks, with non-finite bytes in every slot past a
  sequence's end: fp16/bf16/int8/int4 KV, GQA 9/3, 32/8, 16/1 (two head chunks) and 12/1,
  sliding windows, block sizes 16 and 64, contexts 1, 17 and 1000, one partition and up to 63
  (``tests/cuda_lib.py``'s ``DECODE_CASES``). Tolerances as in ``test_cuda_attention_build.py``
  (fp16 output: 2e-3 absolute + 2e-3 relative; bf16: 3e-2 + 3e-2), where the same cases run
  through the CPU emulation of the same kernels.
* The same launch captured in a CUDA graph and replayed after the context lengths, block tables
  and queries changed in place: the partition count never depends on context_lens, so no host
  sync and no re-capture are needed.
* KV write: every code, scale and zero bit-identical to ``LayerKV.write`` (CPU), with
  saturating, constant, tiny, sub-ulp and exact-tie rows and padding slots, int64 and int32
  slot mappings.
* The pointwise kernels through the cuda backend's ops: rotary with the KV write bit for bit
  ``apply_rotary`` then ``LayerKV.write`` (CPU), the residual add and RMSNorm against torch's
  add and ``reference.rms_norm``, SiLU-and-mul against torch's (``tests/cuda_lib.py``'s
  checks, which ``test_cuda_backend.py`` runs emulated).

The library is the cuda backend's: built here with nvcc, or carried prebuilt in
``LITESERVE_CACHE`` (`runtime build-kernels`) to a machine without nvcc. Every test is marked
``gpu`` and skips without one.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from runtime.kv.cache import KVCache
from tests import cuda_lib
from tests.cuda_lib import BF16, DECODE_CASES, F16, WRITE_CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return cuda_lib.gpu_library()


@pytest.fixture(scope="module")
def gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def run_case(lib, case: tuple, gpu: torch.device):
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, partition = case
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=dim)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    layer = cuda_lib.on_device(cache, gpu).layer(0)
    scale = dim**-0.5
    out = cuda_lib.decode_attention(
        lib, q.to(gpu), layer, tables.to(gpu), lens.to(gpu), scale, window, partition
    )
    torch.cuda.synchronize()
    return out, q, cache, tables, lens


@pytest.mark.parametrize("case", DECODE_CASES, ids=cuda_lib.case_id)
def test_decode_matches_reference(lib: ctypes.CDLL, gpu: torch.device, case: tuple) -> None:
    out, q, cache, tables, lens = run_case(lib, case, gpu)
    window = case[7]
    ref = cuda_lib.reference_decode(q, cache, tables, lens.tolist(), case[5] ** -0.5, window)
    cuda_lib.assert_close(out, ref)


@pytest.mark.parametrize("case", DECODE_CASES[::3], ids=cuda_lib.case_id)
def test_decode_agrees_with_its_emulation(lib: ctypes.CDLL, gpu: torch.device, case: tuple):
    """The GPU and the CPU emulation of the same block bodies: if the reference comparison
    ever fails only here, the fault is in what the emulator models (PTX semantics), not in the
    kernel's index logic."""
    out, q, cache, tables, lens = run_case(lib, case, gpu)
    emulated = cuda_lib.decode_attention(
        lib, q, cache.layer(0), tables, lens, case[5] ** -0.5, case[7], case[8], emulate=True
    )
    cuda_lib.assert_close(out, emulated)


def test_decode_strided_query(lib: ctypes.CDLL, gpu: torch.device) -> None:
    cache, tables, gen = cuda_lib.build_pool("int4", F16, 16, [40, 3], 2, 64, seed=3)
    qkv = torch.randn(2, 8 + 2 + 2, 64, generator=gen).to(F16).to(gpu)
    q = qkv[:, :8]
    assert not q.is_contiguous()
    lens = torch.tensor([40, 3], dtype=torch.int32)
    layer = cuda_lib.on_device(cache, gpu).layer(0)
    out = cuda_lib.decode_attention(lib, q, layer, tables.to(gpu), lens.to(gpu), 0.2, None, 16)
    ref = cuda_lib.reference_decode(q.cpu(), cache, tables, [40, 3], 0.2, None)
    cuda_lib.assert_close(out, ref)


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
def test_decode_saturated_values(lib: ctypes.CDLL, gpu: torch.device, kv_quant: str) -> None:
    """V at the fp16 limits in a bf16 pool: the fp16 dequantization must clamp."""
    ctx = [40, 20]
    cache, tables, gen = cuda_lib.build_pool(kv_quant, BF16, 16, ctx, 1, 64, seed=2)
    cuda_lib.saturate(cache, tables, 0, [3, 17, 39], seed=3)
    q = torch.randn(2, 4, 64, generator=gen).to(BF16)
    lens = torch.tensor(ctx, dtype=torch.int32)
    layer = cuda_lib.on_device(cache, gpu).layer(0)
    out = cuda_lib.decode_attention(
        lib, q.to(gpu), layer, tables.to(gpu), lens.to(gpu), 0.1, None, 16
    )
    ref = cuda_lib.reference_decode(q, cache, tables, ctx, 0.1, None)
    assert out.isfinite().all()
    cuda_lib.assert_close(out, ref)


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_decode_replays_in_a_cuda_graph(lib: ctypes.CDLL, gpu: torch.device, kv_quant: str):
    """Capture once with static buffers, then change lengths, tables and queries in place:
    each replay matches the reference for the new contents."""
    bs, kv_heads, heads, dim, partition = 16, 2, 8, 128, 64
    steps = [[1, 100, 37], [2, 101, 200], [250, 5, 17]]
    width = -(-max(max(s) for s in steps) // bs) + cuda_lib.SPARE_BLOCKS  # the widest table
    static_q = torch.zeros(3, heads, dim, dtype=F16, device=gpu)
    static_tables = torch.zeros(3, width, dtype=torch.int32, device=gpu)
    static_lens = torch.ones(3, dtype=torch.int32, device=gpu)
    pools = []
    for i, ctx in enumerate(steps):
        cache, tables, gen = cuda_lib.build_pool(kv_quant, F16, bs, ctx, kv_heads, dim, seed=i)
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
        pools.append((cache, tables, torch.randn(3, heads, dim, generator=gen).to(F16)))
    # one device pool large enough for every step's blocks: copy each step's pool into it
    big = KVCache(pools[0][0].spec, max(c.num_blocks for c, _, _ in pools), gpu)
    layer = big.layer(0)
    floats = lib.lsq_paged_decode_workspace_floats(3, heads, dim, width, bs, partition)
    workspace = torch.empty(floats, dtype=torch.float32, device=gpu)
    counters = torch.zeros(3 * kv_heads, dtype=torch.int32, device=gpu)  # one launch
    out = torch.empty_like(static_q)

    def launch() -> None:
        s = layer.spec
        rc = lib.lsq_paged_decode_attention(
            static_q.data_ptr(), static_q.stride(0), static_q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            *(cuda_lib._ptr(t) for t in layer.tensors()[:2]),
            *(cuda_lib._ptr(t) for t in (layer.k_scale, layer.k_zero, layer.v_scale, layer.v_zero)),
            s.storage_kind, 2, static_tables.data_ptr(), width, width, static_lens.data_ptr(),
            3, heads, kv_heads, dim, bs, 0, dim**-0.5, partition, workspace.data_ptr(),
            counters.data_ptr(), counters.numel(), torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip
        assert rc == 0

    launch()  # warm up (module loading) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for (cache, tables, q), ctx in zip(pools, steps, strict=True):
        for name in cuda_lib.POOL:
            src = getattr(cache.layer(0), name)
            if src is not None:
                getattr(layer, name)[: cache.num_blocks].copy_(src)
        static_q.copy_(q)
        static_tables.copy_(tables)
        static_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = cuda_lib.reference_decode(q, cache, tables, ctx, dim**-0.5, None)
        cuda_lib.assert_close(out, ref)
        assert not counters.any()  # each replay leaves them for the next


@pytest.mark.parametrize("case", WRITE_CASES, ids=cuda_lib.write_case_id)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_kv_write_bit_identical(lib: ctypes.CDLL, gpu: torch.device, case: tuple, slot_dtype):
    spec, k, v, slots, num_blocks = cuda_lib.write_inputs(case, seed=case[4])
    ours, theirs = KVCache(spec, num_blocks, gpu), KVCache(spec, num_blocks)
    cuda_lib.kv_write(lib, ours.layer(0), k.to(gpu), v.to(gpu), slots.to(gpu, slot_dtype))
    torch.cuda.synchronize()
    theirs.layer(0).write(k, v, slots)
    cuda_lib.assert_same_pool(ours, theirs)


def test_kv_write_then_decode(lib: ctypes.CDLL, gpu: torch.device) -> None:
    """The decode step's two kernels in order: this step's K/V written into the pool by
    lsq_kv_write, then attention over the pool including them."""
    from runtime.kv.format import KVSpec

    spec = KVSpec(1, 2, 128, 16, "int8", F16)
    gen = torch.Generator().manual_seed(11)
    ctx = [30, 7]
    tables = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    pos = [torch.arange(n) for n in ctx]
    slots = torch.cat([tables[i, p // 16].long() * 16 + p % 16 for i, p in enumerate(pos)])
    k = torch.randn(len(slots), 2, 128, generator=gen).to(F16)
    v = torch.randn(len(slots), 2, 128, generator=gen).to(F16)
    ours, theirs = KVCache(spec, 6, gpu), KVCache(spec, 6)
    cuda_lib.kv_write(lib, ours.layer(0), k.to(gpu), v.to(gpu), slots.to(gpu))
    theirs.layer(0).write(k, v, slots)
    q = torch.randn(2, 8, 128, generator=gen).to(F16)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = cuda_lib.decode_attention(
        lib, q.to(gpu), ours.layer(0), tables.to(gpu), lens.to(gpu), 0.09, None, 16
    )
    torch.cuda.synchronize()
    cuda_lib.assert_close(out, cuda_lib.reference_decode(q, theirs, tables, ctx, 0.09, None))


def test_l2_prefetch_distance_changes_no_result(lib: ctypes.CDLL, gpu: torch.device) -> None:
    """Compiled, the prefetch must not change a bit either (0, the default 2, and far ahead)."""
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, partition = DECODE_CASES[-1]
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=2)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype).to(gpu)
    layer = cuda_lib.on_device(cache, gpu).layer(0)
    lens = torch.tensor(ctx, dtype=torch.int32).to(gpu)
    outs = []
    for tiles in (0, 2, 7):
        with cuda_lib.l2_prefetch(lib, tiles):
            outs.append(
                cuda_lib.decode_attention(
                    lib, q, layer, tables.to(gpu), lens, 0.125, window, partition
                )
            )
    torch.cuda.synchronize()
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.fixture(scope="module")
def backend(lib: ctypes.CDLL, gpu: torch.device):
    from runtime.kernels.cuda.backend import CudaBackend

    return CudaBackend(gpu, {}, lib)


@pytest.mark.parametrize("case", WRITE_CASES, ids=cuda_lib.write_case_id)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_rotary_kv_write_bit_identical(backend, gpu: torch.device, case: tuple, slot_dtype):
    cuda_lib.check_rotary_kv_write(backend, case, slot_dtype, gpu)


@pytest.mark.parametrize("case", cuda_lib.POINTWISE_CASES, ids=str)
def test_add_rms_norm(backend, gpu: torch.device, case: tuple) -> None:
    cuda_lib.check_add_rms_norm(backend, case, 7, gpu)


@pytest.mark.parametrize("case", cuda_lib.POINTWISE_CASES, ids=str)
def test_silu_mul(backend, gpu: torch.device, case: tuple) -> None:
    cuda_lib.check_silu_mul(backend, case, 8, gpu)
