"""Reading and verifying an artifact. Every refusal says which of the failure kinds it is."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open

from runtime.artifact.layout import (
    LAYOUT_NAME,
    LAYOUT_VERSION,
    TILE,
    qparams_shape,
    qweight_shape,
)
from runtime.artifact.manifest import (
    CHAT_TEMPLATE_FILE,
    FORMAT,
    MANIFEST_FILE,
    MODEL_CARD_FILE,
    SCHEMA_VERSION,
    Manifest,
    TensorEntry,
)
from runtime.artifact.writer import _SAFETENSORS_DTYPES, sha256_file
from runtime.validation import validation_message

Range = tuple[int, int | None]  # [start, stop) of a tensor's dimension; None runs to the end
Span = tuple[int, int]  # [start, stop) of a linear's logical columns or rows
_ITEMSIZE = {name: dtype.itemsize for dtype, name in _SAFETENSORS_DTYPES.items()}
_STORED_SHAPES = {"qweight": qweight_shape, "qparams": qparams_shape}
_NOT_IN_A_NAME = ("/", "\\", "\0")  # path separators (POSIX, Windows) and what ends a C string


class ArtifactError(Exception):
    """An artifact was refused; the message names the file and what is wrong with it."""


def read_manifest(path: str | Path) -> Manifest:
    root = Path(path)
    if root.is_file():
        hint = "a GGUF file: quantize it first with `lite auto_awq FILE --work-dir DIR`"
        raise ArtifactError(
            f"{root} is a file, not an artifact directory"
            + (f" ({hint})" if root.suffix.lower() == ".gguf" else "")
        )
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory")
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        from runtime.artifact.convert import is_quantized_checkpoint  # only on this error

        hint = ""
        if is_quantized_checkpoint(root):
            hint = (
                " (it is a quantized Hugging Face checkpoint: `runtime serve`, `check` and "
                "`plan` take it as it is; `lite convert` makes it an artifact)"
            )
        elif (root / "config.json").is_file():
            hint = (
                " (it looks like a Hugging Face model directory: quantize it first with "
                "`lite auto_awq`)"
            )
        elif (root / "state.json").is_file():  # lite auto_awq's WORK_DIR.partial/
            hint = (
                " (it is an unfinished `lite auto_awq` run: rerun the same command to finish "
                "it, then give its --work-dir)"
            )
        raise ArtifactError(f"{root} is not a liteserve artifact: no {MANIFEST_FILE}{hint}")
    try:
        raw = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath} is corrupted: not valid JSON ({e})") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{root} is not a liteserve artifact: {mpath} has no format {FORMAT!r}")
    version = raw.get("schema_version")
    if version is None:
        raise ArtifactError(f"{mpath} is corrupted: schema_version is missing")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ArtifactError(f"{mpath} is corrupted: schema_version {version!r} is no schema")
    if version > SCHEMA_VERSION:
        raise ArtifactError(
            f"{root} was written with artifact schema {version}, newer than this liteserve "
            f"reads ({SCHEMA_VERSION}); upgrade liteserve"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        raise ArtifactError(
            f"{mpath} is corrupted: it does not match schema {version}: {validation_message(e)[0]}"
        ) from e
    _check_layout(mpath, manifest)
    _check_file_names(mpath, manifest)
    _check_layers(mpath, manifest)
    _check_head(mpath, manifest)
    _check_shapes(mpath, manifest)
    _check_token_ids(mpath, manifest)
    return manifest


def _check_token_ids(mpath: Path, manifest: Manifest) -> None:
    """Ids the engine stops on or starts with: one outside the vocabulary refused every
    request for a stop id it never sent (or, `runtime check` found, failed the first step)."""
    a, vocab = manifest.architecture, manifest.architecture.vocab_size
    fields = {
        "generation.stop_token_ids": manifest.generation.stop_token_ids,
        "architecture.eos_token_ids": a.eos_token_ids,
        "architecture.bos_token_id": [] if a.bos_token_id is None else [a.bos_token_id],
    }
    for name, ids in fields.items():
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise ArtifactError(
                f"{mpath} is corrupted: {name} {outside[:5]} are outside the vocabulary "
                f"(0..{vocab - 1})"
            )


def _check_layout(mpath: Path, manifest: Manifest) -> None:
    """The weights are in the one layout this reader unpacks: another name or version loaded
    silently, and the kernels read its words as if they were this layout's."""
    theirs = (manifest.layout.name, manifest.layout.version)
    if theirs != (LAYOUT_NAME, LAYOUT_VERSION):
        raise ArtifactError(
            f"{mpath} stores its weights in layout {theirs[0]} version {theirs[1]}; this "
            f"liteserve implements only {LAYOUT_NAME} version {LAYOUT_VERSION} (an artifact from "
            "a newer liteserve: upgrade liteserve)"
        )


