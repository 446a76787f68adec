"""Damaged cache entries (a cut-short copy of a cache, a failing disk) are rebuilt, not trusted:
a truncated kernel library would die of SIGBUS in dlopen, and a truncated conversion would be
blamed on the user's model. Whole entries are reused without building.

Concurrency and killed writers are tests/test_cache_concurrency.py's.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from lite import sources
from runtime.cache import (
    ENTRY_RECORD,
    cache_root,
    cached_entry,
    list_entries,
    matches_record,
    prune,
)
from runtime.cli import main as runtime_main
from runtime.kernels import native
from runtime.kernels.build_cache import cached_build, is_whole_elf

TINY_C = "int answer(void) { return 42; }\n"


def _tiny_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(the C file, its library) built through the real kernel build into a fresh cache."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.c"
    source.write_text(TINY_C)
    return source, native.build(source)


def test_a_truncated_kernel_library_is_rebuilt_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The `cp -r` of a cache cut short: loading it as it is would kill the process (SIGBUS),
    so the size is checked before anything loads it."""
    source, library = _tiny_library(tmp_path, monkeypatch)
    size = library.stat().st_size
    os.truncate(library, size // 2)
    with caplog.at_level(logging.WARNING):
        assert native.build(source) == library
    assert library.stat().st_size == size and is_whole_elf(library)
    assert f"damaged cache entry {library}: rebuilding" in caplog.text
    assert ctypes.CDLL(str(library)).answer() == 42
    assert sorted(p.name for p in library.parent.iterdir()) == [
        f".{library.name}.lock",
        library.name,
    ]


def test_a_whole_kernel_library_is_not_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, library = _tiny_library(tmp_path, monkeypatch)

    def must_not_run(tmp: str) -> None:
        raise AssertionError("a whole library was compiled again")

    assert cached_build(library, must_not_run) == library


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: os.truncate(p, p.stat().st_size - 1),  # the section header table cut
        lambda p: os.truncate(p, 64),  # the header alone
        lambda p: p.write_bytes(b"half a library"),
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(p.read_bytes()[:4] + b"\x01" + p.read_bytes()[5:]),  # 32-bit
        lambda p: (p.unlink(), p.mkdir()),
    ],
    ids=["one-byte-short", "header-only", "not-elf", "empty", "elf32", "directory"],
)
def test_what_is_not_a_whole_library(
    damage: Callable[[Path], object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, library = _tiny_library(tmp_path, monkeypatch)
    assert is_whole_elf(library)
    damage(library)
    assert not is_whole_elf(library)


def _counted_build(runs: list[Path]) -> Callable[[Path], None]:
    """A directory entry's build, which notes each time it runs."""

    def build(tmp: Path) -> None:
        runs.append(tmp)
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)
        (tmp / "tokenizer.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "part.bin").write_bytes(b"p" * 10)

    return build


def _truncate(entry: Path) -> None:
    os.truncate(entry / "model.safetensors", 500)


def _empty(entry: Path) -> None:
    shutil.rmtree(entry)
    entry.mkdir()


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        lambda e: (e / "tokenizer.json").unlink(),
        lambda e: (e / "sub" / "part.bin").write_bytes(b"longer than it was"),
        _empty,
        lambda e: (e / ENTRY_RECORD).unlink(),  # an entry made before records were written
        lambda e: (e / ENTRY_RECORD).write_text("[]"),
    ],
    ids=["truncated", "file-missing", "file-grown", "empty", "no-record", "record-not-ours"],
)
def test_a_damaged_directory_entry_is_rebuilt(
    damage: Callable[[Path], object], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target, runs = tmp_path / "cache" / "entry", []
    build = _counted_build(runs)
    assert cached_entry(target, build, directory=True) == target
    damage(target)
    assert not matches_record(target)
    with caplog.at_level(logging.WARNING):
        assert cached_entry(target, build, directory=True) == target
    assert len(runs) == 2 and matches_record(target)
    assert (target / "model.safetensors").stat().st_size == 1000
    assert f"damaged cache entry {target}: rebuilding" in caplog.text
    assert sorted(p.name for p in target.parent.iterdir()) == [".entry.lock", "entry"]


def test_a_directory_entry_records_its_files(tmp_path: Path) -> None:
    target = cached_entry(tmp_path / "entry", _counted_build([]), directory=True)
    record = json.loads((target / ENTRY_RECORD).read_text())
    assert record == {"files": {"model.safetensors": 1000, "sub/part.bin": 10, "tokenizer.json": 2}}


def test_a_whole_directory_entry_is_not_rebuilt(tmp_path: Path) -> None:
    target = cached_entry(tmp_path / "entry", _counted_build([]), directory=True)

    def must_not_run(tmp: Path) -> None:
        raise AssertionError("a whole entry was rebuilt")

    assert cached_entry(target, must_not_run, directory=True) == target


def test_a_damaged_gguf_conversion_is_redone_not_blamed_on_the_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lite/sources.py's entry, with a conversion that writes a small HF directory (the real
    one loads a model through transformers): the truncated weights are converted again, and
    the source is still the user's GGUF."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    runs = []

    def convert(gguf: Path, out: Path) -> None:
        runs.append(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(sources, "convert_gguf", convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    first = sources.resolve(str(gguf))
    (first.path / "tokenizer.json").unlink()
    again = sources.resolve(str(gguf))
    assert again.path == first.path and len(runs) == 2
    assert (again.path / "tokenizer.json").is_file()
    assert again.files == first.files == {"model.gguf": first.files["model.gguf"]}


def test_a_damaged_checkpoint_conversion_is_redone(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """runtime/artifact/convert.py's entry (what `runtime serve CHECKPOINT` opens): a truncated
    shard in the conversion is converted again, and the result verifies."""
    from runtime.artifact.convert import served_artifact
    from runtime.artifact.reader import Artifact
    from tests.test_interop import make_checkpoint

    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    converted = served_artifact(src)
    shard = next(converted.glob("*.safetensors"))
    os.truncate(shard, shard.stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        assert served_artifact(src) == converted
    assert f"damaged cache entry {converted}: rebuilding" in caplog.text
    Artifact(converted)  # opening verifies every file's size and sha256


def test_the_cache_root_expands_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LITESERVE_CACHE", "~/cache")
    assert cache_root() == tmp_path / "cache"


def test_conversions_are_keyed_by_the_code_that_makes_them(monkeypatch) -> None:
    """A conversion made before a fix to the converter (or to transformers' GGUF reader) was
    served after it: the source's bytes alone named the entry."""
    import transformers

    from runtime.artifact import convert

    files = {"config.json": "0" * 64}
    key, gguf_key = convert.cache_key(files), sources._gguf_key("1" * 64)
    assert convert.cache_key({"config.json": "2" * 64}) != key
    monkeypatch.setattr(convert, "converter_hash", lambda: "other code")
    assert convert.cache_key(files) != key
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    assert sources._gguf_key("1" * 64) != gguf_key


def _entry_dir(target: Path) -> Path:
    def build(tmp: Path) -> None:
        (tmp / "weights.bin").write_bytes(os.urandom(3000))

    return cached_entry(target, build, directory=True)


def _age(path: Path, days: float) -> None:
    when = time.time() - days * 86400
    os.utime(path, (when, when))


def test_using_an_entry_stamps_its_last_use(tmp_path: Path) -> None:
    """What prune reads: an entry built long ago and used today is not unused."""
    target = _entry_dir(tmp_path / "gguf" / "abc")
    _age(target, 40)
    assert _entry_dir(target) == target
    assert time.time() - target.stat().st_mtime < 60


def test_prune_removes_the_unused_entries_and_keeps_the_rest(tmp_path: Path) -> None:
    old = _entry_dir(tmp_path / "gguf" / "old")
    recent = _entry_dir(tmp_path / "gguf" / "recent")
    lib = tmp_path / "native" / "k.so"
    lib.parent.mkdir()
    lib.write_bytes(os.urandom(100))
    orphan = tmp_path / "gguf" / ".old.tmp-killed"  # a writer of `old` killed mid-build
    orphan.mkdir()
    _age(old, 40)
    _age(lib, 31)
    _age(recent, 2)
    entries = list_entries(tmp_path)
    assert [(e.kind, e.path.name) for e in entries] == [
        ("gguf", "old"),
        ("native", "k.so"),
        ("gguf", "recent"),
    ]
    assert entries[0].size == 3000 + (old / ENTRY_RECORD).stat().st_size
    removed, busy = prune(entries, unused_for_s=30 * 86400)
    assert [e.path.name for e in removed] == ["old", "k.so"] and busy == []
    assert not old.exists() and not lib.exists() and not orphan.exists()
    assert matches_record(recent)
    left = sorted(p.name for p in (tmp_path / "gguf").iterdir())
    assert left == [".old.lock", ".recent.lock", "recent"]  # the locks stay: see prune


def test_prune_leaves_an_entry_another_process_is_writing(tmp_path: Path) -> None:
    """Its lock is held (a rebuild under way): removing it would pull the entry from under the
    writer, whose rename then lands on nothing it expects."""
    entry = _entry_dir(tmp_path / "converted" / "busy")
    _age(entry, 60)
    held = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
            "lock.acquire(); print('held', flush=True); time.sleep(60)",
            str(entry.parent / ".busy.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout.readline().strip() == "held"
        removed, busy = prune(list_entries(tmp_path), unused_for_s=0)
    finally:
        held.kill()
        held.wait()
    assert removed == [] and [e.path.name for e in busy] == ["busy"] and matches_record(entry)


def test_runtime_cache_list_and_prune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    old = _entry_dir(tmp_path / "gguf" / "old")
    recent = _entry_dir(tmp_path / "gguf" / "recent")
    _age(old, 45)
    listed = CliRunner().invoke(runtime_main, ["cache", "list"])
    assert listed.exit_code == 0, listed.output
    assert "45d ago" in listed.output and "gguf/old" in listed.output
    assert f"2 entries, 0.0 MiB in {tmp_path}" in listed.output

    dry = CliRunner().invoke(runtime_main, ["cache", "prune", "--dry-run"])
    assert dry.exit_code == 0 and "would remove gguf/old" in dry.output and old.exists()
    pruned = CliRunner().invoke(runtime_main, ["cache", "prune", "--unused-for", "30d"])
    assert pruned.exit_code == 0 and "removed 1 of 2 entries" in pruned.output, pruned.output
    assert not old.exists() and recent.exists()

    bad = CliRunner().invoke(runtime_main, ["cache", "prune", "--unused-for", "30"])
    assert bad.exit_code == 2 and "not an age; write e.g. 30d" in bad.output
    assert recent.exists()
