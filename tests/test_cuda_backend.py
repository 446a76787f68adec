"""The cuda backend without a GPU: its ops and the engine on it, against the references.

On the CPU (under TRITON_INTERPRET=1, as every CPU test run) backend cuda calls the csrc
library's emulated entry points: the W4A16 GEMM, the KV write and the decode attention run their
own block bodies on host memory (csrc/simt.cuh), prefill attention is Triton's kernel
interpreted, and launches are planned as for an H200 (split-K included). So what only a GPU run
could show before is checked here: the arguments, strides, workspaces and slot widths the
backend passes, the fused weights' padding columns, the partition sizes of the decode attention
and the static decode buffers a CUDA graph replays.

The ops one by one (the engine's logits hardly move with attention in a tiny random model):
``int4_linear`` on fused parts whose widths are not whole 64-column units, at decode and
prefill row counts, against the fp64 dequantized reference (the GEMM's tolerances);
``kv_write`` with the eager step's int64 and the graph buffers' int32 slots, bit for bit
against ``LayerKV.write``; decode ``attention`` over a pool, with and without a sliding
window, against the reference attention (csrc/README.md's tolerances).

The engine: against backend triton (interpreted; itself checked against the CPU backend in
test_triton_engine.py): the same greedy tokens, and prompt and sampled-token log-probabilities
within 0.005 nats, for fp16 and int4 KV, over chunked prefill and batched decode. Both run fp16
activations and the same prefill attention, so they differ only by summation order inside the
GEMM and the decode attention: measured at most 0.001 (an fp16 step of a logit near ln(512) is
0.004). head_dim 64, so decode attention is the csrc kernel's. On a GPU host the backend runs
compiled instead: test_cuda_engine_gpu.py::test_cuda_backend_matches_triton.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.kernels.cuda import library
from tests import cuda_lib
from tests.conftest import GPU
from tests.test_gpu import assert_backends_agree

pytestmark = [
    pytest.mark.skipif(cuda_lib.NVCC is None, reason="nvcc not installed"),
    pytest.mark.skipif(
        GPU, reason="on a GPU the cuda backend runs compiled (test_cuda_engine_gpu.py)"
    ),
]

TOL = 0.005  # nats; see the module docstring


class Counting:
    """The library, counting the calls of each entry point."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib, self._name, self.calls = lib, lib._name, Counter()

    def __getattr__(self, name: str):
        entry = getattr(self._lib, name)

        def call(*args):
            self.calls[name] += 1
            return entry(*args)

        return call


