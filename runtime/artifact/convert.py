"""AutoAWQ / GPTQ / compressed-tensors checkpoints into a liteserve artifact, without calibrating.

In `runtime` (not `lite`) because `runtime serve` accepts such checkpoints directly and a
serving host has no `lite`. Conversion streams: shards are read lazily one tensor at a time,
each decoder layer is unpacked, repacked into the artifact layout and written before the next
is read, so peak memory is about one layer (or the embedding, if larger) plus one output shard.
Everything that can be refused is refused before anything is written, and the artifact
appears by one rename, never half-written.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runtime import __version__
from runtime.artifact import layout
from runtime.artifact.formats import FormatError, QuantizedLinear, SourceFormat, detect_format
from runtime.artifact.formats import expand_groups as _expand
from runtime.artifact.hf_config import (
    TOKENIZER_FILES,
    architecture_from_dict,
    copy_tokenizer,
    generation_defaults,
    indexed_shards,
    read_json,
    tokenizer_eos,
)
from runtime.artifact.manifest import (
    FAMILIES,
    MANIFEST_FILE,
    MODEL_CARD_FILE,
    Architecture,
    FileEntry,
    Layout,
    Manifest,
    Producer,
    Quantization,
    SourceModel,
)
from runtime.artifact.writer import (
    check_replaceable,
    file_entries,
    publish,
    sha256_file,
    staging_dir,
    tensor_entries,
    utc_now,
    write_manifest,
    write_shards,
    write_streamed,
)
from runtime.cache import cache_root, cached_entry, entry_key, matches_record
from runtime.kernels import repack
from runtime.kernels.repack import repack_codes
from runtime.model.llama import FUSED_LINEARS, check_supported

log = logging.getLogger("liteserve")

LINEARS = tuple(n for names in FUSED_LINEARS.values() for n in names)
# Smaller than the writer's 2 GiB default: a shard is buffered whole before it is written.
CONVERT_SHARD_BYTES = 512 * 1024**2
STORED_16BIT = {"F16": "float16", "BF16": "bfloat16"}  # safetensors' names -> manifest dtype
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
GLOBALS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LEGACY_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}  # -> quant_method
ROW_CHUNK = 4096  # rows of an embedding per read and write: 32 MiB at hidden 4096 in fp16


class ConvertError(ValueError):
    """A checkpoint was refused; the message says why, and nothing was written."""


class Shards:
    """The checkpoint's tensors by name, read lazily from its safetensors shards."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.where: dict[str, Path] = {}
        for shard in self._files():
            try:
                with safe_open(str(shard), framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), shard))
            except (SafetensorError, OSError) as e:
                raise ConvertError(
                    f"{shard} is truncated or not a safetensors file ({e}); download it again"
                ) from e

    def _files(self) -> list[Path]:
        try:
            indexed = indexed_shards(self.src)
        except ValueError as e:
            raise ConvertError(str(e)) from e
        if indexed is not None:
            return indexed
        files = sorted(self.src.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{self.src} has no *.safetensors weights")
        return files

    def get(self, name: str) -> torch.Tensor:
        """The tensor as stored; KeyError when the checkpoint has none by that name."""
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> list[int]:
        with safe_open(str(self.where[name]), framework="pt") as f:
            return list(f.get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of a tensor, reading only those bytes."""
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def dtype(self, name: str) -> str:
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_slice(name).get_dtype()


def read_config(src: Path) -> dict:
    """config.json, with the quantization_config of a legacy side file where it has none."""
    path = src / "config.json"
    if not path.is_file():
        raise ConvertError(f"{src} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON: {e}") from e
    if not config.get("quantization_config"):
        legacy = legacy_quantization_config(src)
        if legacy is not None:
            config["quantization_config"] = legacy
    return config


def legacy_quantization_config(src: Path) -> dict | None:
    """Older AutoGPTQ and AutoAWQ checkpoints (many of TheBloke's) keep their quantization in
    quantize_config.json or quant_config.json, not in config.json; vLLM reads them too."""
    for name, method in LEGACY_CONFIGS.items():
        if (src / name).is_file():
            try:
                qc = read_json(src / name)
            except ValueError as e:
                raise ConvertError(str(e)) from e
            return {"quant_method": method, **qc}
    return None


def _plan(shards: Shards, fmt: SourceFormat, arch: Architecture) -> None:
    """Refuse now, before writing, what the conversion would trip over later: a missing or
    unquantized linear, a quantized lm_head, a tensor the artifact has no place for, a
    tensor whose shape is not the one config.json gives it."""
    n_layers = arch.num_layers
    expected = {f"model.layers.{i}.{lin}" for i in range(n_layers) for lin in LINEARS}
    quantized = {
        n.removesuffix(fmt.weight_suffix) for n in shards.where if n.endswith(fmt.weight_suffix)
    }
    missing = sorted(expected - quantized)
    if missing:
        raise ConvertError(
            f"{shards.src}: {len(missing)} decoder linears are not quantized in the checkpoint "
            f"(e.g. {missing[0]}); the artifact holds every layer linear in int4"
        )
    extra = sorted(quantized - expected)
    if extra:
        raise ConvertError(
            f"{shards.src}: quantized tensors outside the decoder linears ({extra[:3]}); "
            f"the artifact keeps them in 16 bits: not supported"
        )
    for name in GLOBALS:
        if name not in shards.where and not (arch.tie_word_embeddings and name == "lm_head.weight"):
            raise ConvertError(f"{shards.src}: {name} is missing from the checkpoint")
    shapes = {n: _logical_shape(shards, fmt, n) for n in sorted(expected)}
    dense = [n for n in shards.where if n.endswith(".bias") or not n.startswith(tuple(expected))]
    shapes |= {n: shards.shape(n) for n in dense}
    for name, shape in shapes.items():
        want = arch.logical_shape(name)
        if want is not None and list(shape) != want:
            raise ConvertError(
                f"{shards.src}: {name} is {list(shape)} but config.json ({arch.shape_summary()}) "
                f"makes it {want}: the config does not describe these weights"
            )


def _storage_dtype(shards: Shards) -> str:
    """The source's own 16-bit dtype for the unquantized tensors, float16 for a 32-bit one."""
    return STORED_16BIT.get(shards.dtype("model.embed_tokens.weight"), "float16")


def pack_linear(lin: QuantizedLinear, gs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and (s, -z*s) in the artifact layout, the source's groups repeated to `gs`."""
    n, k = lin.shape
    scale = _expand(lin.scale.float(), lin.group_size, gs, k)
    zero = _expand(lin.zero, lin.group_size, gs, k)
    qweight = repack_codes(lin.words, lin.codes.locate, n, k, gs)
    if qweight is None:
        qweight = layout.pack_qweight(lin.q, gs)
    return qweight, layout.pack_qparams(scale, zero, gs, k)


def _layer(
    shards: Shards, fmt: SourceFormat, i: int, gs: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    for lin in LINEARS:
        name = prefix + lin
        try:
            params = fmt.read(shards.get, name)
        except FormatError as e:
            raise ConvertError(f"{shards.src}: {e}") from e
        out[name + ".qweight"], out[name + ".qparams"] = pack_linear(params, gs)
        consumed.update(
            n for n in shards.where if n.startswith(name + ".") and not n.endswith(".bias")
        )
    for name in shards.where:
        if name.startswith(prefix) and name not in consumed:
            out[name] = shards.get(name).to(dtype)
    return out


def _linear_shapes(shards: Shards, fmt: SourceFormat, n_layers: int, gs: int) -> tuple[dict, dict]:
    """Logical [N, K] and padded [Np, Kp] of every linear, from the shapes in the shard
    headers (no unpacking)."""
    logical, padded = {}, {}
    for i in range(n_layers):
        for lin in LINEARS:
            name = f"model.layers.{i}.{lin}"
            n, k = _logical_shape(shards, fmt, name)
            logical[name] = (n, k)
            padded[name] = layout.padded_shape(n, k, gs)
    return logical, padded


def _logical_shape(shards: Shards, fmt: SourceFormat, name: str) -> tuple[int, int]:
    with safe_open(str(shards.where[name + fmt.weight_suffix]), framework="pt") as f:
        shape = f.get_slice(name + fmt.weight_suffix).get_shape()
    if fmt.name == "autoawq-gemm":
        return shape[1] * 8, shape[0]
    if fmt.name == "gptq":
        return shape[1], shape[0] * 8
    n, k = shards.get(name + ".weight_shape").tolist()
    return int(n), int(k)


def _stream_globals(
    shards: Shards, out: Path, tied: bool, dtype: torch.dtype, checksums: dict[str, FileEntry]
) -> dict[str, str]:
    """Embedding, final norm and lm_head, each into its own shard in row chunks: with a 128k
    vocabulary the embedding alone is 1 GiB, several decoder layers' worth."""
    where: dict[str, str] = {}
    for name in GLOBALS:
        if name == "lm_head.weight" and tied:
            continue
        file = f"model-{len(where) + 1:05d}.safetensors"
        shape = shards.shape(name)
        chunks = (shards.rows(name, i, i + ROW_CHUNK) for i in range(0, shape[0], ROW_CHUNK))
        checksums[file] = write_streamed(out / file, name, shape, dtype, chunks)
        where[name] = file
    return where


def source_files(src: Path) -> dict[str, str]:
    """sha256 of everything that decides the artifact: config, shards, tokenizer, template."""
    names = ["config.json", *LEGACY_CONFIGS, *TOKENIZER_FILES, "chat_template.jinja"]
    names.append("generation_config.json")
    paths = [src / n for n in names if (src / n).is_file()]
    paths += sorted(p for p in src.glob("*.safetensors"))
    return {p.name: sha256_file(p) for p in paths}


def write_converted(
    src: Path,
    out: Path,
    source_id: str,
    command: str,
    files: dict[str, str] | None = None,
    revision: str | None = None,
) -> None:
    """Fill the empty directory `out` with the artifact of the checkpoint at `src`."""
    config = read_config(src)
    family = config.get("model_type", "")
    if family not in FAMILIES:
        raise ConvertError(
            f"{src}: architecture {family!r} is not supported ({', '.join(FAMILIES)})"
        )
    try:
        fmt = detect_format(config, str(src))
    except FormatError as e:
        raise ConvertError(str(e)) from e
    try:
        arch = architecture_from_dict(config, tokenizer_eos(src))
        check_supported(arch)
    except KeyError as e:
        raise ConvertError(f"{src / 'config.json'} has no {e.args[0]}: it is incomplete") from e
    except ValueError as e:  # refused before anything is written, not when it is served
        raise ConvertError(f"{src / 'config.json'}: {e}") from e
    shards = Shards(src)
    _plan(shards, fmt, arch)
    gs = fmt.artifact_group_size()
    dtype_name = _storage_dtype(shards)
    dtype = DTYPES[dtype_name]
    n_layers = arch.num_layers

    with ThreadPoolExecutor(1) as pool:
        # hashlib and the repacker release the GIL: the source's 5 GB are hashed meanwhile
        source_hashes = pool.submit(source_files, src) if files is None else None
        checksums: dict[str, FileEntry] = {}
        where = _stream_globals(shards, out, arch.tie_word_embeddings, dtype, checksums)
        layers = (_layer(shards, fmt, i, gs, dtype) for i in range(n_layers))
        first = len(where) + 1
        where.update(write_shards(out, layers, CONVERT_SHARD_BYTES, first, checksums))
        files = files if source_hashes is None else source_hashes.result()
    copy_tokenizer(src, out)
    logical, padded = _linear_shapes(shards, fmt, n_layers, gs)
    manifest = Manifest(
        producer=Producer(
            version=__version__, command=command, created=utc_now(), torch=torch.__version__
        ),
        source=SourceModel(
            id=source_id,
            revision=revision,
            files=files,
            format=fmt.name,
            quantization_config=fmt.config,
        ),
        architecture=arch,
        quantization=_quantization(fmt, gs),
        layout=Layout(
            name=layout.LAYOUT_NAME,
            version=layout.LAYOUT_VERSION,
            tile=layout.TILE,
            n_align=layout.N_ALIGN,
        ),
        dtype=dtype_name,
        tensors=tensor_entries(out, where, logical, padded),
        files=file_entries(out, checksums),
        generation=generation_defaults(src, arch),
    )
    write_manifest(out, manifest)
    _write_card(out, manifest)


def _quantization(fmt: SourceFormat, gs: int) -> Quantization:
    """No calibration happened here: the calibration fields say so (0 / None)."""
    return Quantization(
        method=fmt.method,
        bits=4,
        group_size=gs,
        symmetric=fmt.symmetric,
        zero_point=not fmt.symmetric,
        calib_dataset=None,
        calib_samples=0,
        calib_seqlen=0,
        calib_tokens_sha256=None,
        seed=0,
        n_grid=0,
        duo_scaling=False,
        clip_max_shrink=0.0,
        search="none",
        rounding="none",
    )


def _write_card(out: Path, m: Manifest) -> None:
    src_gs = m.source.quantization_config
    (out / MODEL_CARD_FILE).write_text(
        f"# {Path(m.source.id).name} (converted from {m.source.format})\n\n"
        f"A liteserve artifact converted by `lite convert` (or `runtime serve`) from the "
        f"{m.source.format} checkpoint `{m.source.id}` without recalibrating: the same int4 codes "
        f"and scales, repacked into the `{m.layout.name}` layout with group size "
        f"{m.quantization.group_size}. Source quantization_config:\n\n"
        f"```json\n{json.dumps(src_gs, indent=2)}\n```\n\nMade by liteserve "
        f"{m.producer.version}, {m.producer.created}: `{m.producer.command}`\n"
    )


def convert(
    src: Path,
    target: Path,
    source_id: str,
    command: str = "",
    overwrite: bool = False,
    files: dict[str, str] | None = None,
    revision: str | None = None,
) -> Path:
    """Convert into a staging directory beside `target`, then publish it with one rename; on
    any error the staging directory is removed and `target` is untouched. `files` (name ->
    sha256) when the caller has hashed the source already: hashing 5 GB twice costs seconds."""
    check_replaceable(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_dir(target, "convert")
    try:
        write_converted(src, staging, source_id, command, files, revision)
        publish(staging, target, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_quantized_checkpoint(path: Path) -> bool:
    """A Hugging Face directory (no manifest) whose config declares a quantization."""
    if (path / MANIFEST_FILE).is_file() or not (path / "config.json").is_file():
        return False
    try:
        return bool(read_config(path).get("quantization_config"))
    except ConvertError:
        return False


def cache_key(files: dict[str, str]) -> str:
    """The source's content, the layout it is converted into and the code that converts it:
    a conversion made before a fix to that code is not served after it."""
    ident = {
        "files": files,
        "layout": layout.LAYOUT_NAME,
        "version": layout.LAYOUT_VERSION,
        "converter": converter_hash(),
    }
    return entry_key(ident)


@functools.cache
def converter_hash() -> str:
    """The sources that decide a conversion's bytes: this package's and the repacking's."""
    sources = sorted(Path(layout.__file__).parent.glob("*.py")) + [Path(repack.__file__)]
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def served_artifact(path: Path) -> Path:
    """What `runtime serve/check/verify PATH` opens: PATH itself, or for a quantized Hugging
    Face checkpoint its conversion, made once into the cache (keyed by the source's bytes)."""
    if not is_quantized_checkpoint(path):
        return path
    files = source_files(path)
    target = cache_root() / "converted" / cache_key(files)
    if matches_record(target):
        log.warning("serving %s from its conversion %s", path, target)
        return target
    log.warning("converting %s once into %s (reused while the source is unchanged)", path, target)

    def build(tmp: Path) -> None:
        write_converted(path, tmp, str(path), f"runtime serve {path}", files)

    return cached_entry(target, build, directory=True)
