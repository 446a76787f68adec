"""Build and call the csrc kernels from tests (ctypes, no torch headers): the shared part of
``test_cuda_attention_build.py`` and ``test_cuda_gemm.py`` (CPU: compile checks, argument
checks, the kernels run by the SIMT emulator) and ``test_cuda_attention_gpu.py`` and
``test_cuda_gemm_gpu.py`` (the kernels on a GPU).

The library (all of csrc, as the cuda backend builds it) is compiled at most once per test
session (per architecture list). The entry points are ``lsq_paged_decode_attention``,
``lsq_kv_write`` (``_i32``), ``lsq_w4a16_gemm`` and their ``lsq_emulate_*`` twins, which run
the very same block bodies on the CPU (``csrc/simt.cuh``) on host pointers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.kernels.cuda import library
from runtime.kv.format import STORAGE_KINDS
from runtime.kv.layer import LayerKV

ARCHS = library.ARCHS


def _nvcc() -> str | None:
    try:
        return library.nvcc()
    except library.BuildUnavailable:
        return None


NVCC = _nvcc()

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = library.SIGNATURES
INVALID = 1  # cudaErrorInvalidValue


@dataclass(frozen=True)
class Build:
    path: Path
    log: str  # nvcc's output, with ptxas -v resource usage
    seconds: float
    archs: tuple[str, ...]


@dataclass(frozen=True)
class _Started:
    proc: subprocess.Popen
    out: Path
    log: Path  # nvcc's stdout and stderr together
    at: float


_BUILDS: dict[tuple[str, ...], Build] = {}
_STARTED: dict[tuple[str, ...], _Started] = {}


def start(out_dir: Path, archs: tuple[str, ...] = ARCHS) -> None:
    """Start the build in the background (conftest does when the modules that need it are
    collected): nvcc compiles on one core for minutes, and on a 2-core machine the tests before
    those modules leave the other core mostly idle."""
    if any(set(archs) <= set(have) for have in (*_BUILDS, *_STARTED)):
        return
    out, log = out_dir / "liteserve_cuda.so", out_dir / "nvcc.log"
    command = library.compile_command(library.nvcc(), str(out), ("-Xptxas", "-v"), archs)
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    _STARTED[tuple(archs)] = _Started(proc, out, log, time.monotonic())


def stop() -> None:
    """End a background build nobody waited for (the session ends without its modules)."""
    for job in _STARTED.values():
        job.proc.kill()
        job.proc.wait()
    _STARTED.clear()


def build(out_dir: Path, archs: tuple[str, ...] = ARCHS) -> Build:
    """The whole csrc library as ``runtime build-kernels`` compiles it, plus ``-Xptxas -v`` for
    the resource report, into ``out_dir`` unless a background build was started (once per
    session and architecture list; a build for a superset of ``archs`` is reused): every test
    module checks the same binary."""
    for have, done in _BUILDS.items():
        if set(archs) <= set(have):
            return done
    start(out_dir, archs)
    have = next(h for h in _STARTED if set(archs) <= set(h))
    job = _STARTED.pop(have)
    code = job.proc.wait()
    log = job.log.read_text()
    if code != 0:
        raise RuntimeError(f"nvcc failed ({code}):\n{log}")
    _BUILDS[have] = Build(job.out, log, time.monotonic() - job.at, have)
    return _BUILDS[have]


load = library.load


def gpu_library() -> ctypes.CDLL:
    """For the GPU tests: the library the cuda backend loads (built here, or carried prebuilt
    in LITESERVE_CACHE to a machine without nvcc). On a GPU host its absence fails the test: a
    skip would let a GPU run pass with the csrc kernels never run. LITESERVE_CUDA=0 (no csrc
    wanted) skips them instead."""
    import pytest

    try:
        return library.library()
    except library.BuildUnavailable as e:
        if os.environ.get("LITESERVE_CUDA") == "0":
            pytest.skip(f"the csrc library is unavailable: {e}")
        pytest.fail(
            f"the csrc library is unavailable on this GPU host: {e}. Build it with `runtime "
            "build-kernels` (needs nvcc) or carry a prebuilt one in LITESERVE_CACHE; "
            "LITESERVE_CUDA=0 skips the csrc tests"
        )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv: LayerKV,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    partition_size: int,
    emulate: bool = False,
    one_launch: bool = True,
) -> torch.Tensor:
    """The kernel's output ``[B, H, D]`` in q's dtype; ``emulate`` runs it on the CPU (all tensors
    on the CPU), else on q's GPU on torch's current stream. int32 tables and lengths.
    ``one_launch``: the partitions merge in the decode launch (zeroed counters, checked to be
    zeros again after it), else in the second kernel."""
    s = kv.spec
    batch, heads, dim = q.shape
    assert q.stride(-1) == 1 and block_tables.dtype == torch.int32
    assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    out = torch.empty_like(q)
    max_blocks = block_tables.shape[1]
    floats = lib.lsq_paged_decode_workspace_floats(
        batch, heads, dim, max_blocks, s.block_size, partition_size
    )
    assert floats >= 0
    workspace = torch.empty(max(floats, 1), dtype=torch.float32, device=q.device)
    args = [
        _ptr(q), q.stride(0), q.stride(1),
        _ptr(out), out.stride(0), out.stride(1),
        *(_ptr(t) for t in (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)),
        s.storage_kind, STORAGE_KINDS[q.dtype],
        _ptr(block_tables), block_tables.stride(0), max_blocks, _ptr(context_lens),
        batch, heads, s.num_kv_heads, dim, s.block_size,
        sliding_window or 0, scale, partition_size, _ptr(workspace),
    ]  # fmt: skip
    groups = batch * s.num_kv_heads * -(-(heads // s.num_kv_heads) // 8)  # query heads by 8
    counters = torch.zeros(groups if one_launch else 0, dtype=torch.int32, device=q.device)
    args += [_ptr(counters) if one_launch else None, counters.numel()]
    if emulate:
        rc = lib.lsq_emulate_paged_decode_attention(*args)
    else:
        rc = lib.lsq_paged_decode_attention(*args, torch.cuda.current_stream().cuda_stream)
    assert rc == 0, f"lsq_paged_decode_attention returned {rc}"
    assert not counters.any(), "the last block of each group sets its counter back to 0"
    return out


def kv_write(
    lib: ctypes.CDLL,
    kv: LayerKV,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    emulate: bool = False,
) -> None:
    """Quantize (or convert) and store ``k``, ``v`` ``[T, Hkv, D]`` at ``slot_mapping`` (int64 or
    int32) into the layer's pool; ``emulate`` runs the kernel on the CPU."""
    s = kv.spec
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    args = [
        _ptr(k), k.stride(0), k.stride(1), _ptr(v), v.stride(0), v.stride(1),
        STORAGE_KINDS[k.dtype],
    ]  # fmt: skip
    rest = [
        slot_mapping.shape[0],
        *(_ptr(t) for t in (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale, kv.v_zero)),
        s.storage_kind, s.num_kv_heads, s.head_dim, s.block_size,
    ]  # fmt: skip
    assert k.dtype == v.dtype and slot_mapping.dtype in (torch.int64, torch.int32)
    if emulate:
        size = slot_mapping.element_size()
        rc = lib.lsq_emulate_kv_write(*args, _ptr(slot_mapping), size, *rest)
    else:
        fn = lib.lsq_kv_write if slot_mapping.dtype == torch.int64 else lib.lsq_kv_write_i32
        rc = fn(*args, _ptr(slot_mapping), *rest, torch.cuda.current_stream().cuda_stream)
    assert rc == 0, f"lsq_kv_write returned {rc}"