@pytest.fixture(scope="module")
def csrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Counting]:
    """The session's build of csrc (cuda_lib), as the library the backend loads."""
    lib = Counting(cuda_lib.load(cuda_lib.build(tmp_path_factory.mktemp("csrc")).path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(library, "library", lambda: lib)
        yield lib


# int8 KV takes the int4 pool's argument path (scales and zeros) with wider codes: its kernels
# are checked one by one below; the engine runs the fp16 pool and the int4 one (CI's time)
@pytest.mark.parametrize("kv_quant", ["none", "int4"])
def test_emulated_cuda_backend_matches_triton(
    csrc: Counting, rtn_artifact_d64: Path, kv_quant: str
) -> None:
    csrc.calls.clear()
    assert_backends_agree(rtn_artifact_d64, kv_quant, ("triton", "cuda"), 5, TOL)
    kernels = ("w4a16_gemm", "rotary_kv_write", "paged_decode_attention", "add_rms_norm")
    kernels += ("silu_mul",)
    assert all(csrc.calls[f"lsq_emulate_{k}"] for k in kernels), csrc.calls  # all of them ran


@pytest.fixture(scope="module")
def backend(csrc: Counting):
    from runtime.kernels.cuda.backend import CudaBackend

    return CudaBackend(torch.device("cpu"), {}, csrc)


@pytest.mark.parametrize("dtype", cuda_lib.GEMM_DTYPES)
def test_int4_linear_on_fused_parts(backend, dtype) -> None:
    """q, k and v of widths 96, 40, 40 (padded to 128, 64, 64 and cut back to 176 columns),
    K = 300 at group 32; 1, 5 and 40 rows, each planned as on an H200."""
    k, gs, widths = 300, 32, (96, 40, 40)
    parts = [(*cuda_lib.gemm_weight(n, k, gs, seed=n + i), n) for i, n in enumerate(widths)]
    fused = backend.prepare_int4(parts, k, gs, dtype)
    gen = torch.Generator().manual_seed(1)
    for m in (1, 5, 40):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = backend.int4_linear(x, fused)
        ref = torch.cat([cuda_lib.gemm_reference(x, qw, qp, n, k, gs) for qw, qp, n in parts], 1)
        assert y.shape == (m, sum(widths)) and y.dtype == dtype
        assert cuda_lib.gemm_rel_err(y, ref) < cuda_lib.GEMM_TOLERANCE[dtype], m
    hits = backend._plan.cache_info().hits
    assert torch.equal(backend.int4_linear(x, fused), y)  # planned once per shape and m
    assert backend._plan.cache_info().hits == hits + 1


def test_int4_linear_dequantized_where_pinned(csrc: Counting) -> None:
    """A pinned {"dequant": 1} runs the weights dequantized and a dense GEMM, on fused parts
    with padding columns; a pin the planner refuses is dropped at load with a warning, not
    raised on every call."""
    from runtime.kernels.cuda.backend import CudaBackend
    from runtime.kernels.gpu import gemm_key

    k, gs, widths = 300, 32, (96, 40, 40)
    parts = [(*cuda_lib.gemm_weight(n, k, gs, seed=n + i), n) for i, n in enumerate(widths)]
    pins = {gemm_key(256, k, 64): {"dequant": 1}, gemm_key(256, k, 8): {"dequant": 2}}
    pinned = CudaBackend(torch.device("cpu"), {"cuda/interpreter": pins}, csrc)
    for dtype in cuda_lib.GEMM_DTYPES:
        fused = pinned.prepare_int4(parts, k, gs, dtype)
        assert fused.pinned == {64: {"dequant": 1}}
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).to(dtype)
        csrc.calls.clear()
        y = pinned.int4_linear(x, fused)
        assert csrc.calls["lsq_emulate_w4a16_dequantize"] == 1, csrc.calls
        assert not csrc.calls["lsq_emulate_w4a16_gemm"], csrc.calls
        ref = torch.cat([cuda_lib.gemm_reference(x, qw, qp, n, k, gs) for qw, qp, n in parts], 1)
        assert y.shape == (40, sum(widths)) and y.dtype == dtype
        assert cuda_lib.gemm_rel_err(y, ref) < cuda_lib.GEMM_TOLERANCE[dtype]


def test_lite_tune_pins_the_cuda_backends_launches(
    csrc: Counting, rtn_artifact_d64: Path, tmp_path: Path
) -> None:
    """`lite tune --backend cuda` (emulated: times mean nothing, the plumbing is what is
    checked) times the planner's ranking, the dequantized path included past the decode rows,
    and pins the winners under cuda/<arch>, which the backend then plans with."""
    import json
    import shutil

    from click.testing import CliRunner

    from lite.cli import main
    from runtime.artifact.reader import Artifact
    from runtime.engine.engine import Engine
    from runtime.kernels.cuda import gemm_plan as gp
    from tests.test_triton_engine import engine_config

    art = tmp_path / "art"
    shutil.copytree(rtn_artifact_d64, art)
    csrc.calls.clear()
    args = ["tune", str(art), "--backend", "cuda", "--buckets", "1,32", "--max-configs", "1"]
    result = CliRunner().invoke(main, [*args, "--dtype", "float16"])
    assert result.exit_code == 0, result.output
    assert csrc.calls["lsq_emulate_w4a16_dequantize"] > 0, csrc.calls  # timed at 32 rows
    kernels = json.loads((art / "manifest.json").read_text())["launch"]["kernels"]
    pinned = kernels["cuda/interpreter"]
    assert len(pinned) == 2 * 4 and all(key.endswith(("/m1", "/m32")) for key in pinned)
    table = gp.configs(csrc)
    for key, entry in pinned.items():
        n, k = (int(v) for v in key.split("/")[1][1:].split("xK"))
        m = int(key.split("/m")[1])
        ranking = gp.ranked(table, m, n, k, 64, 132)
        allowed = [ranking[0], *(p for p in ranking if isinstance(p, gp.DequantPlan))]
        assert entry in [p.to_dict() for p in allowed], (key, entry)
    Artifact(art, checksums=True)  # weights untouched
    engine = Engine(art, engine_config("cuda"))
    qkv = engine.model.layers[0].qkv.weight
    assert qkv.pinned == {b: pinned[f"w4a16/N{qkv.n}xK{qkv.k}/m{b}"] for b in (1, 32)}


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", cuda_lib.WRITE_CASES[1::3], ids=cuda_lib.write_case_id)
def test_kv_write_bit_identical(backend, case: tuple, slot_dtype) -> None:
    from runtime.kv.cache import KVCache

    spec, k, v, slots, num_blocks = cuda_lib.write_inputs(case, seed=case[4])
    ours, theirs = KVCache(spec, num_blocks), KVCache(spec, num_blocks)
    backend.kv_write(ours.layer(0), k, v, slots.to(slot_dtype))
    theirs.layer(0).write(k, v, slots)
    cuda_lib.assert_same_pool(ours, theirs)
    assert ours.layer(0).k.any()  # something was written


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", cuda_lib.WRITE_CASES[::2], ids=cuda_lib.write_case_id)
def test_rotary_kv_write_bit_identical(backend, case: tuple, slot_dtype) -> None:
    cuda_lib.check_rotary_kv_write(backend, case, slot_dtype, torch.device("cpu"))


@pytest.mark.parametrize("case", cuda_lib.POINTWISE_CASES, ids=str)
def test_add_rms_norm(backend, case: tuple) -> None:
    cuda_lib.check_add_rms_norm(backend, case, 7, torch.device("cpu"))


@pytest.mark.parametrize("case", cuda_lib.POINTWISE_CASES, ids=str)
def test_silu_mul(backend, case: tuple) -> None:
    cuda_lib.check_silu_mul(backend, case, 8, torch.device("cpu"))


def test_pointwise_ops_refuse_shapes_that_do_not_fit(backend, csrc: Counting) -> None:
    """The kernels take raw pointers and the pool's own head counts: a tensor of another shape
    would be read or written past its end, so it is refused before any call, with the shapes."""
    from runtime.kv.cache import KVCache

    f16 = torch.float16
    x, w = torch.randn(2, 8).to(f16), torch.ones(8, dtype=f16)
    csrc.calls.clear()
    with pytest.raises(ValueError, match=r"shapes do not match: x \[2, 8\], weight \[8\]"):
        backend.add_rms_norm(x, torch.randn(2, 7).to(f16), w, 1e-5)
    with pytest.raises(ValueError, match="shapes do not match"):
        backend.add_rms_norm(x, None, torch.ones(9, dtype=f16), 1e-5)
    with pytest.raises(ValueError, match="not gate and up halves"):
        backend.act_mul(torch.randn(2, 7).to(f16), "silu")
    spec, qk, v, rope, slots, num_blocks = cuda_lib.rotary_inputs(
        cuda_lib.WRITE_CASES[0], 1, torch.device("cpu")
    )
    layer = KVCache(spec, num_blocks).layer(0)
    with pytest.raises(ValueError, match="do not fit the pool's 2 KV heads of 128"):
        backend.rotary_kv_write(qk, v[:, :1], rope, layer, slots)
    with pytest.raises(ValueError, match="do not fit"):
        backend.rotary_kv_write(qk, v, rope, layer, slots[:-1])
    with pytest.raises(ValueError, match="cos"):
        backend.rotary_kv_write(qk, v, tuple(t[:-1] for t in rope), layer, slots)
    assert not csrc.calls, csrc.calls


def test_unfused_pointwise_ops_are_torchs(csrc: Counting, monkeypatch) -> None:
    """LITESERVE_CUDA_FUSED=0 (the A/B switch of the GPU check) calls none of the three."""
    from runtime.kernels.cuda.backend import CudaBackend

    monkeypatch.setenv("LITESERVE_CUDA_FUSED", "0")
    unfused = CudaBackend(torch.device("cpu"), {}, csrc)
    assert "LITESERVE_CUDA_FUSED=0" in unfused.detail
    csrc.calls.clear()
    cuda_lib.check_add_rms_norm(unfused, cuda_lib.POINTWISE_CASES[0], 7, torch.device("cpu"))
    cuda_lib.check_silu_mul(unfused, cuda_lib.POINTWISE_CASES[0], 8, torch.device("cpu"))
    assert not csrc.calls, csrc.calls


def test_swapped_tiles_can_be_left_out_of_the_plans(csrc: Counting, monkeypatch) -> None:
    """LITESERVE_CUDA_SWAP=0 (the GPU check's A/B switch): the planner never sees them, where
    by default it plans a Llama-3-8B decode GEMM on one."""
    from runtime.kernels.cuda import gemm_plan
    from runtime.kernels.cuda.backend import CudaBackend

    default = CudaBackend(torch.device("cpu"), {}, csrc)
    assert any(c.swap_ab for c in default.configs)
    assert default._plan(1, 6144, 4096, 128, None).tile.swap_ab
    monkeypatch.setenv("LITESERVE_CUDA_SWAP", "0")
    unswapped = CudaBackend(torch.device("cpu"), {}, csrc)
    assert "LITESERVE_CUDA_SWAP=0" in unswapped.detail
    assert unswapped.configs and not any(c.swap_ab for c in unswapped.configs)
    for m in gemm_plan.M_BUCKETS[:5]:
        plan = unswapped._plan(m, 6144, 4096, 128, None)
        assert not plan.tile.swap_ab, plan


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_decode_attention(backend, kv_quant: str, window: int | None, dtype) -> None:
    """Four sequences of 1, 40, 300 and 1200 tokens, 8 heads over 2 KV heads of 64, blocks of
    16: the step metadata as the engine's static decode buffers hold it. The table's width
    makes several partitions, merged in the launch through the backend's workspace and
    counters."""
    lens = [1, 40, 300, 1200]
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, 16, lens, 2, 64, seed=5)
    size = backend.lib.lsq_paged_decode_partition_size(
        len(lens), 8, 2, tables.shape[1], 16, backend.sm_count
    )
    assert -(-tables.shape[1] * 16 // size) > 1, size  # several partitions
    q = torch.randn(len(lens), 8, 64, generator=gen).to(dtype)
    attn = backend.decode_attn(tables, torch.tensor(lens, dtype=torch.int32))
    out = backend.attention(q, cache.layer(0), attn, 0.125, window)
    cuda_lib.assert_close(out, cuda_lib.reference_decode(q, cache, tables, lens, 0.125, window))


def test_tensors_on_another_device_are_refused_before_any_launch(backend, csrc) -> None:
    """The csrc entry points take raw pointers: one into another device's memory faults the GPU
    for good. Each op names the stray tensor first ("meta" stands in for another device)."""
    from runtime.kv.cache import KVCache

    k, gs = 128, 32
    fused = backend.prepare_int4([(*cuda_lib.gemm_weight(64, k, gs, seed=3), 64)], k, gs,
                                 torch.float16)  # fmt: skip
    csrc.calls.clear()
    stray = torch.empty(2, k, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="x is on meta, the weights on cpu"):
        backend.int4_linear(stray, fused)
    spec, kk, v, slots, num_blocks = cuda_lib.write_inputs(cuda_lib.WRITE_CASES[1], seed=1)
    layer = KVCache(spec, num_blocks).layer(0)
    with pytest.raises(ValueError, match="slot_mapping is on meta, the KV cache on cpu"):
        backend.kv_write(layer, kk, v, slots.to("meta"))
    lens = [3, 20]
    cache, tables, gen = cuda_lib.build_pool("int8", torch.float16, 16, lens, 2, 64, seed=5)
    attn = backend.decode_attn(tables.to("meta"), torch.tensor(lens, dtype=torch.int32))
    q = torch.randn(len(lens), 8, 64, generator=gen).to(torch.float16)
    with pytest.raises(ValueError, match="block_tables is on meta, the KV cache on cpu"):
        backend.attention(q, cache.layer(0), attn, 0.125, None)
    assert not csrc.calls, csrc.calls  # nothing launched
