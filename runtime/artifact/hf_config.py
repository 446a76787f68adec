"""A Hugging Face directory's config, tokenizer and chat template, read without transformers.

`runtime serve` converts hub checkpoints on a serving host, which has no transformers; so the
architecture, generation defaults and tokenizer files are read here from the JSON itself.
`lite` (which has transformers) uses the same generation defaults and is tested to derive the
same architecture through transformers' config classes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer

from runtime.artifact.manifest import CHAT_TEMPLATE_FILE, Architecture, GenerationDefaults

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
INDEX_FILE = "model.safetensors.index.json"
ROPE_KEYS = (
    "rope_type",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def as_list(v: int | list[int] | None) -> list[int]:
    if v is None:
        return []
    return [v] if isinstance(v, int) else list(v)


def _rope(config: dict) -> tuple[float, dict | None]:
    """transformers 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    scaling = {k: params[k] for k in ROPE_KEYS if k in params}
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def read_json(path: Path) -> dict:
    """A JSON object from one of a checkpoint's files; a damaged one is named."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); repair or replace the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def indexed_shards(path: Path) -> list[Path] | None:
    """The shards the checkpoint's index names (a directory may hold other safetensors files
    too, such as Mistral's consolidated one); None without an index. A damaged index or a
    missing shard is a ValueError naming it."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    try:
        names = sorted(set(read_json(index)["weight_map"].values()))
    except (KeyError, AttributeError) as e:
        raise ValueError(
            f"{index} is not a safetensors index (no weight_map); download it again"
        ) from e
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ValueError(
            f"{path}: shards {', '.join(missing[:3])} named by {INDEX_FILE} are missing; "
            "download the model again"
        )
    return [path / n for n in names]


def tokenizer_eos(src: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, as transformers' tokenizer.eos_token_id."""
    cfg_path, tok_path = src / "tokenizer_config.json", src / "tokenizer.json"
    if not (cfg_path.is_file() and tok_path.is_file()):
        return None
    eos = read_json(cfg_path).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return None
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # tokenizers raises a bare Exception for a damaged file
        raise ValueError(f"{tok_path} cannot be read as a tokenizer ({e})") from e
    return tokenizer.token_to_id(eos)


def inline_chat_template(config: dict, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or (as some Hub models have it) a
    list of named templates, of which transformers uses the one named "default"."""
    inline = config.get("chat_template")
    if inline is None or isinstance(inline, str):
        return inline
    named = {t.get("name"): t.get("template") for t in inline if isinstance(t, dict)}
    if isinstance(named.get("default"), str):
        return named["default"]
    raise ValueError(
        f"{path} has chat templates named {sorted(map(str, named))} but none named 'default', "
        f"the one a chat uses; write the one to use to {CHAT_TEMPLATE_FILE} beside it"
    )


# transformers' defaults for a key config.json leaves out: Mistral's window, and the layer from
# which Qwen's windowed layers start
MISTRAL_WINDOW, QWEN_MAX_WINDOW_LAYERS = 4096, 28


def sliding_window(config: dict) -> int | None:
    """The window every layer attends within, read as transformers reads config.json: Mistral's
    on every layer (4096 when the key is missing), Qwen's only with `use_sliding_window` and
    from layer `max_window_layers` on (or as `layer_types` says), none for Llama. Layers of two
    kinds are refused: the runtime gives every layer the same attention, so it would run
    another model."""
    family = config["model_type"]
    if family == "mistral":
        return config.get("sliding_window", MISTRAL_WINDOW)
    if family not in ("qwen2", "qwen3"):
        return None  # Llama's attention has no window, whatever a sliding_window key says
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    first = config.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
    types = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]
    if len(set(types)) > 1:
        raise ValueError(
            f"layers of different attention types ({', '.join(sorted(set(types)))}, e.g. a "
            "sliding window from max_window_layers on) are not supported: the runtime gives "
            "every layer the same attention"
        )
    return window if types[0] == "sliding_attention" else None


def architecture_from_dict(config: dict, eos: int | None) -> Architecture:
    """The manifest's architecture from config.json, with transformers' defaults."""
    family = config["model_type"]
    heads = config["num_attention_heads"]
    theta, scaling = _rope(config)
    eos_ids = as_list(config.get("eos_token_id"))
    if eos is not None and eos not in eos_ids:
        eos_ids.append(eos)
    return Architecture(
        family=family,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding_window(config),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=config.get("pad_token_id"),
    )


def generation_defaults(path: Path, arch: Architecture) -> GenerationDefaults:
    """The source's generation_config.json where it has one; stop on every end token."""
    defaults = GenerationDefaults(stop_token_ids=arch.eos_token_ids)
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return defaults
    gen = read_json(gen_path)
    stops = sorted(set(arch.eos_token_ids) | set(as_list(gen.get("eos_token_id"))))
    return GenerationDefaults(
        temperature=gen.get("temperature", defaults.temperature),
        top_p=gen.get("top_p", defaults.top_p),
        top_k=gen.get("top_k", defaults.top_k) or 0,
        repetition_penalty=gen.get("repetition_penalty", defaults.repetition_penalty),
        stop_token_ids=stops,
    )


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files and the chat template, as `tokenizer.save_pretrained` leaves them:
    chat_template.jinja verbatim, or the template from tokenizer_config.json written out."""
    if not (src / "tokenizer.json").is_file():
        raise ValueError(f"{src} has no tokenizer.json (a fast tokenizer is needed to serve)")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    template = src / CHAT_TEMPLATE_FILE
    if template.is_file():
        shutil.copyfile(template, dst / CHAT_TEMPLATE_FILE)
        return
    cfg_path = src / "tokenizer_config.json"
    config = read_json(cfg_path) if cfg_path.is_file() else {}
    inline = inline_chat_template(config, cfg_path)
    if inline is not None:
        (dst / CHAT_TEMPLATE_FILE).write_text(inline)
