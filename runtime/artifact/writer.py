"""Writing an artifact: shards, checksums, manifest last, then one atomic rename into place."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.artifact.manifest import (
    MANIFEST_FILE,
    MODEL_CARD_FILE,
    FileEntry,
    Manifest,
    TensorEntry,
)

MAX_SHARD_BYTES = 2 * 1024**3


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
    """A crash leaves the old file or the new one, never a torn one (resume relies on it)."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def write_json_atomic(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def write_shards(
    out_dir: Path,
    groups: Iterable[dict[str, torch.Tensor]],
    max_bytes: int = MAX_SHARD_BYTES,
    first: int = 1,
) -> dict[str, str]:
    """Write tensor groups (a group, e.g. one layer, never straddles shards); name -> file.
    Shards are numbered from `first`, after any the caller wrote itself."""
    where: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(set(where.values())) + first:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in shard.items()}, str(out_dir / name))
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


_SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}


def write_streamed(
    path: Path, name: str, shape: list[int], dtype: torch.dtype, chunks: Iterable[torch.Tensor]
) -> None:
    """One tensor written to a safetensors file from row chunks, so a 1 GiB embedding is never
    whole in memory. The header (JSON, space-padded to 8 bytes, after its little-endian u64
    length) is known from the shape alone; the chunks must cover the rows in order."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    entry = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [0, nbytes]}
    header = json.dumps({name: entry}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for chunk in chunks:
            data = chunk.to(dtype).contiguous().view(torch.uint8).numpy()
            f.write(data)
            written += data.nbytes
    if written != nbytes:
        tmp.unlink()
        raise ValueError(f"{path}: {name} got {written} bytes of data, its shape needs {nbytes}")
    os.replace(tmp, path)


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


def file_entries(out_dir: Path) -> dict[str, FileEntry]:
    """Checksums of every file but the manifest and the model card (which lite eval extends)."""
    return {
        p.name: FileEntry(sha256=sha256_file(p), size=p.stat().st_size)
        for p in sorted(out_dir.iterdir())
        if p.is_file() and p.name not in (MANIFEST_FILE, MODEL_CARD_FILE)
    }


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    write_json_atomic(manifest.model_dump(mode="json"), out_dir / MANIFEST_FILE)


def publish(staging: Path, target: Path, overwrite: bool) -> None:
    """Move a finished artifact into place in one rename; an old one is replaced only on request."""
    if target.exists():
        if not overwrite:
            raise FileExistsError(f"{target} already exists; pass --overwrite to replace it")
        trash = target.with_name(target.name + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(target, trash)
        os.replace(staging, target)
        shutil.rmtree(trash)
    else:
        os.replace(staging, target)
