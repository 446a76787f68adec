"""Reading and verifying an artifact. Every refusal says which of the failure kinds it is."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import safe_open

from runtime.artifact.manifest import (
    CHAT_TEMPLATE_FILE,
    FORMAT,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    Manifest,
)
from runtime.artifact.writer import sha256_file


class ArtifactError(Exception):
    """An artifact was refused; the message names the file and what is wrong with it."""


def read_manifest(path: str | Path) -> Manifest:
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory")
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        hint = (
            " (it looks like a Hugging Face model directory: quantize it first with "
            "`lite auto_awq`)"
            if (root / "config.json").is_file()
            else ""
        )
        raise ArtifactError(f"{root} is not a liteserve artifact: no {MANIFEST_FILE}{hint}")
    try:
        raw = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath} is corrupted: not valid JSON ({e})") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{root} is not a liteserve artifact: {mpath} has no format {FORMAT!r}")
    version = raw.get("schema_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{mpath} is corrupted: schema_version is missing")
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{root} was written with artifact schema {version}, newer than this liteserve "
            f"reads ({SCHEMA_VERSION}); upgrade liteserve"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        raise ArtifactError(f"{mpath} is corrupted: it does not match schema {version}: {e}") from e


def verify_files(root: Path, manifest: Manifest, checksums: bool = True) -> None:
    """Sizes always (cheap, catches truncation); sha256 of every byte when `checksums`."""
    for name, entry in manifest.files.items():
        fpath = root / name
        if not fpath.is_file():
            raise ArtifactError(f"{root} is incomplete: {name} is missing")
        size = fpath.stat().st_size
        if size != entry.size:
            raise ArtifactError(
                f"{fpath} is truncated or altered: {size} bytes, the manifest says {entry.size}"
            )
        if checksums and sha256_file(fpath) != entry.sha256:
            raise ArtifactError(f"{fpath} is corrupted: its sha256 does not match the manifest")
    for name, tensor in manifest.tensors.items():
        if tensor.file not in manifest.files:
            raise ArtifactError(f"{root}: tensor {name} points at unlisted file {tensor.file}")


class Artifact:
    """An opened, verified artifact; tensors are read lazily, one at a time."""

    def __init__(self, path: str | Path, checksums: bool = True) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        verify_files(self.path, self.manifest, checksums=checksums)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise ArtifactError(f"{self.path}: no tensor named {name}")
        with safe_open(str(self.path / entry.file), framework="pt") as f:
            t = f.get_tensor(name)
        if list(t.shape) != entry.shape:
            raise ArtifactError(
                f"{self.path / entry.file}: tensor {name} has shape {list(t.shape)}, "
                f"the manifest says {entry.shape}"
            )
        return t

    def has(self, name: str) -> bool:
        return name in self.manifest.tensors

    @property
    def chat_template(self) -> str | None:
        p = self.path / CHAT_TEMPLATE_FILE
        return p.read_text() if p.is_file() else None

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())
