"""Faults at the edges (issue 16): a corrupted artifact shard refused at start-up with the file
named, and a disk that fills up while an artifact or a report is being replaced.

The full disk is real: a small tmpfs mounted for the test and filled with a filler file, so the
kernel itself fails the write partway with ENOSPC, wherever in the writing code it falls. That
needs root and mount(2) (as on the project's machines and CI); elsewhere those tests skip.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from lite.cli import main as lite_main
from lite.report import write_report
from runtime.artifact.manifest import MANIFEST_FILE
from runtime.artifact.reader import Artifact
from tests.conftest import make_tiny_model
from tests.test_report import make_report

ROOT = Path(__file__).resolve().parents[1]
DISK_BYTES = 32 * 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantize(model: Path, out: Path, *extra: str) -> Result:
    args = ["auto_awq", str(model), "--work-dir", str(out), "--calib-samples", "0", "--quiet"]
    return CliRunner().invoke(lite_main, [*args, *extra])


@pytest.fixture(scope="module")
def tiny_model(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("faults") / "model", tokenizer_dir)


@pytest.fixture
def small_disk(tmp_path: Path):
    """A DISK_BYTES tmpfs of its own, unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path, leave: int) -> None:
    """Take all but about `leave` bytes of the disk."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_a_corrupted_shard_is_refused_at_start_up_with_the_file_named(
    tiny_model: Path, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    assert _quantize(tiny_model, art).exit_code == 0
    shard = sorted(art.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, so only the checksum sees it
    shard.write_bytes(bytes(data))

    # the real `runtime serve` in its own process: it must exit, not start serving
    served = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", str(art), "--server-port", str(_free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert served.returncode != 0
    assert f"{shard} is corrupted" in served.stderr, served.stderr[-3000:]
    assert "sha256" in served.stderr


def test_a_full_disk_while_replacing_an_artifact_leaves_the_old_one(
    tiny_model: Path, small_disk: Path
) -> None:
    art = small_disk / "art"
    assert _quantize(tiny_model, art).exit_code == 0
    before = snapshot(art)
    size = sum(len(b) for b in before.values())
    fill(small_disk, leave=size // 2)  # room for half of the new one

    again = _quantize(tiny_model, art, "--w-group-size", "32", "--overwrite")
    assert again.exit_code != 0
    assert again.exit_code == 1, again.output  # a clear error, not a traceback
    assert "no space left on the device while writing" in again.output
    assert "previous artifact, if any, is unchanged" in again.output

    assert snapshot(art) == before  # not one byte of the old artifact changed
    Artifact(art, checksums=True)  # and it still verifies as a whole
    (small_disk / "filler").unlink()  # space again: the same command now succeeds
    assert _quantize(tiny_model, art, "--w-group-size", "32", "--overwrite").exit_code == 0
    manifest = json.loads((art / MANIFEST_FILE).read_text())
    assert manifest["quantization"]["group_size"] == 32


def test_a_full_disk_while_replacing_a_report_leaves_the_old_one(small_disk: Path) -> None:
    out = small_disk / "report"
    write_report(make_report(seed=0), out)
    before = snapshot(out)
    tasks = tuple(f"task_{i}" for i in range(80))  # a new results.json of about 60 KB
    bigger = make_report(seed=1, tasks=tasks)
    assert len(json.dumps(bigger, indent=2)) > 40_000
    fill(small_disk, leave=16 * 1024)  # so its write fails partway

    with pytest.raises(OSError) as failed:
        write_report(bigger, out)
    assert failed.value.errno == errno.ENOSPC
    assert snapshot(out) == before  # results.json, report.md and the chart as they were
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")], "a temporary was left"


def test_a_full_disk_under_the_cache_names_the_cache_not_the_work_dir(small_disk: Path) -> None:
    """A GGUF converted into a cache on a full disk was reported as the --work-dir's disk being
    full, naming a .partial that did not exist. safetensors' own writer fails here, as in the
    conversion: its error names the OS error only in its message."""
    import torch
    from safetensors.torch import save_file

    from runtime.cache import CacheUnwritable, cached_entry

    fill(small_disk, leave=64 * 1024)
    target = small_disk / "cache" / "gguf" / "entry"

    def convert(tmp: Path) -> None:
        save_file({"w": torch.randn(512, 1024)}, str(tmp / "model.safetensors"))  # 2 MiB

    with pytest.raises(CacheUnwritable) as failed:
        cached_entry(target, convert, directory=True)
    message = str(failed.value)
    assert f"cannot write the cache {target.parent}: no space left on the device" in message
    assert "free some space or choose another directory for LITESERVE_CACHE and rerun" in message
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == [".entry.lock"], (
        "a temporary was left"
    )


def test_a_file_size_limit_is_one_line_not_a_traceback(tiny_model: Path, tmp_path: Path) -> None:
    """`ulimit -f` (EFBIG), like a full disk or a quota, ended lite auto_awq in a traceback."""
    limit = 64 * 1024  # bytes: less than the tiny model's weights, more than anything else
    code = (
        "import resource, sys; from lite.cli import main; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY)); "
        "sys.argv[0] = 'lite'; main()"
    )
    out = tmp_path / "art"
    args = ["auto_awq", str(tiny_model), "--work-dir", str(out), "--calib-samples", "0", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "a file would pass the file-size limit (ulimit -f) while writing" in done.stderr
    assert "free some space or choose another --work-dir and rerun" in done.stderr
    assert not out.exists()
