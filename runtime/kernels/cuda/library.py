"""Build and load the CUDA kernels of ``csrc/`` as one shared library with C entry points.

``nvcc`` compiles every ``csrc/*.cu`` into one ``.so`` holding SASS for sm_80, sm_86, sm_89
and sm_90 plus sm_90 PTX (newer GPUs JIT it), with the CUDA runtime linked statically, so the
library loads against any torch build (no torch headers, no torch ABI) and on a machine without
a GPU. It is built on first use (for the machine's GPU architectures only) and cached, keyed by
the sources and the flags (``runtime build-kernels`` builds it ahead of time for every
architecture, also for a GPU machine without nvcc: copy
the cache directory there, or point LITESERVE_CACHE at it). Kernels launch on the stream
the caller passes, torch's current one, so CUDA graphs capture them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from runtime.cache import cache_root
from runtime.kernels.build_cache import BuildUnavailable, cached_build, load_typed

log = logging.getLogger("liteserve")

# A link to the checkout's csrc/, so that wheels carry the sources (pyproject package-data)
CSRC = (Path(__file__).parent / "csrc").resolve()
ARCHS = ("80", "86", "89", "90")
FLAGS = [
    "-O3",
    "-lineinfo",
    "-std=c++17",
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "-cudart",
    "static",  # no libcudart to find at load time: any torch build, any machine
    # no --threads: nvcc 13's parallel per-architecture compile raced on its nvlink temporaries
    # (a CI build failed reading tmpxft_*_dlink.reg.c), and gave no speed-up on 2 cores
]


def gencode(archs: tuple[str, ...] = ARCHS) -> list[str]:
    """SASS for each architecture, and PTX of the newest for GPUs after it."""
    codes = [f for a in archs for f in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    return [*codes, "-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_DECODE = [
    *[_P, _I64, _I64] * 2,  # q and out with their batch and head strides
    *[_P] * 6,  # the layer's pool: k, v, k_scale, k_zero, v_scale, v_zero
    _I32,  # kv_kind
    _I32,  # q_dtype
    _P,  # block_tables
    _I64,  # table_stride
    _I64,  # max_blocks
    _P,  # context_lens
    *[_I64] * 5,  # batch, num_heads, num_kv_heads, head_dim, block_size
    _I32,  # sliding_window
    _F32,  # scale
    _I64,  # partition_size
    _P,  # workspace
    _P,  # counters: the partitions merged in the same launch (null: a second kernel)
    _I64,  # counters_len
    _P,  # stream
]
_KV_WRITE = [
    *[_P, _I64, _I64] * 2,  # k and v with their token and head strides
    _I32,  # in_dtype
    _P,  # slot_mapping
    _I64,  # num_tokens
    *[_P] * 6,  # the layer's pool
    _I32,  # kv_kind
    *[_I64] * 3,  # num_kv_heads, head_dim, block_size
    _P,  # stream
]
# q, its token and head strides, q_out and its strides, num_heads, cos, sin, rope_stride; then
# lsq_kv_write's arguments with the slots' width (int32 4 or int64 8) after slot_mapping
_ROTARY_KV_WRITE = [*[_P, _I64, _I64] * 2, _I64, _P, _P, _I64, *_KV_WRITE[:8], _I32, *_KV_WRITE[8:]]
# x, x_stride, delta, delta_stride, x_out, x_out_stride, weight, out, out_stride, rows, n, dtype,
# eps, stream
_ADD_RMS_NORM = [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I32, _F32, _P]
# gate_up, gate_up_stride, out, out_stride, rows, n, dtype, stream
_SILU_MUL = [_P, _I64, _P, _I64, _I64, _I64, _I32, _P]
# The C entry points (csrc/*.cu) and their argument types; each returns an int status (a
# cudaError_t: 0 launched, 1 invalid arguments, refused before any CUDA call).
# x, ldx, qweight, qparams, y, ldy, workspace, counters, counters_len, m, n, k, group_size, dtype,
# config, split_k, stream
_GEMM = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32, _I32, _P]
# qweight, qparams, w, ldw, n, k, group_size, dtype, stream
_DEQUANT = [_P, _P, _P, _I64, _I64, _I64, _I32, _I32, _P]
SIGNATURES: dict[str, tuple[list, type]] = {
    "lsq_w4a16_gemm": (_GEMM, ctypes.c_int),
    "lsq_w4a16_dequantize": (_DEQUANT, ctypes.c_int),
    "lsq_w4a16_num_configs": ([], ctypes.c_int),
    # id, then block_m, block_n, block_k, warps, warps_m, warps_k, stages, swap_ab (TILE_FIELDS)
    "lsq_w4a16_config": ([_I32, *[ctypes.POINTER(_I32)] * 8], ctypes.c_int),
    "lsq_paged_decode_attention": (_DECODE, ctypes.c_int),
    "lsq_paged_decode_workspace_floats": ([_I64] * 6, ctypes.c_int64),
    "lsq_paged_decode_partition_size": ([_I64] * 6, ctypes.c_int64),
    "lsq_paged_decode_l2_prefetch": ([_I32], ctypes.c_int32),  # tiles ahead; < 0 asks
    "lsq_programmatic_launch": ([_I32], ctypes.c_int32),  # 1 on (sm_90+), 0 off; else asks
    # runtime and driver versions out; the status of loading a kernel on the current device
    "lsq_probe": ([ctypes.POINTER(_I32)] * 2, ctypes.c_int),
    "lsq_error_name": ([_I32], ctypes.c_char_p),
    "lsq_kv_write": (_KV_WRITE, ctypes.c_int),  # int64 slots (the eager step)
    "lsq_kv_write_i32": (_KV_WRITE, ctypes.c_int),  # int32 slots (the CUDA-graph buffers)
    "lsq_rotary_kv_write": (_ROTARY_KV_WRITE, ctypes.c_int),
    "lsq_add_rms_norm": (_ADD_RMS_NORM, ctypes.c_int),
    "lsq_silu_mul": (_SILU_MUL, ctypes.c_int),
    # Twins that run the same block bodies on the CPU on host pointers (csrc/simt.cuh): how
    # the tests and `evals/bench/cuda_attention.py --quick` check the kernels without a GPU.
    "lsq_emulate_paged_decode_attention": (_DECODE[:-1], ctypes.c_int),
    "lsq_emulate_kv_write": ([*_KV_WRITE[:8], _I32, *_KV_WRITE[8:-1]], ctypes.c_int),
    # the stream's place holds when cp.async copies land: 0 at their wait, 1 at issue
    "lsq_emulate_w4a16_gemm": ([*_GEMM[:-1], _I32], ctypes.c_int),
    "lsq_emulate_w4a16_dequantize": (_DEQUANT[:-1], ctypes.c_int),
    "lsq_emulate_rotary_kv_write": (_ROTARY_KV_WRITE[:-1], ctypes.c_int),
    "lsq_emulate_add_rms_norm": (_ADD_RMS_NORM[:-1], ctypes.c_int),
    "lsq_emulate_silu_mul": (_SILU_MUL[:-1], ctypes.c_int),
}


def cache_dir() -> Path:
    return cache_root() / "cuda"


def nvcc() -> str:
    """$NVCC, nvcc on PATH, or the toolkit's under $CUDA_HOME or /usr/local/cuda."""
    chosen = os.environ.get("NVCC")
    if chosen:
        if not Path(chosen).is_file():
            raise BuildUnavailable(f"NVCC={chosen} is not a file: point it at nvcc, or unset it")
        return chosen
    candidates = [
        shutil.which("nvcc"),
        str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"),
    ]
    found = next((c for c in candidates if c and Path(c).is_file()), None)
    if found is None:
        raise BuildUnavailable(
            "nvcc is not installed (not on PATH, nor in $CUDA_HOME or /usr/local/cuda): install "
            "the CUDA toolkit, set NVCC, or build the library elsewhere with `runtime "
            "build-kernels` and copy the cache (LITESERVE_CACHE)"
        )
    return found


