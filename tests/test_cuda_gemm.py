"""The CUDA W4A16 GEMM (csrc/w4a16_gemm.cu) as far as a CPU can check it, and its launch planning
(runtime/kernels/cuda/gemm_plan.py).

One nvcc build per module (sm_80, sm_86, sm_89, sm_90, ``-lineinfo -O3 -Xptxas -v``): ptxas
reports no stack, spills or local memory for any kernel; the sm_80 SASS really runs the tensor
cores (HMMA), ldmatrix (LDSM) and cp.async (LDGSTS) and converts no int4 code with I2F; the
library loads with ctypes on a machine without a GPU (static cudart), where its config table and
argument checks answer. Planning is checked against SmolLM2-135M, Llama-3-8B and Qwen2.5-7B
shapes on a 132-SM GPU. The GPU's own checks are in test_cuda_gemm_gpu.py.

The kernel itself runs here too: ``lsq_emulate_w4a16_gemm`` executes the very block body the GPU
runs, thread by thread, under csrc/simt.cuh's emulation of the PTX it uses (mma fragments,
ldmatrix, cp.async groups, the fp16/bf16 bit tricks). Every tile config and dtype, split-K,
every group size against both k-step depths, several row tiles, ragged K and N, strides and the
plain-load path are compared with the fp64 reference at the GPU test's tolerances. Each case
runs twice, with cp.async copies landing at their wait (a stage read too early sees stale bytes;
shared memory starts as NaNs) and at issue (a copy into a stage still being read overwrites it):
a correct pipeline gives the same bits both ways. The emulated cp.async also refuses to read
outside the tensors it was given.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest
import torch

from runtime.kernels.cuda import gemm_plan as gp
from runtime.kernels.cuda import library
from tests import cuda_lib
from tests.conftest import GPU

ARCHS = cuda_lib.ARCHS
SMS = 132  # an H200
CONFIGS, DECODE_CONFIGS = 14, 9  # the decode tiles (block_m <= 16) are compiled per group size
TILE_KERNELS = 2 * (DECODE_CONFIGS * len(gp.GROUP_SIZES) + CONFIGS - DECODE_CONFIGS)  # x 2 dtypes
KERNELS = TILE_KERNELS + 4  # and the split-K reduction and the dequantization, x 2 dtypes
INVALID = 1  # cudaErrorInvalidValue
FP16, BF16 = 2, 1  # STORAGE_KINDS

pytestmark = pytest.mark.skipif(cuda_lib.NVCC is None, reason="nvcc not installed")


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> cuda_lib.Build:
    done = cuda_lib.build(tmp_path_factory.mktemp("csrc"))
    print(f"nvcc, {len(ARCHS)} architectures: {done.seconds:.1f} s from its start")
    return done


@pytest.fixture(scope="module")
def lib(build: cuda_lib.Build) -> ctypes.CDLL:
    return cuda_lib.load(build.path)


@pytest.fixture(scope="module")
def table(lib: ctypes.CDLL) -> tuple[gp.TileConfig, ...]:
    return gp.configs(lib)


@pytest.fixture(scope="module")
def cuobjdump() -> str:
    path = cuda_lib.find_cuobjdump()
    if path is None:
        pytest.skip("cuobjdump not found (PATH, nvcc's directory, CUDA_HOME, triton)")
    return path


def test_compiles_for_every_architecture(build: cuda_lib.Build, cuobjdump: str) -> None:
    elves = subprocess.run(
        [cuobjdump, "--list-elf", str(build.path)], capture_output=True, text=True, check=True
    ).stdout
    for arch in ARCHS:
        assert f"sm_{arch}" in elves, elves


def test_no_spills_no_stack_no_local_memory(build: cuda_lib.Build) -> None:
    entries = re.findall(r"Compiling entry function '(\w+)' for '(sm_\d+)'", build.log)
    assert len([e for e in entries if _is_gemm(e[0])]) == KERNELS * len(ARCHS), entries
    usage = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", build.log
    )
    assert len(usage) == len(entries), build.log[-4000:]
    bad = [(e, u) for e, u in zip(entries, usage, strict=True) if u != ("0", "0", "0")]
    assert not bad, f"stack or spills (stack, stores, loads): {bad}"


def test_resource_usage_has_no_local_memory(build: cuda_lib.Build, cuobjdump: str) -> None:
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", str(build.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = re.findall(r"Function (\w+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    assert len([r for r in rows if _is_gemm(r[0])]) == KERNELS * len(ARCHS), text[-3000:]
    for name, regs, stack, local in rows:
        assert (stack, local) == ("0", "0"), name
        assert int(regs) <= 255, name


def _is_gemm(mangled: str) -> bool:
    """The GEMM's kernels among the library's (the build holds all of csrc)."""
    return any(k in mangled for k in ("w4a16_gemm_kernel", "reduce_splits", "dequantize_words"))


def _sass_by_function(cuobjdump: str, lib_path: Path, arch: str) -> dict[str, str]:
    text = subprocess.run(
        [cuobjdump, "--dump-sass", "--gpu-architecture", f"sm_{arch}", str(lib_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    parts = re.split(r"\n\s*Function : (\w+)\n", text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("arch", ["80", "90"])
def test_sass_runs_tensor_cores_ldmatrix_cp_async(
    build: cuda_lib.Build, cuobjdump: str, arch: str
) -> None:
    sass = _sass_by_function(cuobjdump, build.path, arch)
    gemms = {name: code for name, code in sass.items() if "w4a16_gemm_kernel" in name}
    assert len(gemms) == TILE_KERNELS, sorted(sass)
    for name, code in gemms.items():
        assert "HMMA.16816.F32" in code, name  # mma.sync.m16n8k16, fp32 accumulators
        swapped = re.search(r"Li(\d)EEELi\d+ELb\d", name).group(1) == "1"  # Tile's SWAP
        # ldmatrix for x: x4 as the A operand, x2 as the swapped tiles' B (8 rows of x)
        assert ("LDSM.16.M88.2" if swapped else "LDSM.16.M88.4") in code, name
        assert "LDGSTS.E.BYPASS.128" in code, name  # cp.async.cg, 16 bytes
        assert "LOP3.LUT" in code, name  # the nibble masks
        # int4 codes become fp16/bf16 by magic numbers: no int-to-float conversion at all
        assert "I2F" not in code, name
        assert "LDL" not in code and "STL" not in code, name  # no local memory
    dequant = {name: code for name, code in sass.items() if "dequantize_words" in name}
    assert len(dequant) == 2, sorted(sass)
    for name, code in dequant.items():  # the same bit tricks, and paired stores
        assert "LOP3.LUT" in code and "I2F" not in code and "STG.E " in code, name


def test_config_table(table: tuple[gp.TileConfig, ...], lib: ctypes.CDLL) -> None:
    assert len(table) == lib.lsq_w4a16_num_configs() == CONFIGS
    for c in table:
        # swapped tiles: 8 or 16 rows of x by one warp along m, k-steps of whole groups
        rows = 8 * c.warps_m if c.swap_ab else 16 * c.warps_m
        assert c.block_m % rows == 0 and c.block_n % 64 == 0, c
        assert c.block_k in (64, 128) and c.warps in (4, 8) and c.stages >= 2, c
        assert c.warps % (c.warps_m * c.warps_k) == 0, c
        assert not c.swap_ab or (c.block_m <= 16 and c.warps_m == 1 and c.block_k == 128), c
        assert c.smem_bytes <= 99 * 1024, c  # sm_86/sm_89's per-block limit
    assert len([c for c in table if c.block_m <= 16]) == DECODE_CONFIGS  # decode tiles
    assert any(c.warps_k > 1 for c in table)  # warps splitting the k-step
    assert any(c.block_m >= 128 for c in table)  # prefill tiles
    assert {c.block_m for c in table if c.swap_ab} == {8, 16}  # up to 8 rows, and 16
    out = [ctypes.c_int32(-7) for _ in range(8)]
    for bad in (-1, len(table), 1 << 20):
        assert lib.lsq_w4a16_config(bad, *(ctypes.byref(v) for v in out)) == -1
        assert all(v.value == -7 for v in out)


# Fake device pointers: the entry point checks every argument before any CUDA call, so these are
# never dereferenced; a valid call with m = 0 launches nothing and returns 0.
X, QW, QP, Y, WS, CT = 0x10000, 0x20000, 0x30000, 0x40000, 0x50000, 0x60000


def _call(lib: ctypes.CDLL, **over: int) -> int:
    args = dict(
        x=X, ldx=576, qweight=QW, qparams=QP, y=Y, ldy=576, workspace=WS, counters=CT,
        counters_len=64, m=0, n=576, k=576, group_size=64, dtype=FP16, config=0, split_k=1,
        stream=0,
    )  # fmt: skip
    args.update(over)
    return lib.lsq_w4a16_gemm(*args.values())


def _call_dequant(lib: ctypes.CDLL, **over: int) -> int:
    args = dict(qweight=QW, qparams=QP, w=Y, ldw=576, n=576, k=576, group_size=64, dtype=FP16)
    args.update(over)
    return lib.lsq_w4a16_dequantize(*args.values(), 0)


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": 0},
        {"group_size": 48},
        {"n": 0},
        {"k": 0},
        {"ldw": 575},
        {"qweight": 0},
        {"qparams": 0},
        {"w": 0},
        {"qweight": QW + 4},
        {"qparams": QP + 8},
    ],
)
def test_dequantize_refuses_bad_arguments(lib: ctypes.CDLL, bad: dict) -> None:
    assert _call_dequant(lib, **bad) == INVALID
    args = dict(qweight=QW, qparams=QP, w=Y, ldw=576, n=576, k=576, group_size=64, dtype=FP16)
    assert lib.lsq_emulate_w4a16_dequantize(*{**args, **bad}.values()) == INVALID


def test_valid_arguments_with_no_rows_launch_nothing(lib: ctypes.CDLL) -> None:
    assert _call(lib) == 0
    assert _call(lib, dtype=BF16, group_size=128, config=1, split_k=5) == 0
    assert _call(lib, x=X + 2, ldx=577, ldy=579) == 0  # unaligned x, y: the scalar paths


@pytest.mark.parametrize(
    "bad",
    [
        {"config": -1},
        {"config": 99},
        {"group_size": 16},
        {"group_size": 96},
        {"dtype": 0},
        {"dtype": 3},
        {"split_k": 0},
        {"split_k": 6},  # 5 k-steps of 128 in K=576
        {"k": 1024, "ldx": 1024, "split_k": 7},  # 8 steps in slices of 2: the 7th is empty
        {"k": 0},
        {"n": 0},
        {"m": -1},
        {"ldx": 575},
        {"ldy": 575},
        {"x": 0},
        {"qweight": 0},
        {"qparams": 0},
        {"y": 0},
        {"workspace": 0, "split_k": 2},
        {"qweight": QW + 4},  # not 16-byte aligned
        {"qparams": QP + 8},
        {"workspace": WS + 4, "split_k": 2},
        {"counters": CT + 2, "split_k": 2},  # not 4-byte aligned
        {"counters_len": -1},
        {"m": 70000 * 16},  # more m tiles than a grid's y dimension
    ],
)
def test_bad_arguments_are_refused_before_any_cuda_call(lib: ctypes.CDLL, bad: dict) -> None:
    assert _call(lib, **{"m": 1, **bad}) == INVALID


# (N, K, group size) per linear; fused q/k/v and gate/up as the backends fuse them.
SHAPES = {
    "smollm2-135m": {
        "qkv": (576 + 192 + 192, 576, 64),
        "o": (576, 576, 64),
        "gate_up": (2 * 1536, 576, 64),
        "down": (576, 1536, 64),
    },
    "llama-3-8b": {
        "qkv": (4096 + 1024 + 1024, 4096, 128),
        "o": (4096, 4096, 128),
        "gate_up": (2 * 14336, 4096, 128),
        "down": (4096, 14336, 128),
    },
    "qwen2.5-7b": {
        "qkv": (3584 + 512 + 512, 3584, 128),
        "o": (3584, 3584, 128),
        "gate_up": (2 * 18944, 3584, 128),
        "down": (3584, 18944, 128),
    },
}
CASES = [(model, name, *shape) for model, d in SHAPES.items() for name, shape in d.items()]


@pytest.mark.parametrize("m", [1, 16, 256, 4096])
@pytest.mark.parametrize(("model", "linear", "n", "k", "gs"), CASES)
def test_plan(
    table: tuple[gp.TileConfig, ...],
    lib: ctypes.CDLL,
    model: str,
    linear: str,
    n: int,
    k: int,
    gs: int,
    m: int,
) -> None:
    p = gp.plan(table, m, n, k, gs, SMS)
    # prefill on sm_90 may run dequantized; at 4096 rows the Llama/Qwen-sized matrices do
    if isinstance(p, gp.DequantPlan):
        assert m > gp.DECODE_ROWS and p == gp.DequantPlan(m, n, k), p
        return
    assert not (m == 4096 and n * k >= 4096 * 4096), f"{p}: the dequantized path is faster"
    c = p.tile
    assert table[p.config] is c
    assert p.grid == (gp.cdiv(n, c.block_n), gp.cdiv(m, c.block_m), p.split_k)
    # every split is a whole, non-empty run of k-steps, at least one group long
    assert p.k_steps == gp.cdiv(k, c.block_k)
    assert p.steps_per_split == gp.cdiv(p.k_steps, p.split_k)
    assert (p.split_k - 1) * p.steps_per_split < p.k_steps
    assert p.split_k == 1 or p.steps_per_split * c.block_k >= gs
    np_ = gp.cdiv(n, 64) * 64
    assert p.workspace_bytes == (0 if p.split_k == 1 else p.split_k * m * np_ * 4)
    # the C entry point accepts exactly this launch
    assert (
        _call(lib, ldx=k, ldy=n, n=n, k=k, group_size=gs, config=p.config, split_k=p.split_k) == 0
    )
    # decode rows run the decode tiles (8 or 16 rows); prefill tiles do not split a large M
    assert (c.block_m <= 16) == (m <= 16)
    if m == 4096:
        assert p.split_k == 1 and c.block_m >= 64
    fill = p.blocks / SMS
    weight_bytes = np_ * k // 2
    if weight_bytes >= 8 << 20:  # one Llama/Qwen matrix: split-K (or N) fills the H200
        # (past 16 rows a 128-row tile on 96 of 132 SMs can beat twice as many 64-row tiles
        # that convert each weight twice as often per row)
        assert fill >= (0.95 if m <= 16 else 0.7), p
        if m <= 16 and p.split_k > 1:
            assert fill <= 4, p  # not split past a few blocks per SM
    else:  # SmolLM2: sub-MB weights, latency-bound; a split only where its launch pays off
        assert p.split_k <= p.k_steps
        if m == 4096:
            assert fill >= 0.9, p


def test_ranked_plans(table: tuple[gp.TileConfig, ...]) -> None:
    """The plan is the ranking's first; the dequantized path competes only past the decode
    rows, and wins only where cuBLAS outruns mma.sync (sm_90) and M is prefill-sized."""
    n, k, gs = SHAPES["llama-3-8b"]["down"]
    for m in (1, 16, 17, 256, 4096):
        plans = gp.ranked(table, m, n, k, gs, SMS)
        assert plans[0] == gp.plan(table, m, n, k, gs, SMS)
        assert len(set(plans)) == len(plans)
        assert (gp.DequantPlan(m, n, k) in plans) == (m > gp.DECODE_ROWS)
        fused = [p for p in plans[1:] if isinstance(p, gp.GemmPlan)]
        times = [gp.estimate_seconds(p.tile, m, n, k, gs, p.split_k, SMS) for p in fused]
        assert times == sorted(times)
    assert isinstance(gp.plan(table, 4096, n, k, gs, SMS), gp.DequantPlan)
    assert isinstance(gp.plan(table, 256, n, k, gs, SMS), gp.GemmPlan)
    for m in (17, 4096):  # on sm_80 cuBLAS runs mma.sync too: the fused kernel keeps every M
        assert isinstance(gp.plan(table, m, n, k, gs, 108, arch="sm_80"), gp.GemmPlan)


def test_plan_splits_a_decode_matrix_until_it_fills_the_gpu(
    table: tuple[gp.TileConfig, ...],
) -> None:
    for n, k, gs in SHAPES["llama-3-8b"].values():
        p = gp.plan(table, 1, n, k, gs, SMS)
        no_split = gp.make_plan(p.tile, 1, n, k, 1)
        assert p.split_k > 1 or no_split.blocks >= SMS, p
        assert p.blocks >= SMS


def test_plan_follows_the_sm_count(table: tuple[gp.TileConfig, ...]) -> None:
    n, k, gs = SHAPES["llama-3-8b"]["o"]
    small = gp.plan(table, 1, n, k, gs, 16)
    large = gp.plan(table, 1, n, k, gs, SMS)
    assert small.blocks < large.blocks
    assert small.split_k <= large.split_k


def test_pinned_plans(table: tuple[gp.TileConfig, ...]) -> None:
    n, k, gs = SHAPES["llama-3-8b"]["qkv"]
    cfg = table[-1]
    entry = {**cfg.shape(), "split_k": 2}
    pinned = {gp.gemm_key(n, k, 256): entry}
    p = gp.plan(table, 200, n, k, gs, SMS, pinned=pinned)  # 200 rows: bucket 256
    assert p.tile is cfg and p.config == cfg.id and p.split_k == 2 and p.to_dict() == entry
    assert p.workspace_floats * 4 == p.workspace_bytes == 2 * 200 * 6144 * 4
    by_bucket = gp.plan(table, 200, n, k, gs, SMS, pinned={256: entry})  # a weight's own pins
    assert by_bucket == p
    assert gp.plan(table, 300, n, k, gs, SMS, pinned=pinned) == gp.plan(
        table, 300, n, k, gs, SMS
    )  # bucket 512 is not pinned
    key = gp.gemm_key(n, k, 256)
    with pytest.raises(ValueError, match="no tile config"):
        gp.plan(table, 200, n, k, gs, SMS, pinned={key: {**entry, "warps": 3}})
    with pytest.raises(ValueError, match="split_k"):
        gp.plan(table, 200, n, k, gs, SMS, pinned={key: {**entry, "split_k": 999}})
    with pytest.raises(ValueError, match="keys"):
        gp.plan(table, 200, n, k, gs, SMS, pinned={key: {"config": 1}})
    old = {f: v for f, v in table[1].shape().items() if f != "swap_ab"}  # pinned before it
    assert gp.plan(table, 1, n, k, gs, SMS, pinned={1: {**old, "split_k": 3}}).tile is table[1]
    dequant = gp.plan(table, 200, n, k, gs, SMS, pinned={256: {"dequant": 1}})
    assert dequant == gp.DequantPlan(200, n, k) and dequant.to_dict() == {"dequant": 1}
    assert dequant.scratch_bytes == 2 * n * k and dequant.workspace_floats == 0
    with pytest.raises(ValueError, match="dequant: 1"):
        gp.plan(table, 200, n, k, gs, SMS, pinned={256: {"dequant": 0}})


def test_plan_refuses_bad_shapes(table: tuple[gp.TileConfig, ...]) -> None:
    for args in ((0, 64, 64, 64), (1, 0, 64, 64), (1, 64, 0, 64), (1, 64, 64, 48)):
        with pytest.raises(ValueError):
            gp.plan(table, *args, SMS)
    with pytest.raises(ValueError, match="sm_count"):
        gp.plan(table, 1, 64, 64, 64, 0)


def test_keys_and_buckets_match_the_gpu_backends() -> None:
    gpu = pytest.importorskip("runtime.kernels.gpu")
    triton_gemm = pytest.importorskip("runtime.kernels.triton.gemm")
    assert gp.M_BUCKETS == triton_gemm.M_BUCKETS
    assert gp.gemm_key(960, 576, 16) == gpu.gemm_key(960, 576, 16)
    # lite tune pins the dequantized path in the same form for both backends
    assert gp.DequantPlan(1, 64, 64).to_dict() == triton_gemm.DequantConfig().to_dict()
    for m in (1, 3, 16, 17, 300, 5000):
        assert gp.m_bucket(m) == triton_gemm.m_bucket(m)


def test_a_valid_call_reaches_cuda(lib: ctypes.CDLL) -> None:
    """Past the checks the entry point calls CUDA; without a GPU (or driver) that fails with a
    CUDA error code, not a crash. (On a GPU host these fake pointers must not be launched.)"""
    if GPU:  # conftest's: the host's, even where a module hides it
        pytest.skip("a GPU is present: the fake pointers would be launched")
    for config, split in ((0, 1), (1, 5)):  # below and above 48 KiB of shared memory
        rc = _call(lib, m=1, config=config, split_k=split)
        assert rc not in (0, INVALID), rc


def test_the_library_says_whether_its_kernels_load_here(lib: ctypes.CDLL, build) -> None:
    """What `--backend auto` asks before it takes cuda (a library that loads is not enough: a
    GPU older than sm_80 or a driver older than the linked CUDA runtime fails every launch).
    Without a GPU or driver the answer names why; launch errors are named the same way."""
    found = library.probe(lib)
    assert found.runtime >= 12000, found  # the CUDA runtime nvcc linked in
    if GPU:
        capability = torch.cuda.get_device_capability()
        assert found.status == 0 and library.unrunnable(found, capability, build.path) is None
    else:
        assert found.status != 0 and found.name.startswith("cudaError"), found
        why = library.unrunnable(found, (9, 0), build.path)
        assert why is not None and found.name in why
    named = r"lsq_w4a16_gemm: CUDA error 35 \(cudaErrorInsufficientDriver\) at launch"
    with pytest.raises(RuntimeError, match=named):
        library.check(lib, 35, "lsq_w4a16_gemm")
    with pytest.raises(ValueError, match="lsq_silu_mul: arguments refused"):
        library.check(lib, INVALID, "lsq_silu_mul")
    library.check(lib, 0, "lsq_silu_mul")


# ---------------------------------------------------------------------------------------------
# The kernel run by the SIMT emulator on the CPU.


def _emulated(lib, x, qweight, qparams, n, k, gs, config, split, y=None) -> torch.Tensor:
    """The emulated GEMM with copies landing late and early: the same bits, or a pipeline bug;
    with a split, also summed in the same launch (split counters): the same bits again, and the
    counters left at 0."""
    late = cuda_lib.gemm(lib, x, qweight, qparams, n, k, gs, config, split, y, emulate_landing=0)
    late = late.clone()
    early = cuda_lib.gemm(lib, x, qweight, qparams, n, k, gs, config, split, y, emulate_landing=1)
    assert torch.equal(late, early), f"config {config} split {split}: landing changes the result"
    if split > 1:
        early = early.clone()
        counters = torch.zeros(64 * 1024, dtype=torch.int32)
        one = cuda_lib.gemm(
            lib, x, qweight, qparams, n, k, gs, config, split, y, emulate_landing=1,
            counters=counters,
        )  # fmt: skip
        assert torch.equal(one, early), f"config {config} split {split}: one launch differs"
        assert not counters.any(), "the last block of each tile leaves its counter 0"
    return early


def _check(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = cuda_lib.gemm_rel_err(y, ref)
    assert torch.isfinite(y).all() and err < cuda_lib.GEMM_TOLERANCE[y.dtype], f"{what}: {err:.2e}"


@pytest.mark.parametrize("dtype", cuda_lib.GEMM_DTYPES)
@pytest.mark.parametrize("config", range(CONFIGS))
def test_emulated_every_config(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], config: int, dtype
) -> None:
    """N = 200 (a partial 64-column unit, a partial tile), K = 300 at group 32 (a ragged last
    k-step and K padding); one row, and two row tiles (BM + 3 rows); no split, and splits."""
    n, k, gs = 200, 300, 32
    cfg = table[config]
    qweight, qparams = cuda_lib.gemm_weight(n, k, gs, seed=config)
    gen = torch.Generator().manual_seed(config)
    for m in (1, cfg.block_m + 3):
        x = torch.randn(m, k, generator=gen).to(dtype)
        ref = cuda_lib.gemm_reference(x, qweight, qparams, n, k, gs)
        for split in cuda_lib.gemm_splits_to_try(cfg, k, gs):
            y = _emulated(lib, x, qweight, qparams, n, k, gs, config, split)
            _check(y, ref, f"m={m} split={split}")


@pytest.mark.parametrize(("n", "k", "gs"), [(960, 576, 64), (136, 1000, 128), (64, 384, 32)])
def test_emulated_group_sizes(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], n: int, k: int, gs: int
) -> None:
    """Each group size against both k-step depths: BK = 128 (several groups a step at gs 32 and
    64) and BK = 64 (a group across two steps at gs 128), and against the tiles whose warps
    split a k-step (a warp's run of slices inside one group, or across several) and those that
    swap the operands (each group's scale applied after its run of slices). SmolLM2's fused qkv
    is the first."""
    qweight, qparams = cuda_lib.gemm_weight(n, k, gs, seed=gs)
    gen = torch.Generator().manual_seed(gs)
    for dtype in cuda_lib.GEMM_DTYPES:
        x = torch.randn(5, k, generator=gen).to(dtype)
        ref = cuda_lib.gemm_reference(x, qweight, qparams, n, k, gs)
        assert (table[0].block_k, table[3].block_k) == (128, 64)  # both k-step depths
        for cfg in (table[0], table[3], *(c for c in table if c.warps_k > 1 or c.swap_ab)):
            split = cuda_lib.gemm_splits_to_try(cfg, k, gs)[-1]
            y = _emulated(lib, x, qweight, qparams, n, k, gs, cfg.id, split)
            _check(y, ref, f"{dtype} config {cfg.id} split {split}")


@pytest.mark.parametrize("aligned", [True, False])
def test_emulated_strides_and_padding_left_alone(
    lib: ctypes.CDLL, table: tuple[gp.TileConfig, ...], aligned: bool
) -> None:
    """x and y as row views of wider buffers; an unaligned x (odd offset and stride) takes the
    plain-load path, an odd y stride the scalar stores; an odd N ends on half a column pair;
    y's columns past N and rows past M keep their NaNs."""
    n, k, gs, m = 197, 300, 32, 19
    qweight, qparams = cuda_lib.gemm_weight(n, k, gs, seed=7)
    gen = torch.Generator().manual_seed(7)
    for dtype in cuda_lib.GEMM_DTYPES:
        if aligned:  # ldx = 320: 16-byte rows, the cp.async path
            x = torch.randn(m, k + 20, generator=gen).to(dtype)[:, :k]
        else:  # 2 bytes past an aligned address, ldx = 303
            x = torch.randn(m * (k + 3) + 1, generator=gen).to(dtype)[1:].view(m, k + 3)[:, :k]
        assert (x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0) == aligned
        ref = cuda_lib.gemm_reference(x, qweight, qparams, n, k, gs)
        swapped = [c.id for c in table if c.swap_ab][:2]  # their scalar stores of y, and splits
        for config, split in ((0, 1), (4, 2), (swapped[0], 1), (swapped[1], 2)):
            out = torch.full((m + 2, n + (5 if aligned else 4)), float("nan"), dtype=dtype)
            y = out[:m, :n]
            _emulated(lib, x, qweight, qparams, n, k, gs, config, split, y=y)
            _check(y, ref, f"{dtype} config {config} split {split}")
            assert out[:m, n:].isnan().all() and out[m:].isnan().all(), (config, split)


@pytest.mark.parametrize(("n", "k", "gs"), [(200, 96, 32), (136, 128, 64), (72, 256, 128)])
def test_emulated_dequantize_gives_the_gemms_weights(
    lib: ctypes.CDLL, n: int, k: int, gs: int
) -> None:
    """The dequantized path multiplies the very weights the fused GEMM does: the GEMM of the
    identity (one product per output, exact in fp32) is W_hat^T, and lsq_w4a16_dequantize must
    give the same bits. Odd N, K not a multiple of the group, a row stride past K (left
    untouched), every group size; both also agree with the layout's reference within one
    rounding of s and b."""
    from runtime.kernels.cuda.w4a16 import dequantize

    for dtype in cuda_lib.GEMM_DTYPES:
        for n_, k_ in ((n, k), (n - 3, k - 5)):
            qweight, qparams = cuda_lib.gemm_weight(n_, k_, gs, seed=n_ + k_)
            w = dequantize(lib, qweight, qparams, n_, k_, gs, dtype, emulated=True)
            eye = torch.eye(k_, dtype=dtype)
            wt = _emulated(lib, eye, qweight, qparams, n_, k_, gs, 6, 1)
            assert torch.equal(wt.T.contiguous().view(torch.int16), w.view(torch.int16))
            ref = cuda_lib.gemm_reference(eye, qweight, qparams, n_, k_, gs).T
            _check(w, ref, f"{dtype} {n_}x{k_}")
            wide = torch.full((n_, k_ + 7), float("nan"), dtype=dtype)
            args = (qweight.data_ptr(), qparams.data_ptr(), wide.data_ptr(), k_ + 7, n_, k_, gs)
            assert lib.lsq_emulate_w4a16_dequantize(*args, cuda_lib.STORAGE_KINDS[dtype]) == 0
            assert torch.equal(wide[:, :k_].view(torch.int16), w.view(torch.int16))
            assert wide[:, k_:].isnan().all()
