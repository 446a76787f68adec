"""The csrc paged decode attention and KV write without a GPU: compile, resources, argument
checks, and the kernels' own block bodies run on the CPU.

* **Build**: ``csrc/paged_attention.cu``, ``csrc/kv_write.cu`` and the pointwise kernels
  (``rms_norm.cu``, ``silu_mul.cu``) compile, with the GEMM, into one shared library (static
  cudart) for sm_80, sm_86, sm_89 and sm_90 with ``-O3 -lineinfo``, once per test session (24
  kernels of these x 4 architectures, plus the host side). ``ptxas -v
  must show every kernel for every architecture with no stack frame, no spill stores or loads
  and no local memory, the decode kernels within the registers of 3 blocks per SM, and the
  SASS must hold the tensor-core instructions and 16-byte loads the design relies on.
* **Host side**: the library loads with ctypes on a machine without a GPU (static cudart: no
  libcudart needed) and every bad argument is refused with cudaErrorInvalidValue (1) before
  any CUDA call; the workspace size and the partition-size helper follow their formulas.
* **Emulated kernels**: ``lsq_emulate_*`` run the very same ``__host__ __device__`` block bodies
  on the CPU (``csrc/simt.cuh``: one fiber per thread, warp shuffles, ``mma.sync`` and
  ``movmatrix`` emulated from the fragment layouts of the PTX ISA, fp16 arithmetic rounded as
  the instructions round). So the fragment and permutation logic, the masking, the partition
  and merge logic and the quantizer's rounding are checked here, against the torch reference;
  the GPU tests (``test_cuda_attention_gpu.py``) repeat them on real hardware.

Tolerances of the attention outputs (``|out - ref| <= atol + rtol * |ref|``): the reference
computes in fp32 from the pool's K/V dequantized and rounded to the KV dtype and rounds once at
the end. The kernel multiplies K's integer codes exactly (q.k = s (q.c) + z sum(q): K is not
rounded at all), rounds V once to fp16 (c * s + z in one fma) or reads it as stored, rounds the
probabilities to the mma dtype (2^-11 relative for fp16, 2^-9 for bf16), accumulates in fp32
(tensor cores) and rounds the output once:

* fp16 output: atol 2e-3, rtol 2e-3, about two fp16 ulps at |out| ~ 1 (ulp 9.8e-4): the output
  rounding plus the probability rounding. Observed in emulation: at most 9.8e-4, one ulp (0.42
  of the bound at worst);
* bf16 output: atol 3e-2, rtol 3e-2, four bf16 ulps at 1: bf16 probabilities and output.
  Observed: at most 1.6e-2 (0.22 of the bound).

Both are the tolerances of the Triton kernel's tests; the GPU's tensor-core sums and ``ex2``
approximation differ from the emulation's by far less than the margin. They are sharp where it
matters: a position wrongly masked in or out moves an output of a 17-token context by about
1/17, which ``test_emulated_decode_catches_a_wrong_window`` confirms.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest
import torch

from runtime.kv.cache import KVCache
from tests import cuda_lib
from tests.conftest import GPU
from tests.cuda_lib import BF16, DECODE_CASES, F16, INVALID, WRITE_CASES

pytestmark = pytest.mark.skipif(cuda_lib.NVCC is None, reason="nvcc not installed")

KINDS = {1: "bf16", 2: "fp16", 3: "int8", 4: "int4"}
DECODE_VARIANTS = [(1, 1), (2, 0), (3, 0), (3, 1), (4, 0), (4, 1)]  # (kind, bf16 query)
HEAD_DIMS = (64, 96, 128)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> cuda_lib.Build:
    return cuda_lib.build(tmp_path_factory.mktemp("csrc"))


@pytest.fixture(scope="module")
def lib(build: cuda_lib.Build) -> ctypes.CDLL:
    return cuda_lib.load(build.path)


def ptxas_usage(log: str) -> dict[tuple[str, str], dict[str, int]]:
    """{(kernel, arch): {"stack", "spill_stores", "spill_loads", "registers", "smem", "lmem"}}
    from ``ptxas -v``: each "Compiling entry function" line, then its properties."""
    usage: dict[tuple[str, str], dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            current = (m.group(1), m.group(2))
            usage[current] = {"lmem": 0, "smem": 0}
            continue
        if current is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            usage[current].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        m = re.search(r"Used (\d+) registers", line)
        if m:
            usage[current]["registers"] = int(m.group(1))
            for amount, kind in re.findall(r"(\d+) bytes (smem|lmem)", line):
                usage[current][kind] = int(amount)
    return usage


PROBE = "_ZN9lsq_image12probe_kernelEv"  # launch.cu's: loaded by lsq_probe, never launched


def expected_kernels() -> set[str]:
    """Mangled names: 18 decode variants, 2 merges, 2 KV writes (int32 and int64 slots), the
    residual add with RMSNorm, SiLU-and-mul, and the empty kernel lsq_probe loads."""
    names = {
        f"_ZN6lsq_pa13decode_kernelILi{kind}ELb{qbf16}ELi{dim}EEEvNS_6ParamsE"
        for kind, qbf16 in DECODE_VARIANTS
        for dim in HEAD_DIMS
    }
    names |= {f"_ZN6lsq_pa12merge_kernelILb{b}EEEvNS_6ParamsE" for b in (0, 1)}
    names |= {f"_ZN7lsq_kvw12write_kernelI{t}EEvNS_6ParamsE" for t in ("i", "l")}
    names |= {"_ZN7lsq_rms11norm_kernelENS_6ParamsE", "_ZN8lsq_silu11silu_kernelENS_6ParamsE"}
    return names | {PROBE}


def test_every_kernel_compiles_for_every_architecture(build: cuda_lib.Build) -> None:
    usage = ptxas_usage(build.log)
    for arch in cuda_lib.ARCHS:
        compiled = {kernel for kernel, sm in usage if sm == f"sm_{arch}"}
        ours = {k for k in compiled if "lsq_gemm" not in k}  # the GEMM's: test_cuda_gemm.py
        assert ours == expected_kernels(), f"sm_{arch}"
    print(f"\ncompiled {len(usage)} kernels in {build.seconds:.0f} s")


def test_no_spills_and_no_local_memory(build: cuda_lib.Build) -> None:
    usage = ptxas_usage(build.log)
    assert usage
    for (kernel, arch), u in sorted(usage.items()):
        where = f"{kernel} on {arch}: {u}"
        assert u["stack"] == 0 and u["spill_stores"] == 0 and u["spill_loads"] == 0, where
        assert u["lmem"] == 0, where
        assert u["registers"] <= 255 and u["smem"] <= 48 * 1024, where


def test_decode_kernels_fit_three_blocks_per_sm(build: cuda_lib.Build) -> None:
    """__launch_bounds__(128, 3): at most 168 registers a thread, so three blocks (12 warps) of
    the decode kernel share an SM's 65536 registers and overlap their loads; no spills for it
    (test_no_spills_and_no_local_memory)."""
    for (kernel, arch), u in ptxas_usage(build.log).items():
        if "decode_kernel" in kernel:
            assert u["registers"] * 128 * 3 <= 65536, f"{kernel} on {arch}: {u}"
            assert u["smem"] * 3 <= 99 * 1024, f"{kernel} on {arch}: {u}"


def k_load_bytes(kind: int, dim: int) -> int:
    """The width of the K loads: a lane's D/4 elements of a row, in 16, 8 or 4-byte chunks."""
    lane_bytes = dim // 4 * {1: 16, 2: 16, 3: 8, 4: 4}[kind] // 8
    return next(w for w in (16, 8, 4) if lane_bytes % w == 0)