def sources() -> list[Path]:
    found = sorted(CSRC.glob("*.cu"))
    if not found:
        raise BuildUnavailable(
            f"no CUDA sources in {CSRC}: this install of liteserve lacks csrc/; reinstall it "
            "from a checkout or a wheel built from one (pip install .)"
        )
    return found


def compile_command(
    compiler: str, out: str, extra: tuple[str, ...] = (), archs: tuple[str, ...] = ARCHS
) -> list[str]:
    return [compiler, *FLAGS, *gencode(archs), *extra, *map(str, sources()), "-o", out]


def build(archs: tuple[str, ...] = ARCHS) -> Path:
    """The library for ``archs`` (every architecture by default), compiling it first when this
    machine has no cached copy."""
    target = target_path(archs)

    def compile_into(tmp: str) -> None:
        compiler = nvcc()
        # minutes for every architecture, during which start-up would look hung
        log.warning(
            "building the CUDA kernels with %s for %s into %s (once per machine and source; "
            "`runtime build-kernels` does it ahead of time, for every architecture)",
            compiler,
            ", ".join(archs),
            target.parent,
        )
        done = subprocess.run(
            compile_command(compiler, tmp, (), archs), capture_output=True, text=True
        )
        if done.returncode != 0:
            raise BuildUnavailable(f"{compiler} failed to build csrc/:\n{done.stderr[-3000:]}")

    return cached_build(target, compile_into)


def target_path(archs: tuple[str, ...] = ARCHS) -> Path:
    """Where the library for ``archs`` is cached: keyed by what it is built from, not by the nvcc
    that built it, so one built elsewhere and carried in LITESERVE_CACHE serves a GPU machine
    that has no nvcc."""
    digest = hashlib.sha256(" ".join(FLAGS + gencode(archs)).encode())
    for path in sorted(CSRC.glob("*.cu*")):  # sources and headers
        digest.update(path.name.encode() + path.read_bytes())
    return cache_dir() / f"liteserve_cuda-{digest.hexdigest()[:16]}.so"


