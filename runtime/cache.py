"""The liteserve cache (``$LITESERVE_CACHE``, default ``~/.cache/liteserve``) and the one way
to write an entry into it.

Every cache write (a converted GGUF, a compiled kernel library, a converted checkpoint) goes
through :func:`cached_entry`, because two processes started together on a new machine (a CI
matrix, a server and an eval, two terminals) otherwise build the same entry at once and trip
over each other's half-written files. An entry is built under a unique temporary name in the
target's own directory (so the rename never crosses a file system), renamed into place
atomically, and guarded by a file lock so that the second process waits for the first and
reuses its result instead of building twice. Only the final name is ever trusted: a process
killed mid-write leaves a temporary that the next writer removes while it holds the lock.

Even the final name is checked before it is trusted, since a cache copied from another machine
(the CUDA library is built where nvcc is) or a failing disk can still truncate it: a damaged
entry is rebuilt, with a warning, instead of crashing the loader (a truncated library is a
SIGBUS) or being blamed on the user's model. The checks read sizes and headers, not hashes: an
entry is opened on every start, and a GGUF conversion is hundreds of MB.

Entries are never deleted behind the user's back (a GGUF conversion took minutes to make), but
a new liteserve or torch makes new keys and leaves the old entries unused, hundreds of MB each:
every use of an entry stamps its modification time, and :func:`prune` (`runtime cache prune`)
removes the entries not used for a while, each under its lock so no writer is cut short.

A leaf module: the kernels, the artifact code and ``lite`` all import it; it imports nothing of
the project.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

# A directory entry's list of its files and their sizes, written as the last step of its build.
ENTRY_RECORD = ".liteserve-entry.json"


class CacheUnwritable(RuntimeError):
    """The cache directory cannot be written; the message names it and the way out."""


# Write errors that are the disk's, not the program's, in words: full, over a quota or the
# process's file-size limit, read-only, failing.
DISK_ERRORS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file would pass the file-size limit (ulimit -f)",
    errno.EROFS: "it is on a read-only file system",
    errno.EIO: "an I/O error (a failing disk?)",
}


def disk_error(e: BaseException) -> int | None:
    """The errno of a write that failed for the disk, or None: from Python's OSError, or from
    safetensors' own error, whose Rust writer gives the OS error in its message only."""
    if isinstance(e, OSError):
        code = e.errno
    else:
        found = re.search(r"\(os error (\d+)\)", str(e))
        code = int(found.group(1)) if found else None
    return code if code in DISK_ERRORS else None


def disk_fix(code: int, where: str) -> str:
    """What to do about a disk error: another place when the disk is read-only."""
    return (
        f"choose another {where}"
        if code == errno.EROFS
        else f"free some space or choose another {where}"
    )