# ---------------------------------------------------------------------------------------------
# Test data shared by the emulated (CPU) and GPU tests.

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
POOL = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")
# max |out - ref| <= atol + rtol * |ref|: see test_cuda_attention_build.py's docstring
TOL = {F16: (2e-3, 2e-3), BF16: (3e-2, 3e-2)}
SPARE_BLOCKS = 2  # table columns past the longest sequence: padding, and empty partitions

# kv_quant, dtype, block_size, heads, kv heads, head_dim, context_lens, window, partition_size
DECODE_CASES = [
    ("none", F16, 16, 32, 8, 128, [1, 17, 1000], None, 16),  # 63 partitions of one block
    ("none", F16, 64, 9, 3, 64, [1, 17, 1000], 300, 128),
    ("none", BF16, 16, 9, 3, 96, [17, 1, 200], None, 48),  # 3-block partitions
    ("none", BF16, 64, 32, 8, 128, [1000, 17], 100, 64),
    # several tiles per warp of a 16-bit pool at d128 / d96 (K of the next tile loads early)
    ("none", F16, 16, 32, 8, 128, [1, 17, 1000], 300, 256),
    ("none", BF16, 64, 9, 3, 96, [1000, 17], None, 512),
    ("int8", F16, 16, 32, 8, 128, [1, 17, 1000], None, 256),
    ("int8", F16, 64, 9, 3, 64, [1000, 1, 17], 33, 64),  # most partitions before the window
    ("int8", BF16, 16, 9, 3, 128, [17, 1000], 1, 16),  # window 1: only the token itself
    ("int8", BF16, 64, 16, 1, 96, [1, 17, 300], None, 4096),  # one partition; 16 heads: 2 chunks
    ("int4", F16, 16, 9, 3, 128, [1, 17, 1000], 500, 64),
    ("int4", F16, 64, 32, 8, 64, [17, 1000, 1], None, 128),
    ("int4", BF16, 16, 12, 1, 96, [1000, 17], 70, 32),  # a 12-head group: chunks of 8 and 4
    ("int4", BF16, 64, 4, 4, 128, [1, 17, 1000], None, 1024),  # no GQA
    # 41 tiles for a warp: its second round of 32 block-table lookups, and L2 prefetches that
    # skip the tiles across the round's edge
    ("int8", F16, 64, 8, 2, 64, [2600, 5], None, 4096),
]