def _check_file_names(mpath: Path, manifest: Manifest) -> None:
    """Every file the manifest names is a plain name inside the artifact directory: with a
    separator or `..` it was read from outside, and the artifact no longer held all it served."""
    names = [*manifest.files, *(entry.file for entry in manifest.tensors.values())]
    for name in names:
        if name in ("", ".", "..") or any(c in name for c in _NOT_IN_A_NAME):
            raise ArtifactError(
                f"{mpath} is corrupted: {name!r} is not the name of a file in the artifact "
                "directory (a path separator or ..)"
            )


def _check_shapes(mpath: Path, manifest: Manifest) -> None:
    """Every tensor has the shape the architecture gives it: heads or widths edited in a
    config (or a manifest) loaded, then the C kernels read past the real tensors."""
    arch = manifest.architecture
    for name, entry in manifest.tensors.items():
        quantized = entry.kind != "dense"
        shape = entry.logical_shape if quantized else entry.shape
        expected = arch.logical_shape(name.rsplit(".", 1)[0] if quantized else name)
        if expected is not None and shape != expected:
            raise ArtifactError(
                f"{mpath} is corrupted: {name} is {shape} where the architecture "
                f"({arch.shape_summary()}) makes it {expected}"
            )
        if quantized:
            _check_stored_shape(mpath, name, entry, manifest.quantization.group_size)


def _check_stored_shape(mpath: Path, name: str, entry: TensorEntry, group_size: int) -> None:
    """A quantized tensor is stored as the layout lays out its logical shape in groups of
    `group_size`: a group size edited by hand verified, then every group was scaled by
    another group's parameters (garbage out)."""
    if entry.logical_shape is None or len(entry.logical_shape) != 2:
        raise ArtifactError(f"{mpath} is corrupted: {name} has no logical [N, K] shape")
    n, k = entry.logical_shape
    try:
        expected = list(_STORED_SHAPES[entry.kind](n, k, group_size))
    except ValueError as e:  # a group size the layout has not, or a dimension under 1
        raise ArtifactError(f"{mpath} is corrupted: {name}: {e}") from e
    if entry.shape != expected:
        raise ArtifactError(
            f"{mpath} is corrupted: {name} is stored as {entry.shape} where the layout makes "
            f"it {expected} (logical [N, K] {[n, k]}, quantization.group_size {group_size})"
        )


def _check_head(mpath: Path, manifest: Manifest) -> None:
    """Untied embeddings need their own lm_head: without it the artifact verified and
    exported (transformers then loaded a random head) and failed only in the engine."""
    if not manifest.architecture.tie_word_embeddings and "lm_head.weight" not in manifest.tensors:
        raise ArtifactError(
            f"{mpath} is corrupted: architecture.tie_word_embeddings is false and its tensors "
            "hold no lm_head.weight"
        )


def _check_layers(mpath: Path, manifest: Manifest) -> None:
    """The tensors hold exactly the layers the architecture counts: a count edited by hand
    verified, then failed at load with a KeyError on the missing layer's first tensor."""
    prefix = "model.layers."
    held = {int(n[len(prefix) :].split(".")[0]) for n in manifest.tensors if n.startswith(prefix)}
    count = manifest.architecture.num_layers
    if held != set(range(count)):
        found = f"layers {min(held)}..{max(held)} ({len(held)})" if held else "no layers"
        raise ArtifactError(
            f"{mpath} is corrupted: architecture.num_layers is {count} and its tensors hold {found}"
        )


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
    by_file: dict[str, list[str]] = {}
    for name, tensor in manifest.tensors.items():
        if tensor.file not in manifest.files:
            raise ArtifactError(f"{root}: tensor {name} points at unlisted file {tensor.file}")
        by_file.setdefault(tensor.file, []).append(name)
    for file, names in by_file.items():
        _check_headers(root / file, {n: manifest.tensors[n] for n in names})