def first_use(gpu_archs: tuple[str, ...]) -> Path:
    """The library a process uses: the one for every architecture where it is cached (built by
    `runtime build-kernels`, or carried), else one for this machine's GPUs' architectures alone
    (``gpu_archs``, e.g. ("90",)), built now, which a first start-up waits for: less than half
    the nvcc time for one GPU kind (sm_90: 79 s against 178 s for all four, on 2 cores); else
    (no GPU, or one that none of ARCHS serves exactly, whose driver compiles the PTX) every
    one. Without a GPU only the library's host code runs (the kernels' CPU twins), which
    every build has: one cached for a single architecture serves (the GPU check's smoke run
    rebuilt all four, minutes, beside the sm_90 one carried for the GPU)."""
    if target_path().exists():
        return build()
    if not gpu_archs:
        cached = [p for p in (target_path((a,)) for a in ARCHS) if p.exists()]
        return cached[0] if cached else build()
    if not set(gpu_archs) <= set(ARCHS):
        return build()
    return build(tuple(a for a in ARCHS if a in gpu_archs))


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library; raises BuildUnavailable with the reason when it cannot be had."""
    if os.environ.get("LITESERVE_CUDA") == "0":
        raise BuildUnavailable("disabled by LITESERVE_CUDA=0")
    return load(first_use(_gpu_archs()))


def _gpu_archs() -> tuple[str, ...]:
    """The visible GPUs' architectures as ARCHS writes them ("90"); none without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return ()
    found = (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    return tuple(sorted({f"{major}{minor}" for major, minor in found}))


def load(path: Path) -> ctypes.CDLL:
    """A built library with its entry points typed."""
    return load_typed(path, SIGNATURES)


def check(lib: ctypes.CDLL, status: int, kernel: str) -> None:
    """Raise on a failed launch of ``lib``'s ``kernel``: invalid arguments (1) name the kernel;
    any other code is a CUDA error (named by the library) that torch will also report at the
    next sync."""
    if status == 1:
        raise ValueError(f"{kernel}: arguments refused by the CUDA kernel (cudaErrorInvalidValue)")
    if status != 0:
        name = lib.lsq_error_name(status).decode()
        raise RuntimeError(f"{kernel}: CUDA error {status} ({name}) at launch")


@dataclass(frozen=True)
class Probe:
    """Whether the library's kernels load on the current device, and the CUDA versions."""

    status: int  # cudaError_t of loading a kernel's image there: 0 they can
    name: str  # its cudaGetErrorName
    runtime: int  # the CUDA runtime linked in, e.g. 13000 for 13.0
    driver: int  # what the driver supports (0: no driver)

    def versions(self) -> str:
        return f"CUDA {cuda_version(self.runtime)} runtime, driver {cuda_version(self.driver)}"


def probe(lib: ctypes.CDLL) -> Probe:
    """Ask the library on the calling thread's current device (no launch, no sync)."""
    runtime, driver = ctypes.c_int32(), ctypes.c_int32()
    status = lib.lsq_probe(ctypes.byref(runtime), ctypes.byref(driver))
    return Probe(status, lib.lsq_error_name(status).decode(), runtime.value, driver.value)


def cuda_version(code: int) -> str:
    """CUDA's version integers as people write them: 13000 is 13.0, 12080 is 12.8."""
    return f"{code // 1000}.{code % 1000 // 10}" if code else "none"


# Errors of loading a kernel that a driver older than the linked runtime gives
_OLD_DRIVER = ("cudaErrorInsufficientDriver", "cudaErrorUnsupportedPtxVersion")


def unrunnable(found: Probe, capability: tuple[int, int], path: Path) -> str | None:
    """Why the library at ``path`` cannot run on a GPU of ``capability`` where it probed as
    ``found`` (None: it can), with what to do about it; the backend selection then passes over
    it instead of failing at the first launch."""
    oldest = min(ARCHS, key=int)
    if capability < (int(oldest[:-1]), int(oldest[-1])):
        return (
            f"the csrc kernels need a GPU of compute capability {oldest[:-1]}.{oldest[-1]} or "
            f"newer (built for sm_{', sm_'.join(ARCHS)}), this one is "
            f"sm_{capability[0]}{capability[1]}: use --backend triton or cpu"
        )
    if found.status == 0:
        return None
    if found.driver == 0:
        return f"no NVIDIA driver answers on this machine ({found.name}): install one"
    if found.name in _OLD_DRIVER:
        return (
            f"the library links the CUDA {cuda_version(found.runtime)} runtime and this "
            f"machine's NVIDIA driver supports CUDA {cuda_version(found.driver)} ({found.name}): "
            "update the driver, or build the kernels with a CUDA toolkit this driver supports "
            f"(remove {path}, then `runtime build-kernels` with that nvcc on PATH or in NVCC)"
        )
    return f"its kernels do not load on this GPU: {found.name} ({found.status})"