@contextlib.contextmanager
def l2_prefetch(lib: ctypes.CDLL, tiles: int) -> Iterator[None]:
    """The decode attention's L2 prefetch distance set to ``tiles`` (process-wide), restored."""
    before = lib.lsq_paged_decode_l2_prefetch(tiles)
    try:
        yield
    finally:
        lib.lsq_paged_decode_l2_prefetch(before)


def case_id(case: tuple) -> str:
    kv_quant, dtype, bs, heads, kv_heads, dim, ctx, window, part = case
    win = f"-w{window}" if window else ""
    return f"{kv_quant}-{str(dtype)[6:]}-bs{bs}-{heads}x{kv_heads}-d{dim}{win}-p{part}"


def build_pool(
    kv_quant: str,
    dtype: torch.dtype,
    block_size: int,
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    seed: int,
):
    """A one-layer pool (CPU) holding every sequence's K/V, written by ``LayerKV.write`` into
    shuffled blocks, and int32 block tables padded with 0 (a valid id, as the engine pads).
    Returns (cache, tables, generator)."""
    from runtime.kv.cache import KVCache
    from runtime.kv.format import KVSpec

    gen = torch.Generator().manual_seed(seed)
    spec = KVSpec(1, num_kv_heads, head_dim, block_size, kv_quant, dtype)
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
    k = 2 * torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen) + 0.3
    v = torch.randn(len(slot_mapping), num_kv_heads, head_dim, generator=gen) - 0.2
    cache.layer(0).write(k.to(dtype), v.to(dtype), slot_mapping)
    # stale, non-finite bytes in the unused slots of the last blocks and the spare ones:
    # the kernel must not let positions past a sequence's end reach the output
    used = torch.zeros(cache.num_slots, dtype=torch.bool)
    used[slot_mapping] = True
    layer = cache.layer(0)
    for name in POOL:
        t = getattr(layer, name)
        if t is not None and t.dtype != torch.uint8:
            layer._flat(t)[~used] = float("nan")
    return cache, tables, gen


def reference_decode(q, cache, tables, context_lens, scale, window) -> torch.Tensor:
    from runtime.kernels.reference import paged_attention

    rows = list(tables.long())
    ones = [1] * len(context_lens)
    return paged_attention(q, cache.layer(0), rows, context_lens, ones, scale, window)


def on_device(cache, device: torch.device):
    """A copy of the pool on ``device``: the kernels read the bytes the CPU reference reads."""
    from runtime.kv.cache import KVCache

    if device.type == "cpu":
        return cache
    copy = KVCache(cache.spec, cache.num_blocks, device)
    for src, dst in zip(cache.layers, copy.layers, strict=True):
        for name in POOL:
            if getattr(src, name) is not None:
                getattr(dst, name).copy_(getattr(src, name))
    return copy


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=atol, rtol=rtol)