def test_sass_uses_tensor_cores_and_wide_loads(build: cuda_lib.Build) -> None:
    """The decode kernels' SASS on sm_90 holds HMMA (mma.sync), MOVM (movmatrix) and the K/V
    fragment loads at their intended width (16 bytes wherever a lane's slice of a row allows;
    only int4 at head_dim 96 reads 4-byte chunks), and no subroutine call or local memory."""
    cuobjdump = cuda_lib.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (PATH, nvcc's directory, triton)")
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", "--gpu-architecture", "sm_90", str(build.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions = {f.split("\n", 1)[0].strip(): f for f in re.split(r"\n\s*Function : ", sass)[1:]}
    for kind, qbf16 in DECODE_VARIANTS:
        for dim in HEAD_DIMS:
            name = f"_ZN6lsq_pa13decode_kernelILi{kind}ELb{qbf16}ELi{dim}EEEvNS_6ParamsE"
            body = functions[name]
            assert "HMMA.16816.F32" in body, name
            assert "MOVM" in body, name
            width = {16: r"LDG\.E\.128", 8: r"LDG\.E\.64", 4: r"LDG\.E\.CONSTANT"}
            assert re.search(width[k_load_bytes(kind, dim)], body), name
            assert "CALL" not in body and "STL" not in body and "LDL" not in body, name
            assert "CCTL.E.PF2" in body, name  # the L2 prefetch of tiles ahead


def sass_functions(build: cuda_lib.Build, arch: str) -> dict[str, list[str]]:
    """Every kernel of the library's SASS for ``arch``: its instructions' opcodes, in order."""
    cuobjdump = cuda_lib.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (PATH, nvcc's directory, triton)")
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", "--gpu-architecture", arch, str(build.path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    opcode = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
    return {
        f.split("\n", 1)[0].strip(): opcode.findall(f)
        for f in re.split(r"\n\s*Function : ", sass)[1:]
    }


GLOBAL_MEMORY = ("LDG", "STG", "LDGSTS", "ATOMG", "RED", "CCTL", "LD.", "ST.", "ATOM.")


def test_every_kernel_waits_for_the_grids_before_it_first(build: cuda_lib.Build) -> None:
    """Programmatic dependent launch (csrc/common.cuh): on sm_90 a csrc kernel may start while
    the one before it in the stream still runs, so each must wait (griddepcontrol.wait, ACQBULK
    in SASS) before any global memory instruction, and signals its own dependents (PREEXIT).
    Before sm_90 neither instruction exists and the launch attribute is never set. The one
    thing allowed before the wait is the GEMM's L2 prefetch of its constant weights (CCTL.E.PF2:
    a hint that reads nothing into the kernel)."""
    kernels = sass_functions(build, "sm_90")
    probe = kernels.pop(PROBE)  # never launched, and touches no memory
    assert "EXIT" in probe and not [op for op in probe if op.startswith(GLOBAL_MEMORY)], probe
    assert len(kernels) >= 40  # the GEMM's, the attention's, the KV write's, the pointwise ones
    prefetching = 0
    for name, ops in kernels.items():
        assert "ACQBULK" in ops and "PREEXIT" in ops, name
        before = ops[: ops.index("ACQBULK")]
        hints = [op for op in before if op == "CCTL.E.PF2"]
        assert not hints or "w4a16_gemm_kernel" in name, name
        prefetching += bool(hints)
        memory = [op for op in before if op.startswith(GLOBAL_MEMORY) and op != "CCTL.E.PF2"]
        assert not memory, (name, before)
    assert prefetching >= 30  # every GEMM kernel's weight prefetch comes before its wait
    for name, ops in sass_functions(build, "sm_80").items():
        assert "ACQBULK" not in ops and "PREEXIT" not in ops, name


def test_programmatic_launch_is_a_process_setting(lib: ctypes.CDLL) -> None:
    assert lib.lsq_programmatic_launch(-1) == 1  # on by default
    assert lib.lsq_programmatic_launch(0) == 1
    try:
        assert lib.lsq_programmatic_launch(7) == 0  # only asks
    finally:
        assert lib.lsq_programmatic_launch(1) == 0
    assert lib.lsq_programmatic_launch(-1) == 1


def test_library_loads_without_a_gpu(lib: ctypes.CDLL) -> None:
    for name in cuda_lib.SIGNATURES:
        assert getattr(lib, name) is not None


# ---------------------------------------------------------------------------------------------
# Argument checks: fake but aligned pointers, so nothing is ever dereferenced.

FAKE = 1 << 20  # an aligned address; never read: checks fail before any CUDA call


def attention_args(**change) -> list:
    """Valid arguments for an int8 pool (fp16 query, 32/8 heads, d128, bs16, table width 64,
    partitions of 256 tokens: 4 of them, so a workspace is needed), with ``change`` applied."""
    a = {
        "q": FAKE, "q_stride_b": 32 * 128, "q_stride_h": 128,
        "out": FAKE, "out_stride_b": 32 * 128, "out_stride_h": 128,
        "k": FAKE, "v": FAKE, "k_scale": FAKE, "k_zero": FAKE, "v_scale": FAKE, "v_zero": FAKE,
        "kv_kind": 3, "q_dtype": 2,
        "tables": FAKE, "table_stride": 64, "max_blocks": 64, "lens": FAKE,
        "batch": 2, "heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16,
        "window": 0, "scale": 0.088, "partition_size": 256, "workspace": FAKE,
        "counters": None, "counters_len": 0,
    }  # fmt: skip
    a.update(change)
    return list(a.values())


ATTENTION_BAD = [
    {"head_dim": 80},
    {"head_dim": 256},
    {"head_dim": 32},
    {"kv_kind": 0},  # fp32 pools are refused
    {"kv_kind": 5},
    {"partition_size": 264},  # not a multiple of the block size
    {"partition_size": 8},
    {"kv_kind": 2, "q_dtype": 1},  # an fp16 pool with a bf16 query
    {"kv_kind": 1, "q_dtype": 2},
    {"q_dtype": 0},
    {"heads": 30},  # not a multiple of the KV heads
    {"block_size": 8},
    {"block_size": 24},
    {"k_scale": None},  # a quantized pool without its scales
    {"v_zero": None},
    {"workspace": None},  # several partitions need a workspace
    {"k": FAKE + 8},  # K/V must be 16-byte aligned (vector loads)
    {"window": -1},
    {"table_stride": 63},
    {"max_blocks": 0},
    {"batch": -1},
    {"scale": float("nan")},
    {"q": None},
    {"tables": None},
    {"counters": FAKE + 2, "counters_len": 64},  # 32-bit counters, 4-byte aligned
    {"counters_len": -1},
]


@pytest.mark.parametrize(
    "change", ATTENTION_BAD, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_attention_refuses_bad_arguments(lib: ctypes.CDLL, change: dict) -> None:
    assert lib.lsq_paged_decode_attention(*attention_args(**change), None) == INVALID
    assert lib.lsq_emulate_paged_decode_attention(*attention_args(**change)) == INVALID


def test_attention_valid_arguments_reach_cuda(lib: ctypes.CDLL) -> None:
    """The control of the test above: the same arguments unchanged pass every check, so the
    call gets as far as CUDA (no GPU here: a CUDA error, neither 0 nor 1)."""
    if GPU:  # conftest's: the host's, even where a module hides it
        pytest.skip("would launch on fake pointers")
    unquantized = {"kv_kind": 2, "k_scale": None, "k_zero": None, "v_scale": None, "v_zero": None}
    one_partition = {"partition_size": 1024, "workspace": None}
    one_launch = {"counters": FAKE, "counters_len": 16}
    for change in ({}, unquantized, one_partition, one_launch):
        assert lib.lsq_paged_decode_attention(*attention_args(**change), None) not in (0, INVALID)
    assert lib.lsq_paged_decode_attention(*attention_args(batch=0), None) == 0  # nothing to do


def write_args(**change) -> list:
    a = {
        "k": FAKE, "k_st": 256, "k_sh": 128, "v": FAKE, "v_st": 256, "v_sh": 128,
        "in_dtype": 2, "slots": FAKE, "tokens": 4,
        "k_cache": FAKE, "v_cache": FAKE, "k_scale": FAKE, "k_zero": FAKE, "v_scale": FAKE,
        "v_zero": FAKE, "kv_kind": 4, "kv_heads": 2, "head_dim": 128, "block_size": 16,
    }  # fmt: skip
    a.update(change)
    return list(a.values())


WRITE_BAD = [
    {"in_dtype": 3},
    {"in_dtype": -1},
    {"kv_kind": 0},
    {"kv_kind": 5},
    {"head_dim": 127},  # int4 packs pairs
    {"head_dim": 0},
    {"kv_heads": 0},
    {"k_scale": None},
    {"v_zero": None},
    {"tokens": -1},
    {"slots": None},
    {"k": FAKE + 1},
]


@pytest.mark.parametrize(
    "change", WRITE_BAD, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_kv_write_refuses_bad_arguments(lib: ctypes.CDLL, change: dict) -> None:
    assert lib.lsq_kv_write(*write_args(**change), None) == INVALID
    assert lib.lsq_kv_write_i32(*write_args(**change), None) == INVALID
    args = write_args(**change)
    assert lib.lsq_emulate_kv_write(*args[:8], 8, *args[8:]) == INVALID


def test_kv_write_valid_arguments_reach_cuda(lib: ctypes.CDLL) -> None:
    if GPU:  # conftest's: the host's, even where a module hides it
        pytest.skip("would launch on fake pointers")
    assert lib.lsq_kv_write(*write_args(), None) not in (0, INVALID)
    assert lib.lsq_kv_write(*write_args(head_dim=127, kv_kind=3), None) not in (0, INVALID)
    assert lib.lsq_kv_write(*write_args(tokens=0), None) == 0  # nothing to do


@pytest.mark.parametrize(
    ("batch", "heads", "dim", "max_blocks", "block_size", "partition"),
    [
        (1, 32, 128, 512, 64, 704),  # Llama-3-8B at 32k tokens: 47 partitions
        (8, 28, 128, 128, 16, 256),  # Qwen2.5-7B heads
        (3, 9, 64, 7, 16, 48),  # SmolLM2: 112 tokens in partitions of 48 -> 3
        (4, 32, 128, 4, 64, 256),  # exactly one partition: no workspace
        (4, 32, 128, 4, 64, 4096),
        (0, 32, 128, 4, 16, 16),
    ],
)
def test_workspace_floats(lib, batch, heads, dim, max_blocks, block_size, partition) -> None:
    parts = -(-max_blocks * block_size // partition)
    expected = batch * heads * parts * (dim + 2) if parts > 1 else 0
    got = lib.lsq_paged_decode_workspace_floats(
        batch, heads, dim, max_blocks, block_size, partition
    )
    assert got == expected


def test_workspace_floats_refuses_bad_shapes(lib: ctypes.CDLL) -> None:
    assert lib.lsq_paged_decode_workspace_floats(1, 32, 128, 4, 16, 24) == -1
    assert lib.lsq_paged_decode_workspace_floats(1, 32, 128, 0, 16, 16) == -1
    assert lib.lsq_paged_decode_workspace_floats(1, 32, 128, 4, 16, 8) == -1


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "max_blocks", "block_size"),
    [
        (1, 32, 8, 512, 64),  # Llama-3-8B, 32k context
        (8, 32, 8, 512, 64),
        (64, 32, 8, 32, 64),
        (1, 28, 4, 2048, 16),  # Qwen2.5-7B, 32k context
        (1, 9, 3, 128, 16),  # SmolLM2-135M, 2k context
        (256, 9, 3, 128, 16),
        (1, 64, 1, 8, 16),  # MQA: 8 head chunks
    ],
)
def test_partition_size_fills_the_gpu(lib, batch, heads, kv_heads, max_blocks, block_size):
    """132 SMs (an H100/H200), 3 decode blocks an SM: a multiple of the block size, at least 256
    tokens (or the whole table), and, unless one of those bounds decides, blocks that fill at
    least three quarters of their last wave (a partial wave costs a whole one)."""
    sms, per_sm = 132, 3
    size = lib.lsq_paged_decode_partition_size(batch, heads, kv_heads, max_blocks, block_size, sms)
    capacity = max_blocks * block_size
    floor = min(capacity, -(-256 // block_size) * block_size)
    assert size % block_size == 0 and floor <= size <= capacity
    parts = -(-capacity // size)
    blocks = batch * kv_heads * -(-(heads // kv_heads) // 8) * parts
    waves = -(-blocks // (per_sm * sms))
    if floor < size < capacity:
        assert blocks >= 0.75 * waves * per_sm * sms, (size, parts, blocks)
    if (batch, heads, max_blocks) == (1, 32, 512):
        assert (size, parts, blocks) == (704, 47, 376)  # one wave; 512 made 1.3
    if (batch, heads, max_blocks) == (8, 32, 512):
        assert (size, parts, blocks) == (5504, 6, 384)  # one wave; 3648 made 1.45
    if batch == 256:
        assert parts == 1  # short contexts, big batch: no merge launch


def test_partition_size_refuses_bad_shapes(lib: ctypes.CDLL) -> None:
    assert lib.lsq_paged_decode_partition_size(0, 32, 8, 4, 16, 132) == -1
    assert lib.lsq_paged_decode_partition_size(1, 30, 8, 4, 16, 132) == -1
    assert lib.lsq_paged_decode_partition_size(1, 32, 8, 4, 16, 0) == -1


# ---------------------------------------------------------------------------------------------
# The kernels' block bodies, emulated on the CPU.


@pytest.mark.parametrize("case", DECODE_CASES, ids=cuda_lib.case_id)
def test_emulated_decode_matches_reference(lib: ctypes.CDLL, case: tuple) -> None:
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, partition = case
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=dim)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    scale = dim**-0.5
    out = cuda_lib.decode_attention(
        lib, q, cache.layer(0), tables, lens, scale, window, partition, emulate=True
    )
    ref = cuda_lib.reference_decode(q, cache, tables, ctx, scale, window)
    cuda_lib.assert_close(out, ref)


@pytest.mark.parametrize(
    "case", [c for c in DECODE_CASES if c[8] < max(c[6])], ids=cuda_lib.case_id
)
def test_emulated_one_launch_merge_gives_the_merge_kernels_bits(lib: ctypes.CDLL, case) -> None:
    """Several partitions: merged by the last block of each head group in the decode launch,
    or by the second kernel, the same partials are summed in the same order (windows that leave
    partitions without tokens, head groups in chunks, empty partitions past a short sequence)."""
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, partition = case
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=5)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    lens, scale = torch.tensor(ctx, dtype=torch.int32), dim**-0.5
    outs = [
        cuda_lib.decode_attention(
            lib, q, cache.layer(0), tables, lens, scale, window, partition, True, one_launch
        )
        for one_launch in (True, False)
    ]
    assert torch.equal(*outs)
    cuda_lib.assert_close(outs[0], cuda_lib.reference_decode(q, cache, tables, ctx, scale, window))


def test_l2_prefetch_distance_changes_no_result(lib: ctypes.CDLL) -> None:
    """The prefetch is a hint: any distance gives the same bits. Emulated, each prefetched
    address must lie in the blocks the tables name (the emulator aborts otherwise), so the
    distances reaching past a warp's round of 32 tiles and its last tile are checked too."""
    assert lib.lsq_paged_decode_l2_prefetch(-1) == 2  # the default
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, partition = DECODE_CASES[-1]
    cache, tables, gen = cuda_lib.build_pool(kv_quant, dtype, bs, ctx, kv_heads, dim, seed=2)
    q = torch.randn(len(ctx), heads, dim, generator=gen).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    outs = []
    for tiles in (0, 2, 7):
        with cuda_lib.l2_prefetch(lib, tiles):
            outs.append(
                cuda_lib.decode_attention(
                    lib, q, cache.layer(0), tables, lens, 0.125, window, partition, emulate=True
                )
            )
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert lib.lsq_paged_decode_l2_prefetch(-1) == 2  # restored


def test_emulated_decode_strided_query(lib: ctypes.CDLL) -> None:
    """q and out as views with head and batch strides (a fused qkv projection's q part)."""
    cache, tables, gen = cuda_lib.build_pool("int4", F16, 16, [40, 3], 2, 64, seed=3)
    qkv = torch.randn(2, 8 + 2 + 2, 64, generator=gen).to(F16)
    q = qkv[:, :8]
    assert not q.is_contiguous()
    lens = torch.tensor([40, 3], dtype=torch.int32)
    out = cuda_lib.decode_attention(lib, q, cache.layer(0), tables, lens, 0.2, None, 16, True)
    cuda_lib.assert_close(
        out, cuda_lib.reference_decode(q.contiguous(), cache, tables, [40, 3], 0.2, None)
    )


def test_emulated_decode_catches_a_wrong_window(lib: ctypes.CDLL) -> None:
    """The tolerance is sharp: one position more in the window fails the comparison."""
    ctx = [17, 30]
    cache, tables, gen = cuda_lib.build_pool("int8", F16, 16, ctx, 2, 64, seed=5)
    q = torch.randn(2, 4, 64, generator=gen).to(F16)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = cuda_lib.decode_attention(lib, q, cache.layer(0), tables, lens, 0.125, 9, 16, True)
    cuda_lib.assert_close(out, cuda_lib.reference_decode(q, cache, tables, ctx, 0.125, 9))
    with pytest.raises(AssertionError):
        cuda_lib.assert_close(out, cuda_lib.reference_decode(q, cache, tables, ctx, 0.125, 10))


def test_emulated_decode_empty_sequence_gives_zeros(lib: ctypes.CDLL) -> None:
    """context_lens 0 is not a valid input, but the output is zeros, not garbage, with one
    partition and with several."""
    cache, tables, gen = cuda_lib.build_pool("none", BF16, 16, [20, 5], 1, 64, seed=1)
    q = torch.randn(2, 2, 64, generator=gen).to(BF16)
    lens = torch.tensor([20, 0], dtype=torch.int32)
    for partition, one_launch in ((16, True), (16, False), (1024, True)):
        out = cuda_lib.decode_attention(
            lib, q, cache.layer(0), tables, lens, 0.1, None, partition, True, one_launch
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = cuda_lib.reference_decode(q[:1], cache, tables[:1], [20], 0.1, None)
        cuda_lib.assert_close(out[:1], ref)


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
def test_emulated_decode_saturated_values(lib: ctypes.CDLL, kv_quant: str) -> None:
    """V at the fp16 limits in a bf16 pool: the fp16 dequantization overflows unless clamped
    (the reference dequantizes to bf16 and stays finite)."""
    ctx = [40, 20]
    cache, tables, gen = cuda_lib.build_pool(kv_quant, BF16, 16, ctx, 1, 64, seed=2)
    cuda_lib.saturate(cache, tables, 0, [3, 17, 39], seed=3)
    q = torch.randn(2, 4, 64, generator=gen).to(BF16)
    lens = torch.tensor(ctx, dtype=torch.int32)
    out = cuda_lib.decode_attention(lib, q, cache.layer(0), tables, lens, 0.1, None, 16, True)
    ref = cuda_lib.reference_decode(q, cache, tables, ctx, 0.1, None)
    assert ref.isfinite().all() and out.isfinite().all()
    cuda_lib.assert_close(out, ref)


@pytest.mark.parametrize("case", WRITE_CASES, ids=cuda_lib.write_case_id)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_emulated_kv_write_bit_identical(lib: ctypes.CDLL, case: tuple, slot_dtype) -> None:
    spec, k, v, slots, num_blocks = cuda_lib.write_inputs(case, seed=case[4])
    ours, theirs = KVCache(spec, num_blocks), KVCache(spec, num_blocks)
    cuda_lib.kv_write(lib, ours.layer(0), k, v, slots.to(slot_dtype), emulate=True)
    theirs.layer(0).write(k, v, slots)
    cuda_lib.assert_same_pool(ours, theirs)
    assert ours.layer(0).k.any()  # something was written


def test_emulated_kv_write_strided_inputs_and_overwrite(lib: ctypes.CDLL) -> None:
    """k/v as views of a fused qkv projection; a second write overwrites some slots."""
    from runtime.kv.format import KVSpec

    spec = KVSpec(1, 2, 64, 16, "int8", BF16)
    gen = torch.Generator().manual_seed(5)
    ours, theirs = KVCache(spec, 2), KVCache(spec, 2)
    for _ in range(2):
        qkv = torch.randn(6, 4 + 2 + 2, 64, generator=gen).to(BF16)
        slots = torch.randperm(32, generator=gen)[:6]
        k, v = qkv[:, 4:6], qkv[:, 6:]
        assert not k.is_contiguous()
        cuda_lib.kv_write(lib, ours.layer(0), k, v, slots, emulate=True)
        theirs.layer(0).write(k, v, slots)
    cuda_lib.assert_same_pool(ours, theirs)