def cache_root() -> Path:
    env = os.environ.get("LITESERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "liteserve"


def entry_key(ident: dict) -> str:
    """An entry's name from everything that decides its bytes (the source's hashes, the
    versions and code that convert it): 16 hex digits of their canonical JSON's sha256."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cached_entry(
    target: Path,
    build: Callable[[Path], None],
    directory: bool = False,
    valid: Callable[[Path], bool] | None = None,
) -> Path:
    """``target`` once it exists whole; otherwise ``build(tmp)`` fills a fresh temporary path
    (an empty directory when ``directory``, else an empty file) that is then renamed to
    ``target``.

    ``valid(target)`` says whether an existing entry is whole; by default a directory must
    match the record of its files' sizes written when it was built (:func:`matches_record`) and
    a file need only exist. A damaged entry is removed and rebuilt, with a warning naming it.
    Exactly one process builds a given target at a time; the others block on its lock and,
    when they get it, find the target there and return it. ``build`` raising leaves nothing.
    """
    whole = valid or (matches_record if directory else Path.exists)
    if whole(target):
        _mark_used(target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock_for(target)
        _acquire(lock, target)
    except OSError as e:
        raise CacheUnwritable(
            f"cannot write the cache {target.parent} ({e.strerror or e}); "
            "set LITESERVE_CACHE to a writable directory"
        ) from e
    try:
        if whole(target):  # built by the process we waited for
            return target
        _remove_damaged(target)
        _remove_orphans(target)
        tmp = _fresh_tmp(target, directory)
        try:
            build(tmp)
            if directory:
                _write_record(tmp)
            give_umask_modes(tmp)
            os.replace(tmp, target)  # atomic: a reader sees the whole entry or none
        except Exception as e:
            if (code := disk_error(e)) is None:
                raise
            raise CacheUnwritable(  # not the --work-dir's disk, as the caller's error said
                f"cannot write the cache {target.parent}: {DISK_ERRORS[code]}; nothing was "
                f"left half-written: {disk_fix(code, 'directory for LITESERVE_CACHE')} and rerun"
            ) from e
        finally:
            _remove(tmp)
        return target
    finally:
        lock.release()


def _mark_used(target: Path) -> None:
    """Stamp the entry's time of last use, which :func:`prune` reads (a read-only cache, such
    as one baked into an image, is still used: it just keeps its stamps)."""
    with contextlib.suppress(OSError):
        os.utime(target)


@dataclass(frozen=True)
class Entry:
    kind: str  # the cache directory it is in: gguf, converted, native, cuda, dispatch
    path: Path
    size: int  # bytes, all its files
    used: float  # last use (or the build), seconds since the epoch


def list_entries(root: Path | None = None) -> list[Entry]:
    """Every entry in the cache, oldest use first; the locks and temporaries (dot names) are
    not entries."""
    root = cache_root() if root is None else root
    kinds = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    found = [
        Entry(kind.name, p, _size(p), p.lstat().st_mtime)
        for kind in kinds
        for p in kind.iterdir()
        if not p.name.startswith(".")
    ]
    return sorted(found, key=lambda e: e.used)


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    return path.lstat().st_size


def unused(entries: list[Entry], unused_for_s: float) -> list[Entry]:
    """The entries not used for `unused_for_s` seconds: what :func:`prune` removes."""
    cutoff = time.time() - unused_for_s
    return [e for e in entries if e.used <= cutoff]


def prune(entries: list[Entry], unused_for_s: float) -> tuple[list[Entry], list[Entry]]:
    """Remove the entries not used for `unused_for_s` seconds, with their orphaned
    temporaries; returns (removed, busy). Each is removed while holding its lock, so a process
    writing it is never cut short (that entry is busy and stays). A reader that has it open
    keeps its data (a mapped file outlives its name), and the next start rebuilds it. The lock
    files stay: deleting one another process may be waiting on would let two writers in."""
    cutoff = time.time() - unused_for_s
    removed: list[Entry] = []
    busy: list[Entry] = []
    for entry in unused(entries, unused_for_s):
        lock = _lock_for(entry.path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            busy.append(entry)
            continue
        try:
            if entry.path.lstat().st_mtime > cutoff:  # used since it was listed
                continue
            _remove_orphans(entry.path)
            _take_away(entry.path, "pruned")
            removed.append(entry)
        except FileNotFoundError:  # another prune took it
            continue
        finally:
            lock.release()
    return removed, busy


def matches_record(entry: Path) -> bool:
    """Whether the directory ``entry`` holds every file its record lists, each at its recorded
    size: what a cut-short copy or a failing disk breaks. An entry without a record (made
    before records were written, or never finished) does not match."""
    try:
        files = json.loads((entry / ENTRY_RECORD).read_text())["files"]
        return all((entry / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_record(entry: Path) -> None:
    """Record every file under ``entry`` and its size, for :func:`matches_record`."""
    files = {
        p.relative_to(entry).as_posix(): p.stat().st_size
        for p in sorted(entry.rglob("*"))
        if p.is_file()
    }
    (entry / ENTRY_RECORD).write_text(json.dumps({"files": files}, indent=1))


def _remove_damaged(target: Path) -> None:
    """Delete a ``target`` that failed its check (:func:`_take_away`: a failed delete leaves
    an orphan, not a half-deleted entry in the way of the rename)."""
    if target.exists() or target.is_symlink():
        log.warning("damaged cache entry %s: rebuilding it", target)
        _take_away(target, "damaged")


def _take_away(target: Path, why: str) -> None:
    """Delete an entry, first renaming it to a temporary's name: one step takes it from
    readers, and what a failed delete leaves is an orphan that a later writer removes."""
    aside = target.parent / f"{_tmp_prefix(target)}{why}-{os.urandom(4).hex()}"
    os.replace(target, aside)
    _remove(aside)


def _acquire(lock: FileLock, target: Path) -> None:
    """Take the lock, saying so in the log when another process holds it (a build can take
    minutes, and a silent wait looks like a hang)."""
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning("waiting for another process that is writing %s", target)
        lock.acquire()


def mkdir_mode(parent: Path) -> int:
    """What a new directory's mode is under this process's umask (read by making one: setting
    the umask to read it would race with other threads creating files)."""
    probe = parent / f".mode-{os.getpid()}-{os.urandom(4).hex()}"
    probe.mkdir()
    try:
        return probe.stat().st_mode & 0o7777
    finally:
        probe.rmdir()


def give_umask_modes(path: Path) -> None:
    """The modes mkdir and open would have given `path` and all it holds under this process's
    umask: tempfile's 0700 and 0600 (which a linker keeps) would lock a server running as
    another user out of an entry built ahead of time, as root in an image build, say."""
    base = mkdir_mode(path.parent)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            executable = p.is_dir() or p.stat().st_mode & 0o111
            os.chmod(p, base if executable else base & 0o666)


def _lock_for(target: Path) -> FileLock:
    """The lock every writer of ``target`` (and prune) takes, beside it."""
    return FileLock(target.parent / f".{target.name}.lock")


def _tmp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-"


def _fresh_tmp(target: Path, directory: bool) -> Path:
    prefix, suffix = _tmp_prefix(target), target.suffix
    if directory:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=target.parent)
    os.close(fd)
    return Path(name)


def _remove_orphans(target: Path) -> None:
    """Temporaries of ``target`` left by killed writers: safe to delete, since whoever holds
    the lock is the only one writing this target."""
    for orphan in target.parent.glob(_tmp_prefix(target) + "*"):
        log.info("removing %s, left by an interrupted write", orphan)
        _remove(orphan)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)