def special_rows(head_dim: int, qmax: int, gen: torch.Generator) -> torch.Tensor:
    """[6, head_dim] fp32 rows that stress the quantizer's rounding: beyond the fp16 range
    (saturating), constant, tiny negatives (zero rounds to -2**-24), a range below one fp16 ulp,
    exact round-half-even ties next to values one ulp below a tie, and an offset random row."""
    ramp = torch.arange(head_dim, dtype=F32)
    ties = torch.full((head_dim,), 0.5)
    ties[0], ties[1] = 0.0, float(qmax)  # zero 0 and scale exactly 1: codes are round(x)
    half = torch.arange(head_dim - 2) % qmax + 0.5  # k + 0.5: exact ties, both parities
    ties[2:] = torch.where(torch.arange(head_dim - 2) % 3 == 0, half.nextafter(-half), half)
    return torch.stack(
        [
            torch.randn(head_dim, generator=gen) * 3e4 + ramp * 1e3,
            torch.full((head_dim,), 1.2345),
            -torch.rand(head_dim, generator=gen) * 1e-9,
            1 + torch.rand(head_dim, generator=gen) * 1e-6,
            ties,
            torch.randn(head_dim, generator=gen) - 7.5,
        ]
    )


# kv_quant, pool dtype, input dtype, kv heads, head_dim
WRITE_CASES = [
    ("int8", F16, F32, 2, 128),
    ("int8", BF16, F16, 3, 64),
    ("int8", F16, BF16, 1, 96),
    ("int8", F16, F32, 2, 20),  # head_dim below a warp
    ("int4", F16, F32, 2, 128),
    ("int4", BF16, BF16, 2, 64),
    ("int4", F16, F16, 1, 200),  # more pairs than lanes
    ("int4", F16, F32, 3, 18),
    ("none", F16, F16, 2, 128),
    ("none", BF16, BF16, 2, 64),
    ("none", BF16, F32, 2, 96),  # converted on the way in
    ("none", F16, BF16, 1, 40),
    ("none", F16, F32, 2, 64),
]


def write_case_id(case: tuple) -> str:
    kv_quant, pool, src, heads, dim = case
    return f"{kv_quant}-{str(pool)[6:]}-from-{str(src)[6:]}-h{heads}-d{dim}"


