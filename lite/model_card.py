"""The artifact's README.md: how it was made, for the person who finds the directory later."""

from __future__ import annotations

from pathlib import Path

from runtime.artifact.manifest import MODEL_CARD_FILE, Manifest, Producer

EVAL_MARKER = "## Evaluation"


def made_by(p: Producer) -> str:
    """Who made the artifact, when, and where it was calibrated (schema 2 on), since the
    device and torch build decide the last bits of a GPU-calibrated artifact."""
    text = f"liteserve {p.version}, {p.created}"
    if p.devices:
        text += f", on {', '.join(p.devices)}"
    if p.torch:
        text += f" with torch {p.torch}" + (f" / CUDA {p.cuda}" if p.cuda else "")
    return text


def write_model_card(root: Path, m: Manifest, name: str) -> None:
    """README.md in `root`, the staged artifact, which is served as `name`."""
    q, a, launch = m.quantization, m.architecture, m.launch
    calib = (
        f"{q.calib_samples} x {q.calib_seqlen} tokens of `{q.calib_dataset}` "
        f"(tokens sha256 `{q.calib_tokens_sha256[:16]}…`, seed {q.seed})"
        if q.method == "awq"
        else "none (round-to-nearest baseline)"
    )
    search = (
        f"{q.search} objective, {q.n_grid}-point scale grid"
        f"{' with duo scaling' if q.duo_scaling else ''}, clip shrink up to {q.clip_max_shrink}, "
        f"{q.rounding} rounding"
        if q.method == "awq"
        else "none (round-to-nearest)"
    )
    fallbacks = "\n".join(f"- {f}" for f in q.fallbacks) or "none"
    text = f"""# {Path(m.source.id).name} ({q.method.upper()} int{q.bits}, group {q.group_size})

A liteserve artifact: packed 4-bit weights in the `{m.layout.name}` layout, group scales,
tokenizer and chat template. Serve it with `runtime serve {name}`.

| | |
|---|---|
| source | `{m.source.id}` |
| family | {a.family}, {a.num_layers} layers, hidden {a.hidden_size}, \
{a.num_heads} heads / {a.num_kv_heads} KV heads |
| quantization | {q.method}, int{q.bits}, group size {q.group_size}, \
{"symmetric" if q.symmetric else "asymmetric with zero points"} |
| calibration | {calib} |
| search | {search} |
| search fallbacks | {fallbacks} |
| launch config | session {launch.session_len}, kv {launch.kv_quant}, \
block {launch.cache_block_seq_len}, batch {launch.max_batch_size} |
| made by | {made_by(m.producer)} |

Command:

```
{m.producer.command}
```

{EVAL_MARKER}

No evaluation yet: `lite eval --update-card` adds results here.
"""
    (root / MODEL_CARD_FILE).write_text(text)
