"""Build and load the C files beside this one: the CPU backend's kernels (cpu_decode.c,
cpu_qlinear.c and cpu_layer.c, one library) and the int4 repacker of checkpoint conversion
(repack.c).

A library is compiled once per machine with the system C compiler (``$CC``, else ``cc``)
and cached under ``$LITESERVE_CACHE`` (default ``~/.cache/liteserve``), keyed by the sources,
the compiler and the CPU's features, since ``-march=native`` code only runs where it was built.
The target is the host's own ISA unless ``LITESERVE_CPU_ISA`` asks for a lower one
(runtime/kernels/isa.py).
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
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from runtime.cache import cache_root
from runtime.kernels import isa
from runtime.kernels.build_cache import BuildUnavailable, cached_build, load_typed
from runtime.kv.format import STORAGE_KINDS

SOURCES = tuple(
    Path(__file__).with_name(f"cpu_{name}.c") for name in ("decode", "qlinear", "layer")
)
FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]  # plus the ISA's
# the kernels' dtype codes (cpu_decode.c's enum)
DTYPE_CODES = {d: code for d, code in STORAGE_KINDS.items() if isinstance(d, torch.dtype)}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "decode_attention": [_P, _I64, _I32, _P, _P, *[_P] * 6, _I32, _P, _I64, _P, *[_I64] * 6, _F32],
    "prefill_attention": [_P, _I64, _I32, _P, _I64, _I64, *[_P] * 6, _I32, _P, *[_I64] * 6, _F32],
    "dense_linear": [_P, _I64, _I32, _P, _I32, _P, _I64, _I64, _I64],
    "rms_norm": [_P, _I64, _P, _P, _I32, _I64, _I64, _F32],
    "kv_write_quantized": [_P, _I64, _P, _I64, _I32, _P, _I64, *[_P] * 6, _I64, _I64, _I32],
    "int4_int8_linear": [_P, _I64, _I32, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I32],
    "int8_int8_linear": [_P, _I64, _I32, _P, _P, _P, _I64, _I64, _I64],
    "decode_layer": [_P, _P, _I64, *[_P] * 9, _I64, _P, _I64, _P, _I64],
    "decode_layers": [_P, _P, _I64, _I64, *[_P] * 9, _I64, _P, _I64, _P, _I64],
}


def cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _compiler() -> list[str]:
    """$CC as make reads it: a command and its arguments (`ccache gcc`, `gcc -O2`)."""
    cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    if shutil.which(cc[0]) is None:
        raise BuildUnavailable(
            f"no C compiler ({cc[0]!r} is not on PATH): install gcc or clang, or set CC"
        )
    return cc


def _compile(
    cc: list[str], sources: tuple[Path, ...], flags: list[str], out: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cc, *flags, *map(str, sources), "-o", out, "-lm"], capture_output=True, text=True
    )


def build(sources: tuple[Path, ...] | Path = SOURCES) -> Path:
    """The compiled library of C files beside this one (the CPU kernels by default), for the
    selected ISA, compiling it first if this machine has no cached copy."""
    sources = (sources,) if isinstance(sources, Path) else sources
    cc = _compiler()
    name, target_isa = isa.selected()
    flags = [*FLAGS, *target_isa.flags]
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources))
    digest.update(f"{' '.join(flags)}\n{version}\n{_cpu_features()}".encode())
    tag = "" if name == "native" else f"-{name}"
    target = cache_dir() / f"{sources[0].stem}{tag}-{digest.hexdigest()[:16]}.so"

    def compile_into(tmp: str) -> None:
        done = _compile(cc, sources, flags, tmp)
        if done.returncode != 0 and "-fopenmp" in flags:
            # a compiler without OpenMP (Apple's clang) still gives single-threaded kernels
            serial = _compile(cc, sources, [f for f in flags if f != "-fopenmp"], tmp)
            done = done if serial.returncode != 0 else serial
        if done.returncode != 0:
            names = ", ".join(s.name for s in sources)
            why = done.stderr[-2000:] or f"exit status {done.returncode}, no message"
            raise BuildUnavailable(f"{shlex.join(cc)} failed to build {names}:\n{why}")

    return cached_build(target, compile_into)


def load_native(source: tuple[Path, ...] | Path, signatures: dict[str, list]) -> ctypes.CDLL:
    """A C file's (or files') library with its entry points typed (all return void); raises
    BuildUnavailable with the reason when it cannot be had."""
    if os.environ.get("LITESERVE_NATIVE") == "0":
        raise BuildUnavailable("disabled by LITESERVE_NATIVE=0")
    return load_typed(build(source), {name: (args, None) for name, args in signatures.items()})


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded CPU kernels."""
    return load_native(SOURCES, _SIGNATURES)


def isa_path(lib: ctypes.CDLL) -> str:
    """The SIMD path the library was compiled for (avx2, avx512-vnni, avx512-vnni-amx,
    neon-dotprod, scalar)."""
    lib.isa_path.argtypes, lib.isa_path.restype = [], ctypes.c_char_p
    return lib.isa_path().decode()


def load() -> tuple[ctypes.CDLL | None, str]:
    """(the kernels or None, a line for logs): which decode kernels the CPU backend runs and
    why."""
    try:
        lib = library()
    except BuildUnavailable as e:
        return None, f"torch decode attention ({e})"
    return lib, f"C kernels, {isa_path(lib)} path ({Path(lib._name).name})"