def write_inputs(case: tuple, seed: int):
    """(spec, k, v, slots, num_blocks): 20 tokens with the special rows in K's first head and
    (reversed) V's last head, slots shuffled over 3 blocks of 16 with 4 padding slots (-1)."""
    from runtime.kv.format import KVSpec

    kv_quant, pool, src, heads, dim = case
    gen = torch.Generator().manual_seed(seed)
    qmax = 255 if kv_quant == "int8" else 15
    num_tokens, block_size, num_blocks = 20, 16, 3
    k = torch.randn(num_tokens, heads, dim, generator=gen) * 2 + 0.5
    v = torch.randn(num_tokens, heads, dim, generator=gen)
    rows = special_rows(dim, qmax, gen)
    k[: len(rows), 0] = rows
    v[-len(rows) :, -1] = rows.flip(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[6 + torch.randperm(num_tokens - 12, generator=gen)[:4]] = -1  # padding, not special
    spec = KVSpec(1, heads, dim, block_size, kv_quant, pool)
    return spec, k.to(src), v.to(src), slots, num_blocks


def assert_same_pool(a, b) -> None:
    """Every tensor of the layer bit for bit (``a`` on any device, ``b`` on the CPU)."""
    for name in POOL:
        x, y = getattr(a.layer(0), name), getattr(b.layer(0), name)
        if x is None:
            assert y is None
            continue
        x = x.cpu()
        bits = torch.uint8 if x.dtype == torch.uint8 else torch.int16
        assert torch.equal(x.view(bits), y.view(bits)), f"{name} differs"


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, next to nvcc, or the copy triton ships (None when none is found)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    dirs = [Path(NVCC).resolve().parent] if NVCC else []
    dirs += [Path(os.environ[v]) / "bin" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    try:
        import triton

        dirs.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin")
    except ImportError:
        pass
    return next((str(d / "cuobjdump") for d in dirs if (d / "cuobjdump").is_file()), None)


def saturate(cache, tables: torch.Tensor, seq: int, positions: list[int], seed: int) -> None:
    """Rewrite V of some positions of sequence ``seq`` with values at the fp16 limits (+-65504):
    their dequantized maximum, zero + qmax * scale, exceeds the fp16 range (so the kernel's
    fp16 dequantization must clamp), while a bf16 pool's reference stays finite."""
    s = cache.spec
    gen = torch.Generator().manual_seed(seed)
    pos = torch.tensor(positions)
    slots = tables[seq, pos // s.block_size].long() * s.block_size + pos % s.block_size
    k = torch.randn(len(positions), s.num_kv_heads, s.head_dim, generator=gen)
    v = torch.full((len(positions), s.num_kv_heads, s.head_dim), 65504.0)
    v[..., ::2] = -65504.0
    v[:, :, 1] = 7e4  # beyond fp16: clamped by the quantizer
    cache.layer(0).write(k.to(s.dtype), v.to(s.dtype), slots)


# ---------------------------------------------------------------------------------------------
# The W4A16 GEMM (csrc/w4a16_gemm.cu): data and calls shared by test_cuda_gemm.py (emulated)
# and test_cuda_gemm_gpu.py.

GEMM_DTYPES = (F16, BF16)  # the activations the kernel takes
# Relative Frobenius error against the fp64 reference; see test_cuda_gemm_gpu.py's docstring.
GEMM_TOLERANCE = {F16: 2e-3, BF16: 1e-2}


def gemm_weight(
    n: int, k: int, gs: int, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes, scales and zero points, packed by the reference packer."""
    from runtime.artifact import layout

    g = torch.Generator().manual_seed(seed)
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 0.002
    zero = torch.randint(0, 16, (n, groups), generator=g)
    qweight = layout.pack_qweight(q, gs).to(device)
    qparams = layout.pack_qparams(scale, zero, gs, k).to(device)
    return qweight, qparams


def gemm_reference(x: torch.Tensor, qweight, qparams, n: int, k: int, gs: int) -> torch.Tensor:
    """x @ W_hat^T in fp64, W_hat dequantized by the layout's reference."""
    from runtime.artifact import layout

    w = layout.dequantize(qweight, qparams, n, k, gs)
    return x.double() @ w.double().T


def gemm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    gs: int,
    config: int,
    split_k: int,
    y: torch.Tensor | None = None,
    emulate_landing: int | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W_hat^T by lsq_w4a16_gemm on torch's current stream, or, with emulate_landing
    (0: cp.async copies land at their wait, 1: at issue), by lsq_emulate_w4a16_gemm on the CPU.
    x and y may be row views. With ``counters`` (int32 zeros) a split sums in the same launch."""
    m = x.shape[0]
    assert x.stride(1) == 1 and x.shape[1] == k
    if y is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    np_ = -(-n // 64) * 64
    workspace = torch.empty(max(1, split_k * m * np_), dtype=torch.float32, device=x.device)
    args = [x.data_ptr(), x.stride(0), qweight.data_ptr(), qparams.data_ptr(), y.data_ptr()]
    args += [y.stride(0), workspace.data_ptr()]
    args += [None, 0] if counters is None else [counters.data_ptr(), counters.numel()]
    args += [m, n, k, gs, STORAGE_KINDS[x.dtype]]
    args += [config, split_k]
    if emulate_landing is None:
        rc = lib.lsq_w4a16_gemm(*args, torch.cuda.current_stream().cuda_stream)
    else:
        rc = lib.lsq_emulate_w4a16_gemm(*args, emulate_landing)
    assert rc == 0, f"lsq_w4a16_gemm returned cudaError {rc}"
    return y


def gemm_rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def gemm_splits_to_try(cfg, k: int, gs: int) -> list[int]:
    """1, the largest valid split up to 8, and one in between."""
    from runtime.kernels.cuda import gemm_plan as gp

    valid = [s for s in range(1, 9) if gp.split_ok(cfg, k, gs, s)]
    return sorted({valid[0], valid[len(valid) // 2], valid[-1]})


# The pointwise kernels between the GEMMs (csrc/kv_write.cu's rotary, rms_norm.cu, silu_mul.cu),
# checked through CudaBackend's ops (emulated on the CPU in test_cuda_backend.py, compiled in
# test_cuda_attention_gpu.py) against the torch ops they replace.

# activations dtype, hidden size: SmolLM2's 576 (a partial last pass of a norm block),
# Llama-3-8B's 4096 (two passes), a size no tile divides
POINTWISE_CASES = [(F16, 576), (BF16, 4096), (F32, 1000), (BF16, 17)]


def rotary_inputs(case: tuple, seed: int, device: torch.device):
    """(spec, qk, v, (cos, sin), slots, num_blocks) on ``device``: write_inputs' K and V (the
    special rows kept finite in fp16: inf * 0 would be NaN) beside 3x as many query heads, as
    views of one qkv row per token as the model's fused GEMM leaves them, and the cos and sin of
    random positions in the activations' dtype."""
    spec, k, v, slots, num_blocks = write_inputs(case, seed)
    t, kv_heads, dim = k.shape
    heads = 3 * kv_heads
    gen = torch.Generator().manual_seed(seed + 1)
    big = torch.finfo(F16).max
    k = k.float().clamp(-big, big).to(k.dtype)
    q = torch.randn(t, heads, dim, generator=gen).to(k.dtype)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1).to(device)
    qk = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    angles = torch.rand(t, 1, dim // 2, generator=gen, dtype=torch.float64) * 1e4
    rope = tuple(f(angles).to(device, k.dtype) for f in (torch.cos, torch.sin))
    return spec, qk, v, rope, slots.to(device), num_blocks


def norm_inputs(case: tuple, seed: int, device: torch.device):
    """(x, delta, weight) of 3 rows, x a strided view (every other row of a wider tensor)."""
    dtype, n = case
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, n + 8, generator=gen) * 4).to(device, dtype)[::2, 3 : n + 3]
    delta = torch.randn(3, n, generator=gen).to(device, dtype)
    weight = (1 + torch.randn(n, generator=gen) / 4).to(device, dtype)
    return x, delta, weight


# The norm against reference.rms_norm of the rounded sum: fp32 inside, one rounding, but the
# sum of squares in another order and rsqrt to 2 ulp: within one output ulp of the dtype.
NORM_TOL = {F32: (1e-5, 1e-5), F16: (1e-3, 2**-10), BF16: (1e-2, 2**-7)}


def check_add_rms_norm(backend, case: tuple, seed: int, device: torch.device) -> None:
    from runtime.kernels import reference

    x, delta, weight = norm_inputs(case, seed, device)
    eps = 1e-5
    for d in (delta, None):
        summed, out = backend.add_rms_norm(x, d, weight, eps)
        want = x if d is None else x + d
        assert torch.equal(summed, want)  # the add rounded as torch rounds it
        ref = reference.rms_norm(want.cpu(), weight.cpu(), eps)
        atol, rtol = NORM_TOL[want.dtype]
        torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=rtol)
    assert torch.equal(x, norm_inputs(case, seed, device)[0])  # the input untouched


