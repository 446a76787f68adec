"""AWQ search objectives compared (issue 18): Gram form vs block output, per group type, and
clip strength picked on the block; each scored in-domain and out of domain.

Every variant calibrates SmolLM2-135M-Instruct on the default set (64 x 512, w4 asym g64)
with `AwqConfig` overrides, in a child process (an existing OUT/<variant> is reused), then
all are scored on the same windows of each text of `quantize.eval_texts`, next to
llm-compressor's AWQ on the same calibration tokens when `--llmc DIR` names the model
`evals/bench/llmc_baseline.py` wrote. Perplexity here is for ranking methods against each other
on identical windows; the headline table is evals/bench/quantize.py's.

    python -m evals.bench.awq_objectives --out out/objectives [--limit 24] [--skip 0]
        [--llmc DIR] [VARIANT ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

BOTH = ["self_attn", "mlp"]
NATURAL = {"rounding": "gptq", "gptq_act_order": False}
VARIANTS: dict[str, dict[str, list[str] | int | float | bool | str]] = {
    "rtn": {"calib_samples": 0},  # round-to-nearest, the floor
    "gram": {"block_objective": [], "block_clip": []},  # the default before GPTQ rounding
    "attn": {"block_objective": ["self_attn"], "block_clip": []},  # block output: q/k/v only
    "mlp": {"block_objective": ["mlp"], "block_clip": []},  # block output: gate/up only
    "block": {"block_objective": BOTH, "block_clip": []},
    "block+clip": {"block_objective": BOTH, "block_clip": BOTH},
    "attn+clip": {"block_objective": ["self_attn"], "block_clip": BOTH},  # the best block variant
    "block+clip-attn": {"block_objective": BOTH, "block_clip": ["self_attn"]},
    "block+clip-mlp": {"block_objective": BOTH, "block_clip": ["mlp"]},
    "gptq": {"rounding": "gptq"},  # then GPTQ rounding, act-order within groups: the default
    # GPTQ in the natural column order (the default before act-order), and its variations
    "gptq-natural": NATURAL,
    "gptq-damp0.01": {**NATURAL, "gptq_damp": 0.01},  # GPTQ's own damping
    "gptq-noclip": {**NATURAL, "gptq_damp": 0.01, "clip_max_shrink": 0},  # no clip
    "gptq-damp0.1": {**NATURAL, "gptq_damp": 0.1},
    "gptq-damp1": {**NATURAL, "gptq_damp": 1.0},
    "gptq-damp10": {**NATURAL, "gptq_damp": 10.0},
    "gptq-damp1.5": {**NATURAL, "gptq_damp": 1.5},
    "gptq-damp6": {**NATURAL, "gptq_damp": 6.0},
    "gptq-noclip3": {**NATURAL, "clip_max_shrink": 0},  # without clip
    "gptq-clip0.25": {**NATURAL, "clip_max_shrink": 0.25},  # a milder clip search
}

_CHILD = """
import json, sys, time
from lite.auto_awq import AwqConfig, Compute, auto_awq
from lite.quantizer import QuantSpec
over = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[2]).items()}
base = {"spec": QuantSpec(group_size=64), "calib_samples": 64, "calib_seqlen": 512,
        "rounding": "nearest"}  # what every variant but the gptq ones was measured with
cfg = AwqConfig(**{**base, **over})
t = time.perf_counter()
auto_awq("smollm2-135m-instruct", sys.argv[1], cfg, "awq_objectives " + sys.argv[2],
         overwrite=True, progress=False, compute=Compute("cpu"))
print(f"{sys.argv[1]}: {time.perf_counter() - t:.0f} s", flush=True)
"""


def calibrate(out: Path, overrides: dict[str, list[str] | int]) -> None:
    """One calibration in a child process (its memory is returned when it ends)."""
    if out.is_dir():
        return
    cmd = [sys.executable, "-c", _CHILD, str(out), json.dumps(overrides)]
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", type=Path, default=Path("out/objectives"))
    p.add_argument("--limit", type=int, default=24, help="windows per text")
    p.add_argument("--skip", type=int, default=0, help="windows skipped at each text's start")
    p.add_argument("--ood-dir", type=Path, default=Path("../shared/data"))
    p.add_argument("--llmc", type=Path, help="llmc_baseline.py's model")
    a = p.parse_args()
    unknown = set(a.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    for v in a.variants:
        calibrate(a.out / v, VARIANTS[v])

    from transformers import AutoTokenizer

    from evals.bench.quantize import LLMC_ROW, MODEL, eval_texts
    from lite.hf import load_dequantized, load_source_model
    from lite.perplexity import hf_logits, perplexity, windows
    from lite.sources import resolve
    from runtime.artifact.reader import Artifact

    source = resolve(MODEL)
    tok = AutoTokenizer.from_pretrained(source.path)
    batches = {}
    for t, text in eval_texts(a.ood_dir).items():
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        batches[t] = windows(ids[a.skip * 512 :], 512, a.limit)

    def scored(name: str, load: Callable[[], torch.nn.Module]) -> dict[str, float]:
        """Perplexity per text, kept in OUT/<name>.ppl-<limit>[-skip<skip>].json for later
        invocations (one file per slice of windows)."""
        cache = a.out / f"{name}.ppl-{a.limit}{f'-skip{a.skip}' if a.skip else ''}.json"
        if cache.is_file():
            return json.loads(cache.read_text())
        model = hf_logits(load())
        result = {t: perplexity(name, model, b).ppl for t, b in batches.items()}
        cache.write_text(json.dumps(result))
        return result

    src = scored("source", lambda: load_source_model(source.path))
    loaders = {v: lambda v=v: load_dequantized(Artifact(a.out / v)) for v in a.variants}
    if a.llmc:
        loaders[LLMC_ROW] = lambda: load_source_model(a.llmc)
    ppl = {v: scored(v, load) for v, load in loaders.items()}
    bases = [b for b in ("gram", LLMC_ROW) if b in ppl]
    print(f"\n{a.limit} x 512-token windows per text after {a.skip}; loss = ppl - source's\n")
    head = [f"{t} ppl | " + " | ".join(f"loss vs {b}" for b in bases) for t in batches]
    print("| variant | " + " | ".join(head) + " |")
    print("|---|" + ("---|" * (1 + len(bases))) * len(batches))
    for v, result in ppl.items():
        cells = []
        for t in batches:
            loss = result[t] - src[t]
            cells += [f"{result[t]:.3f}", *(f"{loss / (ppl[b][t] - src[t]):.3f}x" for b in bases)]
        print(f"| {v} | " + " | ".join(cells) + " |", flush=True)
    print("| source | " + " | ".join(f"{src[t]:.3f}" + " | -" * len(bases) for t in batches) + " |")


if __name__ == "__main__":
    main()
