"""Writing an artifact: shards, checksums, manifest last, then one atomic rename into place."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.artifact.manifest import (
    FORMAT,
    MANIFEST_FILE,
    MODEL_CARD_FILE,
    FileEntry,
    Manifest,
    TensorEntry,
)
from runtime.cache import give_umask_modes, mkdir_mode

MAX_SHARD_BYTES = 2 * 1024**3
EXPORT_MARKER = ".liteserve-export.json"  # in an export's directory: the files it wrote
EXPORT_FORMAT = "liteserve-export"
MARKER_FORMATS = {MANIFEST_FILE: FORMAT, EXPORT_MARKER: EXPORT_FORMAT}


def utc_now() -> str:
    """UTC now, or SOURCE_DATE_EPOCH when set: the reproducible-builds convention, so two
    separate runs can be compared byte for byte."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def save_tensors_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A crash leaves the old file or the new one, never a torn one (resume relies on it):
    synced before the rename, as the run's state.json that counts it is, or a power loss
    could keep the count and lose the file's data."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(obj: object, path: Path) -> None:
    """Written under a temporary name no other writer uses, synced, then renamed over `path`:
    with one shared name, two processes writing the same manifest renamed each other's file
    away (FileNotFoundError), and a failed write left the temporary file in the artifact."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        give_umask_modes(tmp)  # mkstemp's 0600 would keep out a server running as another user
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _HashingFile:
    """A file written front to back under a temporary name, its sha256 taken on the way by a
    second thread while this one writes (both release the GIL): checksumming 5 GB of shards
    by reading them back, or in line with the writes, costs seconds."""

    def __init__(self, path: Path) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed by commit or discard)
        self.digest, self.size = hashlib.sha256(), 0
        self.hasher = ThreadPoolExecutor(1)  # one worker: the updates run in write order
        self.pending: list[Future] = []

    def write(self, data: bytes | memoryview) -> None:
        self.pending.append(self.hasher.submit(self.digest.update, data))
        self.file.write(data)
        self.size += len(data)

    def _close(self) -> None:
        self.file.close()
        for update in self.pending:
            update.result()
        self.hasher.shutdown()

    def commit(self) -> FileEntry:
        self._close()
        os.replace(self.tmp, self.path)
        return FileEntry(sha256=self.digest.hexdigest(), size=self.size)

    def discard(self) -> None:
        self._close()
        self.tmp.unlink(missing_ok=True)


_SAFETENSORS_DTYPES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


def _header(entries: dict[str, tuple[torch.dtype, list[int]]]) -> tuple[bytes, int]:
    """safetensors' header for tensors stored back to back in this order (its little-endian
    u64 length, then JSON space-padded to 8 bytes), and the data's total size. Written by
    hand because safetensors' own writer takes whole tensors and returns no checksum."""
    index: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in entries.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        index[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(index, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header, offset


def _data(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> FileEntry:
    """A safetensors file (widest dtypes first, so every tensor is aligned to its element
    size), written atomically; its checksum."""
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header, _ = _header({n: (tensors[n].dtype, list(tensors[n].shape)) for n in order})
    out = _HashingFile(path)
    try:
        out.write(header)
        for name in order:
            out.write(_data(tensors[name]))
    except BaseException:
        out.discard()
        raise
    return out.commit()


def write_shards(
    out_dir: Path,
    groups: Iterable[dict[str, torch.Tensor]],
    max_bytes: int = MAX_SHARD_BYTES,
    first: int = 1,
    checksums: dict[str, FileEntry] | None = None,
) -> dict[str, str]:
    """Write tensor groups (a group, e.g. one layer, never straddles shards); name -> file.
    Shards are numbered from `first`, after any the caller wrote itself; each shard's
    checksum goes into `checksums` when given (for file_entries)."""
    where: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(where.values())) + first:05d}.safetensors"
            entry = write_tensors(out_dir / name, shard)
            if checksums is not None:
                checksums[name] = entry
            where.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for group in groups:
        group_bytes = sum(t.numel() * t.element_size() for t in group.values())
        if shard and size + group_bytes > max_bytes:
            flush()
        shard.update(group)
        size += group_bytes
    flush()
    return where


def write_streamed(
    path: Path, name: str, shape: list[int], dtype: torch.dtype, chunks: Iterable[torch.Tensor]
) -> FileEntry:
    """One tensor written to a safetensors file from row chunks, so a 1 GiB embedding is never
    whole in memory; the chunks must cover the rows in order. Its checksum."""
    header, nbytes = _header({name: (dtype, shape)})
    out = _HashingFile(path)
    try:
        out.write(header)
        for chunk in chunks:
            out.write(_data(chunk.to(dtype)))
        if out.size != len(header) + nbytes:
            raise ValueError(
                f"{path}: {name} got {out.size - len(header)} bytes of data, its shape needs "
                f"{nbytes}"
            )
    except BaseException:
        out.discard()
        raise
    return out.commit()


def tensor_entries(
    out_dir: Path,
    where: dict[str, str],
    linear_shapes: dict[str, tuple[int, int]],
    padded_shapes: dict[str, tuple[int, int]],
) -> dict[str, TensorEntry]:
    """Describe every stored tensor from the files themselves, so the manifest cannot drift."""
    entries: dict[str, TensorEntry] = {}
    for file in sorted(set(where.values())):
        with safe_open(str(out_dir / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(name)
                prefix, _, suffix = name.rpartition(".")
                kind = suffix if suffix in ("qweight", "qparams") else "dense"
                entries[name] = TensorEntry(
                    file=file,
                    dtype=str(sl.get_dtype()),
                    shape=list(sl.get_shape()),
                    kind=kind,
                    logical_shape=list(linear_shapes[prefix]) if kind != "dense" else None,
                    padded_shape=list(padded_shapes[prefix]) if kind != "dense" else None,
                )
    return dict(sorted(entries.items()))


def file_entries(out_dir: Path, known: dict[str, FileEntry] | None = None) -> dict[str, FileEntry]:
    """Checksums of every file but the manifest and the model card (which lite eval extends);
    those `known` from writing them are taken as they are."""
    known = known or {}
    return {
        p.name: known.get(p.name) or FileEntry(sha256=sha256_file(p), size=p.stat().st_size)
        for p in sorted(out_dir.iterdir())
        if p.is_file() and p.name not in (MANIFEST_FILE, MODEL_CARD_FILE)
    }


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    write_json_atomic(manifest.model_dump(mode="json"), out_dir / MANIFEST_FILE)


def check_replaceable(target: Path, overwrite: bool, marker: str = MANIFEST_FILE) -> None:
    """Whether ``target`` may be written: absent, or, with --overwrite, what this tool writes
    there (a directory holding ``marker``, an artifact's manifest or an export's config) or an
    empty directory. --overwrite deletes the old target, so it never takes anything else: not
    a file, not a directory of the user's, not files the user added to an artifact."""
    if not target.name:
        raise ValueError(f"{str(target)!r} names no directory of its own: name the output's")
    if not (target.exists() or target.is_symlink()):
        return
    if not overwrite:
        if target.is_symlink() or not target.is_dir():
            why: str | None = "is not a directory this tool wrote"
        else:
            why = _not_written_here(target, marker)
        advice = (
            "pass --overwrite to replace it"
            if why is None
            else f"it {why}, which --overwrite does not replace either: choose another output"
        )
        raise FileExistsError(f"{target} already exists; {advice}{_stale_partial(target)}")
    if target.is_symlink():
        raise FileExistsError(
            f"{target} is a symbolic link, so --overwrite will not replace it; give the "
            "directory it points to"
        )
    if not target.is_dir():
        raise FileExistsError(f"{target} is not a directory, so --overwrite will not delete it")
    why = _not_written_here(target, marker)
    if why:
        raise FileExistsError(
            f"{target} {why}: it is not only what this tool wrote, so --overwrite will not "
            "delete it; choose another output, or remove it yourself"
        )


def staging_dir(target: Path, kind: str) -> Path:
    """A unique hidden directory beside `target` to build it in (`kind`: export, convert),
    published by one rename. A run killed by SIGKILL runs no cleanup and leaves its own (the
    whole output's size, GBs on a large model), which nothing ever mentioned: they are named
    here, for the user to remove (another run writing `target` right now owns one too)."""
    for left in sorted(target.parent.glob(f".{glob.escape(target.name)}.{kind}-*")):
        size = sum(f.stat().st_size for f in left.rglob("*") if f.is_file())
        logging.getLogger(__name__).warning(
            "%s (%.1f MiB) is left from an interrupted %s of %s: rm -r %s, unless another %s "
            "of it is running now",
            left, size / 2**20, kind, target, left, kind,
        )  # fmt: skip
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-", dir=target.parent))


def _stale_partial(target: Path) -> str:
    """A run killed after publishing its artifact, before deleting its state, leaves that
    state (GBs of calibration inputs on a large model) beside it."""
    partial = target.with_name(target.name + ".partial")
    if partial.is_dir() and (partial / "state.json").is_file():
        return f" ({partial} is left from an earlier run; rm -r {partial} if it is done)"
    return ""


def write_export_marker(out_dir: Path) -> None:
    """List the files of a finished export (lite export), so that --overwrite can tell it
    from a quantized checkpoint a user downloaded, which has the same config.json."""
    files = sorted(p.name for p in out_dir.iterdir() if p.name != EXPORT_MARKER)
    write_json_atomic({"format": EXPORT_FORMAT, "files": files}, out_dir / EXPORT_MARKER)


def _not_written_here(target: Path, marker: str) -> str | None:
    """Why ``target`` is more than an output of this tool, or None: it must hold the marker
    (an artifact's manifest, an export's list), and only the files the marker lists. A file
    merely named like the marker is not enough: a web app has a manifest.json."""
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return None
    if not (target / marker).is_file():
        return f"holds files but no {marker}"
    try:
        data = json.loads((target / marker).read_text())
    except (OSError, ValueError):
        return f"holds a {marker} that is not JSON"
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMATS[marker]:
        return f"holds a {marker} that is not liteserve's"
    listed = {*(data.get("files") or {}), marker}
    if marker == MANIFEST_FILE:
        listed.add(MODEL_CARD_FILE)  # lite eval --update-card writes it
    extra = [e for e in entries if e not in listed]
    return f"holds files its {marker} does not list ({', '.join(extra[:5])})" if extra else None


def publish(staging: Path, target: Path, overwrite: bool, marker: str = MANIFEST_FILE) -> None:
    """Move a finished artifact into place in one rename; an old one is replaced only on request
    (and only what check_replaceable allows). The directory gets the mode mkdir gives here:
    tempfile.mkdtemp's 0700 would keep out a server running under another user."""
    os.chmod(staging, mkdir_mode(staging.parent))
    check_replaceable(target, overwrite, marker)
    if target.exists():  # out of the way under a name no one else uses, then deleted
        trash = target.with_name(f".{target.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        os.replace(target, trash)
        os.replace(staging, target)
        shutil.rmtree(trash)
    else:
        os.replace(staging, target)