def check_silu_mul(backend, case: tuple, seed: int, device: torch.device) -> None:
    """Against F.silu(gate) * up in the dtype, torch's ops on the same device. On a GPU bit for
    bit: the kernel's g / (1 + expf(-g)) is torch's CUDA SiLU, with CUDA's expf and division.
    Emulated on the CPU, the host's expf may differ from torch's by an fp32 ulp or two, which
    moves a 16-bit result by at most one step of its dtype (and the bits nearly never), an fp32
    one by a few ulps."""
    dtype, n = case
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(6, 2 * n + 4, generator=gen) * 3).to(device, dtype)[::2, : 2 * n]
    out = backend.act_mul(gate_up, "silu")
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up).float().cpu()
    if gate_up.is_cuda:
        assert out.shape == (3, n) and out.dtype == dtype
        assert torch.equal(out.cpu().float(), ref)
        return
    ulps = 4 if dtype == F32 else 1
    step = ulps * torch.finfo(dtype).eps * ref.abs() + torch.finfo(dtype).tiny
    assert out.shape == (3, n) and out.dtype == dtype
    assert ((out.cpu().float() - ref).abs() <= step).all()
    if dtype != F32:  # the bits themselves nearly everywhere
        assert (out.cpu().float() == ref).float().mean() > 0.99


def check_rotary_kv_write(backend, case: tuple, slot_dtype: torch.dtype, device) -> None:
    """Queries, codes, scales and zeros bit for bit what apply_rotary and LayerKV.write give."""
    from runtime.kernels.reference import apply_rotary
    from runtime.kv.cache import KVCache

    spec, qk, v, rope, slots, num_blocks = rotary_inputs(case, case[4], device)
    ours = on_device(KVCache(spec, num_blocks), device)
    q = backend.rotary_kv_write(qk, v, rope, ours.layer(0), slots.to(slot_dtype))
    rotated = apply_rotary(qk.cpu(), *(t.cpu() for t in rope))
    heads = qk.shape[1] - v.shape[1]
    theirs = KVCache(spec, num_blocks)
    theirs.layer(0).write(rotated[:, heads:], v.cpu(), slots.cpu())
    assert_same_pool(ours, theirs)
    assert q.shape == rotated[:, :heads].shape and q.dtype == qk.dtype
    bits = torch.int32 if q.dtype == F32 else torch.int16
    assert torch.equal(q.cpu().contiguous().view(bits), rotated[:, :heads].contiguous().view(bits))
    assert ours.layer(0).k.any()  # something was written
