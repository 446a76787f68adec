"""Per group type, per layer: does the block-output search (and the block-picked clip) lower
the block output error on text the calibration never saw? (issue 18)

Layers of SmolLM2-135M-Instruct are calibrated on the default pydoc set (64 x 512) both ways,
each from the same full-precision inputs, and each choice is scored by the error it causes at
the output of the block the group feeds (attention for q/k/v, MLP for gate/up) on 8 windows
of held-out pydoc and of each OOD text of `quantize.eval_texts`, propagated through the
full-precision model. Cheaper than calibrating whole models per variant, and it isolates one
group type at a time.

    python -m evals.bench.awq_layers [--layers 0 8 16 24] [--windows 8]
"""

from __future__ import annotations

import argparse
import copy

import torch

from lite.auto_awq import (
    AwqConfig,
    build_layers,
    capture,
    embed,
    load_layer,
    positions,
    record_probes,
    run_layer,
)
from lite.awq import (
    block_loss,
    block_of,
    search_clip,
    search_scale,
    search_scale_block,
    soften_clip,
)
from lite.compute import full_fp32
from lite.data import CalibrationSet, build_calibration
from lite.families import LAYER_GROUPS, ScaleGroup
from lite.quantizer import QuantSpec, fake_quantize

SPEC = QuantSpec(group_size=64)


def _quantized(linears, scales: torch.Tensor, clips: list | None = None) -> torch.Tensor:
    parts = []
    for i, lin in enumerate(linears):
        clip = 1.0 if clips is None or clips[i] is None else clips[i]
        parts.append(fake_quantize(lin.weight.data * scales, SPEC, clip) / scales)
    return torch.cat(parts)


def study_group(
    layer: torch.nn.Module,
    group: ScaleGroup,
    x: torch.Tensor,
    pos: tuple,
    evals: dict[str, torch.Tensor],
) -> dict[str, dict[str, float]]:
    """Block output error per eval text of: RTN, the Gram-form scale, the block scale, and
    the block scale with Gram clip on v/gate/up (full and half strength)."""
    cfg = AwqConfig(spec=SPEC)
    block = block_of(group.linears)
    stats, _ = capture(layer, (group,), x, pos)
    probe = record_probes(layer, {block}, x, pos, cfg.block_samples)[block]
    linears = [layer.get_submodule(n) for n in group.linears]
    w = torch.cat([lin.weight.data for lin in linears])
    gram = search_scale(w, stats[group], SPEC).scales
    blk = search_scale_block(linears, stats[group], SPEC, probe).scales
    stats[group].rescale(blk)
    clips = [
        None
        if n.endswith(("q_proj", "k_proj"))
        else search_clip(lin.weight.data * blk, stats[group], SPEC)
        for n, lin in zip(group.linears, linears, strict=True)
    ]
    half = [None if c is None else soften_clip(c, 0.5) for c in clips]
    ones = torch.ones_like(blk)
    out: dict[str, dict[str, float]] = {}
    for text, y in evals.items():
        ood = record_probes(layer, {block}, y, pos, len(y))[block]
        out[text] = {
            "rtn": block_loss(linears, _quantized(linears, ones), ood),
            "gram": block_loss(linears, _quantized(linears, gram), ood),
            "block": block_loss(linears, _quantized(linears, blk), ood),
            "block+clip": block_loss(linears, _quantized(linears, blk, clips), ood),
            "block+clip/2": block_loss(linears, _quantized(linears, blk, half), ood),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[0, 8, 16, 24])
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--ood-dir", default="../shared/data")
    a = p.parse_args()
    from pathlib import Path

    from transformers import AutoTokenizer

    from evals.bench.quantize import MODEL, eval_texts
    from lite.hf import load_config
    from lite.sources import Checkpoint, resolve

    source = resolve(MODEL)
    config = load_config(source.path)
    ckpt = Checkpoint(source.path)
    tok = AutoTokenizer.from_pretrained(source.path)
    calib = build_calibration("pydoc", tok, 64, 512, 42)
    x = embed(ckpt, calib)
    evals = {}
    for t, text in eval_texts(Path(a.ood_dir)).items():
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        n = a.windows * 512
        evals[t] = embed(ckpt, CalibrationSet(t, ids[:n].view(a.windows, 512), ""))
    layers, rotary = build_layers(config)
    pos = positions(rotary, x, torch.device("cpu"))
    groups = [g for g in LAYER_GROUPS[config.model_type] if block_of(g.linears)]
    print("| layer | group | eval text | rtn | gram | block | block+clip | block+clip/2 |")
    print("|---|---|---|---|---|---|---|---|")
    with full_fp32():
        for i in range(max(a.layers) + 1):
            layer = layers[i]
            load_layer(layer, ckpt, f"model.layers.{i}.")
            if i in a.layers:
                for g in groups:
                    res = study_group(copy.deepcopy(layer), g, x, pos, evals)
                    for t, r in res.items():
                        rel = " | ".join(f"{r[k] / r['gram']:.3f}" for k in r)
                        print(f"| {i} | {block_of(g.linears)} | {t} | {rel} |", flush=True)
            x = run_layer(layer, x, pos)
            evals = {t: run_layer(layer, y, pos) for t, y in evals.items()}
            layers[i] = torch.nn.Identity()


if __name__ == "__main__":
    main()
