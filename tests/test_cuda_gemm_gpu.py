"""The CUDA W4A16 GEMM (csrc/w4a16_gemm.cu) on a GPU, against the layout's reference.

The library is built for the current GPU only (one nvcc call per module) and called through
ctypes with torch CUDA tensors on torch's current stream, exactly as a backend would. Every tile
config, with and without split-K, is compared to ``x @ dequantize(qweight, qparams).T`` in fp64:

* fp16: relative Frobenius error < 2e-3. The kernel rounds each weight q*s + b to fp16 once
  (fma of the exact code with the stored fp16 s and b: 2^-11 relative) and the output to fp16
  (2^-11), with fp32 accumulation; the emulated kernel (test_cuda_gemm.py) measures ~3e-4.
* bf16: < 1e-2. bf16 keeps 8 significant bits: s and b are rounded to bf16 before the fma
  (b = -z*s is up to 15 s, so its rounding is up to 15 s * 2^-9), the weight and the output once
  each; the emulation measured ~4e-3.

Shapes are the odd ones: K = 576 at group 64 (SmolLM2), N not a multiple of 64, K not a multiple
of the group (zero padding), M = 1, 3, 17, 256. Also: row strides and an unaligned x (the
kernel's scalar path), output padding left untouched, bit-identical split-K reruns, a capture
into a CUDA graph, and the hardware against the CPU emulation of the same block body. Skipped
without a GPU (and without nvcc).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from runtime.kernels.cuda import gemm_plan as gp
from runtime.kernels.cuda import library
from runtime.kernels.ops import select_backend
from tests import cuda_lib
from tests.cuda_lib import (
    GEMM_DTYPES,
    GEMM_TOLERANCE,
    gemm,
    gemm_reference,
    gemm_rel_err,
    gemm_splits_to_try,
    gemm_weight,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (N, K, group size): SmolLM2's o and fused qkv (K = 576 at g64); N not a multiple of 64 and K
# not a multiple of the group; K = 1000 padded to 1024; a Llama-sized square.
SHAPES = [(576, 576, 64), (960, 576, 64), (200, 300, 32), (1000, 1000, 128), (4096, 4096, 128)]
ROWS = [1, 3, 17, 256]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return cuda_lib.gpu_library()


@pytest.fixture(scope="module")
def table(lib: ctypes.CDLL) -> tuple[gp.TileConfig, ...]:
    return gp.configs(lib)


def test_the_library_runs_here_and_the_backend_says_with_what(lib: ctypes.CDLL) -> None:
    """The probe `--backend auto` asks before taking cuda passes on this GPU, and the backend's
    detail line (logs, /health, `runtime check`) names the CUDA runtime and driver."""
    found = library.probe(lib)
    assert found.status == 0, found
    assert library.unrunnable(found, torch.cuda.get_device_capability(), Path(lib._name)) is None
    backend = select_backend("cuda", {})
    assert found.versions() in backend.detail, backend.detail


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize(("n", "k", "gs"), SHAPES)
def test_every_config_and_split_against_the_reference(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], n: int, k: int, gs: int, dtype
) -> None:
    qweight, qparams = gemm_weight(n, k, gs, seed=n + k, device="cuda")
    failures = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda").to(dtype)
        ref = gemm_reference(x, qweight, qparams, n, k, gs)
        for cfg in table:
            for split in gemm_splits_to_try(cfg, k, gs):
                y = gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, split)
                torch.cuda.synchronize()
                err = gemm_rel_err(y, ref)
                if not (torch.isfinite(y).all() and err < GEMM_TOLERANCE[dtype]):
                    failures.append(f"m={m} config={cfg.id} split={split}: rel err {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_planned_launches(lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], dtype) -> None:
    """As the backend plans them (runtime/kernels/cuda/w4a16.py), the dequantized path at 4096
    rows of the Llama-sized matrices included."""
    from runtime.kernels.cuda import w4a16
    from runtime.kernels.gpu import gpu_arch

    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shapes = [(960, 576, 64), (576, 1536, 64), (6144, 4096, 128), (4096, 14336, 128)]
    kinds = set()
    for i, (n, k, gs) in enumerate(shapes):
        qweight, qparams = gemm_weight(n, k, gs, seed=i, device="cuda")
        for m in (1, 16, 100, 512, 4096):
            p = gp.plan(table, m, n, k, gs, sms, arch=gpu_arch(device))
            kinds.add(type(p))
            x = torch.randn(m, k, device="cuda").to(dtype)
            y = w4a16.linear(lib, x, qweight, qparams, n, k, gs, p, emulated=False)
            err = gemm_rel_err(y, gemm_reference(x, qweight, qparams, n, k, gs))
            assert err < GEMM_TOLERANCE[dtype], (n, k, m, p, err)
    if gpu_arch(device) == "sm_90":
        assert kinds == {gp.GemmPlan, gp.DequantPlan}


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_dequantize_is_its_emulation_bit_for_bit(lib: ctypes.CDLL, dtype) -> None:
    """No accumulation in the dequantization: the GPU's bits are the emulation's, which
    test_cuda_gemm.py checks to be the weights the fused GEMM multiplies. And it is captured in
    a CUDA graph (launched on torch's current stream)."""
    from runtime.kernels.cuda.w4a16 import dequantize

    n, k, gs = 197, 300, 32
    qweight, qparams = gemm_weight(n, k, gs, seed=13)
    emulated = dequantize(lib, qweight, qparams, n, k, gs, dtype, emulated=True)
    qweight, qparams = qweight.cuda(), qparams.cuda()
    on_gpu = dequantize(lib, qweight, qparams, n, k, gs, dtype, emulated=False)
    assert torch.equal(on_gpu.cpu().view(torch.int16), emulated.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dequantize(lib, qweight, qparams, n, k, gs, dtype, emulated=False)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, on_gpu)


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_strides_and_padding_left_alone(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], dtype, aligned: bool
) -> None:
    """x and y as row views of wider buffers; unaligned x (odd offset and stride) takes the
    kernel's plain-load path; y's columns past N and rows past M keep their NaNs."""
    n, k, gs, m = 200, 300, 32, 19
    qweight, qparams = gemm_weight(n, k, gs, seed=7, device="cuda")
    if aligned:  # ldx = 320: 16-byte rows, the cp.async path
        x = torch.randn(m, k + 20, device="cuda").to(dtype)[:, :k]
    else:  # 2 bytes past an aligned address, ldx = 303
        flat = torch.randn(m * (k + 3) + 1, device="cuda").to(dtype)
        x = flat[1:].view(m, k + 3)[:, :k]
    assert (x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0) == aligned
    ref = gemm_reference(x, qweight, qparams, n, k, gs)
    for cfg in table:
        for split in gemm_splits_to_try(cfg, k, gs):
            out = torch.full((m + 2, n + 5), float("nan"), dtype=dtype, device="cuda")
            y = out[:m, :n]
            gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, split, y=y)
            assert gemm_rel_err(y, ref) < GEMM_TOLERANCE[dtype], (cfg, split)
            assert out[:m, n:].isnan().all() and out[m:].isnan().all(), (cfg, split)


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_split_k_is_bit_reproducible(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], dtype
) -> None:
    """Split-K's sum in split order, by a second kernel or in the same launch by each tile's
    last block (whichever block that is in a run): the same bits, every time, and the launch
    leaves its counters at 0."""
    n, k, gs = 4096, 4096, 128
    qweight, qparams = gemm_weight(n, k, gs, seed=3, device="cuda")
    x = torch.randn(16, k, device="cuda").to(dtype)
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    for cfg in (c for c in table if c.block_m == 16):
        first = gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, 8)
        for _ in range(3):
            assert torch.equal(gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, 8), first)
        for _ in range(20):
            one = gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, 8, counters=counters)
            assert torch.equal(one, first), cfg
        assert not counters.any(), cfg