def _check_headers(fpath: Path, entries: dict[str, TensorEntry]) -> None:
    """Each tensor's dtype and shape in the file's header (read, not the data) as the manifest
    lists them: an edited manifest's dtype passed `runtime verify`, and plans sized from it."""
    try:
        with safe_open(str(fpath), framework="pt") as f:
            stored = set(f.keys())
            for name, entry in entries.items():
                if name not in stored:
                    raise ArtifactError(f"{fpath}: no tensor {name}, which the manifest lists")
                part = f.get_slice(name)
                dtype, shape = part.get_dtype(), list(part.get_shape())
                if (dtype, shape) != (entry.dtype, entry.shape):
                    raise ArtifactError(
                        f"{fpath}: tensor {name} is stored as {dtype} {shape}, the manifest "
                        f"says {entry.dtype} {entry.shape}"
                    )
    except SafetensorError as e:
        raise ArtifactError(f"{fpath} is not a readable safetensors file ({e})") from e


def linear_slices(
    n: int, k: int, group_size: int, cols: Span | None, rows: Span | None
) -> tuple[tuple[Range, Range], tuple[Range, Range]]:
    """The (rows, cols) of qweight and of qparams that hold a linear's output columns
    [n0, n1) and input rows [k0, k1): the layout's sharding (docs/artifact-layout.md, section
    8), cut straight out of the packed tensors, no unpacking. n0 must be a multiple of 64 and
    k0 of the group size (a tensor-parallel plan guarantees it); a slice ending at N or K runs
    to the padded end."""
    (n0, n1), (k0, k1) = cols or (0, n), rows or (0, k)
    qcols = (2 * n0, 2 * n1 if n1 < n else None)  # two int32 words per column
    pcols = (n0, n1 if n1 < n else None)
    qrows = (k0 // TILE, k1 // TILE if k1 < k else None)
    prows = (k0 // group_size, k1 // group_size if k1 < k else None)
    return (qrows, qcols), (prows, pcols)


class Artifact:
    """An opened, verified artifact; tensors are read lazily, one at a time."""

    def __init__(self, path: str | Path, checksums: bool = True) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        verify_files(self.path, self.manifest, checksums=checksums)

    def tensor(
        self, name: str, rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor:
        """The whole tensor, or only rows [r0, r1) and/or columns [c0, c1) of it (a stop of
        None runs to the end): safetensors reads just that slice from the file, so a
        tensor-parallel rank never holds the rest."""
        entry = self.manifest.tensors.get(name)
        if entry is None:
            raise ArtifactError(f"{self.path}: no tensor named {name}")
        fpath = self.path / entry.file
        try:
            with safe_open(str(fpath), framework="pt") as f:
                part = f.get_slice(name)
                if rows is None and cols is None:  # dtype and shape were checked at open
                    return f.get_tensor(name)
                r, c = slice(*(rows or (None, None))), slice(*(cols or (None, None)))
                return part[r] if len(entry.shape) == 1 else part[r, c]
        except SafetensorError as e:  # another listed file (the tokenizer), or no such tensor
            raise ArtifactError(f"{fpath}: cannot read tensor {name} from it ({e})") from e

    def linear(
        self, name: str, cols: Span | None = None, rows: Span | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(qweight, qparams, n, k) of a quantized linear, or of its output columns [n0, n1)
        and/or input rows [k0, k1) only (see linear_slices)."""
        n, k = self.manifest.tensors[f"{name}.qweight"].logical_shape
        (n0, n1), (k0, k1) = cols or (0, n), rows or (0, k)
        qweight, qparams = linear_slices(n, k, self.manifest.quantization.group_size, cols, rows)
        return (
            self.tensor(f"{name}.qweight", *qweight),
            self.tensor(f"{name}.qparams", *qparams),
            n1 - n0,
            k1 - k0,
        )

    def nbytes(self, name: str, rows: Range | None = None, cols: Range | None = None) -> int:
        """Bytes of a tensor, or of a slice as `tensor` reads it, from the manifest alone."""
        entry = self.manifest.tensors[name]
        size = _ITEMSIZE[entry.dtype]
        for dim, span in zip(entry.shape, (rows, cols, None), strict=False):
            size *= len(range(dim)[slice(*(span or (None, None)))])
        return size

    def has(self, name: str) -> bool:
        return name in self.manifest.tensors

    @property
    def chat_template(self) -> str | None:
        p = self.path / CHAT_TEMPLATE_FILE
        return p.read_text() if p.is_file() else None

    def size_on_disk(self) -> int:
        """The artifact's own files: a temporary file a killed writer left beside them, or a
        file a user put there, is no part of what it serves."""
        names = [*self.manifest.files, MANIFEST_FILE, MODEL_CARD_FILE]
        return sum(p.stat().st_size for p in (self.path / n for n in names) if p.is_file())
