"""llm-compressor's AWQ on the calibration tokens `lite auto_awq` uses, measured, not quoted.

Issue 18 compares liteserve's AWQ with llm-compressor's on text neither calibrated on. Its
out-of-domain figure was derived from numbers recorded on other windows; this script runs
llm-compressor itself (AWQModifier + QuantizationModifier, w4 asymmetric, min-max observer,
its defaults otherwise) on exactly the token blocks `lite.data.build_calibration` gives, and
writes the result as a plain Hugging Face model whose linears hold the dequantized weights.
`evals/bench/awq_objectives.py --llmc OUT` then scores it on the same windows as every
liteserve variant, so the ratio is measured on one set of windows.

llm-compressor pins its own torch/transformers range, so it runs in a separate virtual
environment (`--llmc-python`), e.g.

    python3 -m venv /work/llmc-venv && /work/llmc-venv/bin/pip install torch llmcompressor
    python -m evals.bench.llmc_baseline --llmc-python /work/llmc-venv/bin/python \
        --out out/objectives/llmc
"""

from __future__ import annotations

import argparse
import json
import shutil
import uuid
from pathlib import Path

from evals.bench.quantize import MODEL, run_child

# Runs in llm-compressor's environment: argv = source dir, calibration tokens, out dir, group.
_CHILD = """
import sys, time
import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

src, calib, out, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if not torch.cuda.is_available():  # 0.14 pins its activation cache, which needs a GPU;
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # pinning only speeds copies
tokens = load_file(calib)["tokens"]
data = Dataset.from_dict({"input_ids": tokens.tolist(),
                          "attention_mask": torch.ones_like(tokens).tolist()})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
           "group_size": group}
recipe = [AWQModifier(ignore=["lm_head"]),
          QuantizationModifier(ignore=["lm_head"],
                               config_groups={"g": {"targets": ["Linear"], "weights": weights}})]
t = time.perf_counter()
oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=len(tokens),
        max_seq_length=tokens.shape[1], shuffle_calibration_samples=False)
print(f"oneshot: {time.perf_counter() - t:.0f} s", flush=True)
plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
state = {}
quantized = 0
for name, mod in model.named_modules():
    scheme = getattr(mod, "quantization_scheme", None)
    if scheme is not None and scheme.weights is not None:
        state[name + ".weight"] = fake_quantize(
            mod.weight.data, mod.weight_scale.data, mod.weight_zero_point.data, scheme.weights)
        quantized += 1
for key, value in model.state_dict().items():
    if key in plain.state_dict() and key not in state:
        state[key] = value
missing, unexpected = plain.load_state_dict(state, strict=False)
assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
print(f"{quantized} linears dequantized", flush=True)
plain.save_pretrained(out)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llmc-python", type=Path, required=True, help="llm-compressor's python")
    p.add_argument("--out", type=Path, default=Path("out/objectives/llmc"))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args()
    if not a.llmc_python.is_file():
        raise SystemExit(f"--llmc-python {a.llmc_python} does not exist; make that venv first")
    if a.out.exists():
        raise SystemExit(f"{a.out} exists; remove it to measure again")

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from lite.data import build_calibration
    from lite.sources import resolve

    source = resolve(MODEL)
    calib = build_calibration(
        "pydoc", AutoTokenizer.from_pretrained(source.path), a.samples, a.seqlen
    )
    tmp = a.out.with_name(f"{a.out.name}.{uuid.uuid4().hex}.partial")
    tmp.mkdir(parents=True)
    try:
        save_file({"tokens": calib.tokens.contiguous()}, str(tmp / "calib.safetensors"))
        cmd = [str(a.llmc_python), "-c", _CHILD, str(source.path), str(tmp / "calib.safetensors")]
        wall, rss = run_child([*cmd, str(tmp), str(a.group_size)])
        facts = {"wall_s": round(wall, 1), "peak_rss_gib": round(rss, 3), "calib": calib.sha256}
        (tmp / "llmc-run.json").write_text(json.dumps(facts, indent=1) + "\n")
        (tmp / "calib.safetensors").unlink()
        tmp.rename(a.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {a.out}: {json.dumps(facts)}")


if __name__ == "__main__":
    main()
