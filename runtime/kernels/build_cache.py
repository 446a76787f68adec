"""Compiled kernel libraries, built once per machine into the liteserve cache.

The C CPU kernels and the CUDA library share this: the file is named by a hash of everything
that went into it (source, flags, compiler, machine), compiled under a unique temporary name in
the cache directory and renamed into place, so a concurrent build or a killed one never leaves a
half-written library that a later run would load.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


class BuildUnavailable(RuntimeError):
    """A kernel library cannot be built or loaded here; the message says why."""


def cache_root() -> Path:
    root = os.environ.get("LITESERVE_CACHE") or Path.home() / ".cache" / "liteserve"
    return Path(root)


def cached_build(target: Path, compile_into: Callable[[str], None]) -> Path:
    """``target`` if it exists, else ``compile_into(tmp)`` then an atomic rename to it.
    ``compile_into`` raises BuildUnavailable when the compiler fails."""
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    except OSError as e:
        raise BuildUnavailable(
            f"cannot write the kernel cache {target.parent} ({e.strerror}); "
            "set LITESERVE_CACHE to a writable directory"
        ) from e
    os.close(fd)
    try:
        compile_into(tmp)
        os.replace(tmp, target)  # atomic: a concurrent build never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_typed(path: Path, signatures: dict[str, tuple[list, type | None]]) -> ctypes.CDLL:
    """A built library with its entry points' argument and result types set."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildUnavailable(f"cannot load {path}: {e}") from e
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib
