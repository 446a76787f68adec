"""Compiled kernel libraries, built once per machine into the liteserve cache.

The C CPU kernels and the CUDA library share this: the file is named by a hash of everything
that went into it (source, flags, compiler, machine), compiled through runtime/cache.py's
cached_entry (a unique temporary name, an atomic rename, a file lock), so concurrent processes
compile it once and a killed build never leaves a half-written library that a later run loads.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from runtime.cache import CacheUnwritable, cached_entry


class BuildUnavailable(RuntimeError):
    """A kernel library cannot be built or loaded here; the message says why."""


def cached_build(target: Path, compile_into: Callable[[str], None]) -> Path:
    """``target`` if it exists, else ``compile_into(tmp)`` then an atomic rename to it, under
    the cache's lock (runtime/cache.py), so concurrent processes compile it once.
    ``compile_into`` raises BuildUnavailable when the compiler fails."""

    def build(tmp: Path) -> None:
        compile_into(str(tmp))
        with open(tmp, "rb") as f:
            if f.read(4) != b"\x7fELF":  # a compiler that exits 0 without writing its output
                raise BuildUnavailable(
                    f"the compiler exited 0 but wrote no shared library for {target.name}: "
                    "check the compiler (CC, NVCC) and rerun"
                )

    try:
        return cached_entry(target, build)
    except CacheUnwritable as e:
        raise BuildUnavailable(f"cannot write the kernel cache: {e}") from e


def load_typed(path: Path, signatures: dict[str, tuple[list, type | None]]) -> ctypes.CDLL:
    """A built library with its entry points' argument and result types set."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildUnavailable(
            f"cannot load {path}: {e}; it is a cache entry: remove it, and the next run rebuilds it"
        ) from e
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib
