"""Build and load the C files beside this one: the CPU backend's decode kernels
(cpu_decode.c) and the int4 repacker of checkpoint conversion (repack.c).

A library is compiled once per machine with the system C compiler (``$CC``, else ``cc``)
and cached under ``$LITESERVE_CACHE`` (default ``~/.cache/liteserve``), keyed by the source,
the compiler and the CPU's features, since ``-march=native`` code only runs where it was built.
It links the OpenMP runtime that torch has already loaded, so both share one thread pool.
ctypes rather than a torch C++ extension: without torch's headers the build takes about a
second instead of a minute and does not depend on torch's ABI.

When no compiler is available the CPU backend runs its torch formulation of the same steps
and says so in its detail line (logs, /health, ``runtime check``); ``LITESERVE_NATIVE=0``
chooses that path explicitly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from runtime.cache import cache_root
from runtime.kernels.build_cache import BuildUnavailable, cached_build, load_typed
from runtime.kv.format import STORAGE_KINDS

SOURCE = Path(__file__).with_name("cpu_decode.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
# the kernels' dtype codes (cpu_decode.c's enum)
DTYPE_CODES = {d: code for d, code in STORAGE_KINDS.items() if isinstance(d, torch.dtype)}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "decode_attention": [_P, _I64, _I32, _P, _P, *[_P] * 6, _I32, _P, _I64, _P, *[_I64] * 6, _F32],
    "int4_linear": [_P, _I64, _I32, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I64],
    "dense_linear": [_P, _I64, _I32, _P, _I32, _P, _I64, _I64, _I64],
    "rms_norm": [_P, _I64, _P, _P, _I32, _I64, _I64, _F32],
    "kv_write_quantized": [_P, _I64, _P, _I64, _I32, _P, _I64, *[_P] * 6, _I64, _I64, _I32],
}


def cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise BuildUnavailable(
            f"no C compiler ({cc!r} is not on PATH): install gcc or clang, or set CC"
        )
    return cc


def _compile(cc: str, source: Path, flags: list[str], out: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [cc, *flags, str(source), "-o", out, "-lm"], capture_output=True, text=True
    )


def build(source: Path = SOURCE) -> Path:
    """The compiled library of a C file beside this one (the decode kernels by default),
    compiling it first if this machine has no cached copy."""
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        source.read_bytes() + " ".join(FLAGS).encode() + version.encode() + _cpu_features().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"

    def compile_into(tmp: str) -> None:
        done = _compile(cc, source, FLAGS, tmp)
        if done.returncode != 0 and "-fopenmp" in FLAGS:
            # a compiler without OpenMP (Apple's clang) still gives single-threaded kernels
            serial = _compile(cc, source, [f for f in FLAGS if f != "-fopenmp"], tmp)
            done = done if serial.returncode != 0 else serial
        if done.returncode != 0:
            raise BuildUnavailable(f"{cc} failed to build {source.name}:\n{done.stderr[-2000:]}")

    return cached_build(target, compile_into)


def load_native(source: Path, signatures: dict[str, list]) -> ctypes.CDLL:
    """A C file's library with its entry points typed (all return void); raises
    BuildUnavailable with the reason when it cannot be had."""
    if os.environ.get("LITESERVE_NATIVE") == "0":
        raise BuildUnavailable("disabled by LITESERVE_NATIVE=0")
    return load_typed(build(source), {name: (args, None) for name, args in signatures.items()})


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded decode kernels."""
    return load_native(SOURCE, _SIGNATURES)


def load() -> tuple[ctypes.CDLL | None, str]:
    """(the kernels or None, a line for logs): which decode kernels the CPU backend runs and
    why."""
    try:
        lib = library()
    except BuildUnavailable as e:
        return None, f"torch decode attention ({e})"
    return lib, f"C decode kernels ({Path(lib._name).name})"