def test_captured_in_a_cuda_graph(lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...]) -> None:
    """Launched on torch's current stream, so a graph capture records the GEMM and its split-K
    reduction; replays read the static input's new values."""
    n, k, gs, m = 960, 576, 64, 4
    qweight, qparams = gemm_weight(n, k, gs, seed=5, device="cuda")
    x = torch.randn(m, k, device="cuda").half()
    y = torch.empty(m, n, dtype=torch.float16, device="cuda")
    cfg = table[0]
    counters = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    for one_launch in (None, counters):  # the split summed by a second kernel, or in the launch
        gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, 3, y=y, counters=one_launch)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, 3, y=y, counters=one_launch)
        for _ in range(2):  # the counters are back at 0 for the second replay
            x.copy_(torch.randn(m, k, device="cuda").half())
            graph.replay()
            torch.cuda.synchronize()
            ref = gemm_reference(x, qweight, qparams, n, k, gs)
            assert gemm_rel_err(y, ref) < GEMM_TOLERANCE[torch.float16]
    assert not counters.any()


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_agrees_with_its_emulation(lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], dtype):
    """The GPU and the CPU emulation of the same block body (csrc/simt.cuh). Both accumulate in
    fp32, in a different order inside an mma, so outputs may differ by an ulp of the output
    dtype: a relative error under a quarter of the reference tolerance. If the reference
    comparison ever fails only on the GPU, this says whether the emulator models the PTX wrong."""
    n, k, gs, m = 200, 300, 32, 19
    qweight, qparams = gemm_weight(n, k, gs, seed=11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11)).to(dtype)
    for cfg in table:
        split = gemm_splits_to_try(cfg, k, gs)[-1]
        emulated = gemm(lib, x, qweight, qparams, n, k, gs, cfg.id, split, emulate_landing=0)
        on_gpu = gemm(lib, x.cuda(), qweight.cuda(), qparams.cuda(), n, k, gs, cfg.id, split)
        err = gemm_rel_err(on_gpu.cpu(), emulated.double())
        assert err < GEMM_TOLERANCE[dtype] / 4, (cfg, split, err)
