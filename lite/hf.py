"""The bridge between transformers configs and the manifest's architecture, both ways.

`lite` calibrates with transformers' own decoder layers (so every family's quirks are
upstream's), and evaluates artifacts by loading their dequantized weights back into a
transformers model built from the manifest alone: that round trip proves the manifest complete.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from runtime.artifact.hf_config import ROPE_KEYS
from runtime.artifact.hf_config import as_list as _as_list
from runtime.artifact.hf_config import sliding_window as window_from_dict
from runtime.artifact.layout import dequantize
from runtime.artifact.manifest import Architecture, Manifest
from runtime.artifact.reader import Artifact
from runtime.model.llama import check_supported

# a config without one of these gets transformers' defaults (a 7B shape for llama): a plan or a
# run of a model nobody asked for
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def load_config(path: Path) -> PretrainedConfig:
    raw, _ = PretrainedConfig.get_config_dict(path)
    missing = [k for k in (*SHAPE_KEYS, "vocab_size") if k not in raw]
    if missing:
        raise ValueError(
            f"{path}/config.json lacks {', '.join(missing)}: transformers would fill in its "
            "defaults, the shape of another model; use the model's own config.json"
        )
    _check_heads(path, raw)
    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    _check_runnable(path, config)
    return config


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: Path):
    """The model's tokenizer. Without its files transformers blames a missing sentencepiece or
    tiktoken, which is installed; the missing files are the problem."""
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in TOKENIZER_MARKERS):
        raise ValueError(
            f"{path} has no tokenizer ({', '.join(TOKENIZER_MARKERS)}): copy the model's "
            "tokenizer files beside its config.json"
        )
    return AutoTokenizer.from_pretrained(path)


def _check_runnable(path: Path, config: PretrainedConfig) -> None:
    """What the runtime cannot run, refused before hours of calibration rather than when the
    artifact is served (or, for a window on some layers only, never: it ran as another
    model)."""
    try:
        check_supported(architecture_from_config(config, None))
    except ValueError as e:
        raise ValueError(f"{path}/config.json: {e}; quantize another model") from e


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window every layer attends within, derived as the runtime derives it from a
    config.json (one reading for calibration, conversion and serving)."""
    return window_from_dict(config.to_dict())


def _check_heads(path: Path, raw: dict) -> None:
    """Shapes no model of these families can have (transformers fails on them later, deep in
    its validation or in attention, with a traceback)."""
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    kv_heads = raw.get("num_key_value_heads") or heads
    if not all(isinstance(v, int) and v > 0 for v in (heads, hidden, kv_heads)):
        raise ValueError(
            f"{path}/config.json: head counts and hidden_size must be positive integers"
        )
    if not raw.get("head_dim") and hidden % heads:
        raise ValueError(
            f"{path}/config.json: hidden_size {hidden} is not a multiple of num_attention_heads "
            f"{heads} (and no head_dim is given); use the model's own config.json"
        )
    if heads % kv_heads:
        raise ValueError(
            f"{path}/config.json: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}; use the model's own config.json"
        )


def _rope(config: PretrainedConfig) -> tuple[float, dict | None]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    scaling = {k: params[k] for k in ROPE_KEYS if k in params}
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def architecture_from_config(config: PretrainedConfig, tokenizer_eos: int | None) -> Architecture:
    theta, scaling = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    eos = _as_list(config.eos_token_id)
    if tokenizer_eos is not None and tokenizer_eos not in eos:
        eos.append(tokenizer_eos)
    return Architecture(
        family=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        attention_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", 0)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=config.model_type == "qwen3",
        sliding_window=sliding_window(config),
        bos_token_id=config.bos_token_id,
        eos_token_ids=eos,
        pad_token_id=config.pad_token_id,
    )


def config_from_architecture(arch: Architecture) -> PretrainedConfig:
    rope = {"rope_type": "default", "rope_theta": arch.rope_theta, **(arch.rope_scaling or {})}
    kwargs = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        hidden_act=arch.hidden_act,
        rms_norm_eps=arch.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=arch.bos_token_id,
        eos_token_id=arch.eos_token_ids or None,
        pad_token_id=arch.pad_token_id,
    )
    if arch.family in ("llama", "qwen3"):  # Qwen2's q/k/v biases are not a config option
        kwargs["attention_bias"] = arch.attention_bias
    if arch.family == "llama":
        kwargs["mlp_bias"] = arch.mlp_bias
    if arch.family == "mistral":  # a window on every layer; None said, not 4096 by default
        kwargs["sliding_window"] = arch.sliding_window
    elif arch.family in ("qwen2", "qwen3"):  # Qwen's window needs its flag, on every layer
        window = arch.sliding_window
        kwargs.update(use_sliding_window=window is not None, sliding_window=window)
        kwargs["max_window_layers"] = 0
    config = AutoConfig.for_model(arch.family, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def load_dequantized(artifact: Artifact) -> torch.nn.Module:
    """A transformers model holding the artifact's weights, unpacked by the reference unpacker."""
    manifest: Manifest = artifact.manifest
    config = config_from_architecture(manifest.architecture)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    gs = manifest.quantization.group_size
    for name, entry in manifest.tensors.items():
        if entry.kind == "dense":
            state[name] = artifact.tensor(name).float()
        elif entry.kind == "qweight":
            prefix = name.removesuffix(".qweight")
            n, k = entry.logical_shape
            qparams = artifact.tensor(prefix + ".qparams")
            state[prefix + ".weight"] = dequantize(artifact.tensor(name), qparams, n, k, gs)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    _materialize_buffers(model, config)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{artifact.path}: the artifact lacks weights for {missing[:5]}")
    return model.eval()


def _materialize_buffers(model: torch.nn.Module, config: PretrainedConfig) -> None:
    """Rotary tables are computed, not stored: rebuild them on the CPU after a meta init."""
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)


def load_source_model(path: Path) -> torch.nn.Module:
    """The whole source model at fp32: only for evaluation, never for calibration."""
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
