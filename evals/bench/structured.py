"""Structured-output overhead: decode tokens/s with a JSON schema against unconstrained, at
batch 1 and 32, on this machine (issue 15's aim: at most 10% slower at batch 32).

Both runs decode the same prompts at temperature 1; the constrained one carries a nested
schema whose minimum length keeps every sequence decoding for the whole measurement, so each
timed step is a full batch. Only decode steps are timed (from the first step after every prompt
is in), and the time the grammar's masks take is reported on its own. The two alternate for
--rounds rounds and each keeps its best, so a burst of load from elsewhere on a shared machine
skews the ratio less. Prints the CPU and its vector ISA first: the ratio depends on how fast the
model itself runs.

Usage: python evals/bench/structured.py ARTIFACT [--batch 1,32] [--steps 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import time

import torch

from runtime import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.grammar import schema_key

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "score"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}  # never finishes within the steps
PROMPT = "A list of people as JSON:"


def cpu() -> str:
    """The CPU model and the vector extensions torch's kernels can use."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    model = re.search(r"Model name:\s*(.+)", text)
    flags = set(re.search(r"Flags:\s*(.+)", text).group(1).split()) if "Flags:" in text else set()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
    return f"{model.group(1).strip() if model else 'unknown'}; ISA: {', '.join(isa) or 'none'}"


def decode_rate(engine: Engine, batch: int, steps: int, schema: str | None) -> tuple[float, float]:
    """(tokens/s over `steps` full-batch decode steps, seconds of grammar masks per step)."""
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    params = engine.sampling_params(
        temperature=1.0, max_new_tokens=steps + 4, ignore_eos=True, json_schema=schema
    )
    seqs = [engine.add_request(ids, params) for _ in range(batch)]
    while any(len(s.output_ids) == 0 for s in seqs):  # prefill, and the first token
        engine.step()
    mask_time = 0.0
    fill = engine.grammar.fill_masks
    if schema is not None:

        def timed(matchers):
            nonlocal mask_time
            t = time.perf_counter()
            out = fill(matchers)
            mask_time += time.perf_counter() - t
            return out

        engine.grammar.fill_masks = timed
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    engine.grammar.fill_masks = fill
    assert all(not s.finished for s in seqs), "a sequence finished inside the timed steps"
    for s in seqs:
        engine.abort(s.seq_id)
    return batch * steps / elapsed, mask_time / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"cpu: {cpu()}; torch threads {torch.get_num_threads()}")
    config = EngineConfig(kv_quant="none", session_len=512, num_blocks=400, max_batch_size=64)
    engine = Engine(args.artifact, config)
    start = time.perf_counter()
    engine.grammar.check(SCHEMA)
    print(f"grammar: tokenizer table and schema compiled in {time.perf_counter() - start:.2f} s")
    key = schema_key(SCHEMA)
    decode_rate(engine, 1, 2, None)  # warm-up
    for batch in (int(b) for b in args.batch.split(",")):
        runs = [
            (
                decode_rate(engine, batch, args.steps, None),
                decode_rate(engine, batch, args.steps, key),
            )
            for _ in range(args.rounds)
        ]
        free = max(f for (f, _), _ in runs)
        bound, mask = max(b for _, b in runs)
        print(
            json.dumps(
                {
                    "batch": batch,
                    "unconstrained_tok_s": round(free, 1),
                    "json_schema_tok_s": round(bound, 1),
                    "ratio": round(bound / free, 3),
                    "mask_ms_per_step": round(mask * 1e3, 2),
                }
            )
        )


if __name__ == "__main__":
    main()
