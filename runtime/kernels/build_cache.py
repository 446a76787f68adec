"""Compiled kernel libraries, built once per machine into the liteserve cache.

The C CPU kernels and the CUDA library share this: the file is named by a hash of everything
that went into it (source, flags, compiler, machine), compiled through runtime/cache.py's
cached_entry (a unique temporary name, an atomic rename, a file lock), so concurrent processes
compile it once and a killed build never leaves a half-written library that a later run loads.
A library already there is checked to be a whole ELF file before it is loaded, since dlopen
maps a truncated one (a cut-short copy of a cache built elsewhere) and dies of SIGBUS.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from runtime.cache import CacheUnwritable, cached_entry

log = logging.getLogger(__name__)

# The 64-bit little-endian ELF header (what cc and nvcc build here): identification, then from
# e_type to e_shstrndx; and a program header (p_type to p_align).
_ELF_IDENT = b"\x7fELF\x02\x01"
_ELF_HEADER = struct.Struct("<16xHHIQQQIHHHHHH")
_PROGRAM_HEADER = struct.Struct("<IIQQQQQQ")


class BuildUnavailable(RuntimeError):
    """A kernel library cannot be built or loaded here; the message says why."""


def cached_build(target: Path, compile_into: Callable[[str], None]) -> Path:
    """``target`` if it is a whole library, else ``compile_into(tmp)`` then an atomic rename to
    it, under the cache's lock (runtime/cache.py), so concurrent processes compile it once.
    ``compile_into`` raises BuildUnavailable when the compiler fails."""

    def build(tmp: Path) -> None:
        compile_into(str(tmp))
        if not is_whole_elf(tmp):  # a compiler that exits 0 without writing its output
            raise BuildUnavailable(
                f"the compiler exited 0 but wrote no shared library for {target.name}: "
                "check the compiler (CC, NVCC) and rerun"
            )

    try:
        return cached_entry(target, build, valid=is_whole_elf)
    except CacheUnwritable as e:
        return _private_build(target.name, build, e)


def _private_build(name: str, build: Callable[[Path], None], why: CacheUnwritable) -> Path:
    """The library built for this process alone, in a temporary directory removed at exit: a
    read-only home (a container's read-only root) fell back to torch's ops, several times
    slower and with other numbers. Every start compiles it again, hence the warning."""
    log.warning(
        "cannot write the kernel cache (%s): building %s for this process only, again at "
        "every start",
        why,
        name,
    )
    private = Path(tempfile.mkdtemp(prefix="liteserve-kernels-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    library = private / name
    build(library)
    return library


def is_whole_elf(path: Path) -> bool:
    """Whether ``path`` is a 64-bit little-endian ELF file holding every byte its headers
    point at: its section header table (which linkers put at the end, so a truncation cuts it
    first) and each segment that dlopen maps. A read of the headers, not a hash, as it runs on
    every load; anything unreadable or unparsable is not whole."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header = f.read(_ELF_HEADER.size)
            if len(header) < _ELF_HEADER.size or not header.startswith(_ELF_IDENT):
                return False
            fields = _ELF_HEADER.unpack(header)
            phoff, shoff, phentsize, phnum, shentsize, shnum = (*fields[4:6], *fields[8:12])
            if shoff + shnum * shentsize > size or phoff + phnum * phentsize > size:
                return False
            if phnum and phentsize < _PROGRAM_HEADER.size:
                return False
            f.seek(phoff)
            table = f.read(phnum * phentsize)
    except OSError:
        return False
    return all(_segment_end(table, i * phentsize) <= size for i in range(phnum))


def _segment_end(table: bytes, at: int) -> int:
    """Where in the file the segment that the program header at ``at`` describes ends."""
    _, _, offset, _, _, filesz, _, _ = _PROGRAM_HEADER.unpack_from(table, at)
    return offset + filesz


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
