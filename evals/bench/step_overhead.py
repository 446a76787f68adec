"""A decode step's work outside the model: the GPU step metadata, and the sampler.

Issue 11 asks for host time per decode step below the GPU's at batch >= 16, and the GPU's step
is about a millisecond for a 1B model. Two paths turn a step's lists (token ids, positions,
slots, context lengths, block tables) into the one int32 buffer the kernels read:
``DecodeGraphs._fill`` (all-decode steps replayed from CUDA graphs, padded to the bucket) and
``GpuBackend.prepare_step`` (eager steps). Both are pure host work, so they are measured here on
the CPU (the triton backend on the CPU, interpreted: nothing of it runs but the metadata).

The sampler turns a step's logits into tokens; on the CPU backend that is CPU time beside an
8-30 ms forward. It is timed on a 49152-token vocabulary (SmolLM2's) with LM-shaped rows
(log-softmax of N(0, 8^2) logits: a few tokens hold most of the mass) for greedy, temperature
1, temperature 0.7 with top-p 0.9 (unseeded and seeded) and top-k 50.

    python evals/bench/step_overhead.py [--batches 1,16,64,256] [--blocks 32] [--against REV]
        [--rounds 3]

``--blocks``: block-table width (32 blocks of 64 tokens: 2k-token contexts). With
``--against``, that git revision runs the same measurement from a temporary worktree, the two
alternating ``--rounds`` times in fresh processes; prints each side's median and the ratio
(above 1: this checkout faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, os, sys, time
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from runtime.engine.cuda_graph import DecodeGraphs
from runtime.kernels.ops import StepInputs
from runtime.kernels.triton.backend import TritonBackend
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec

from runtime.engine.sampler import Sampler, SamplingParams

width, block, out = int(sys.argv[2]), 64, {}
ops = TritonBackend(torch.device("cpu"), {})
sampler = Sampler()
SAMPLING = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(temperature=0.7, top_k=50),
]
for bs in map(int, sys.argv[1].split(",")):
    cache = KVCache(KVSpec(1, 2, 64, block, "none", torch.float16), bs * width, ops.device)
    graphs = DecodeGraphs(None, cache, ops, bs, width, False)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(bs)]
    ctx = width * block - 1
    slots = [t[-1] * block + block - 2 for t in tables]
    step = StepInputs(list(range(bs)), [ctx - 1] * bs, slots, tables, [ctx] * bs, [1] * bs,
                      list(range(bs)), block)

    def ms(fn, reps=100):
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    times = [ms(lambda: graphs._fill(step)), ms(lambda: ops.prepare_step(step))]
    logits = torch.randn(bs, 49152, generator=torch.Generator().manual_seed(0)) * 8
    logits = logits.log_softmax(dim=-1)
    for p in SAMPLING:
        gens = [torch.Generator().manual_seed(i) if p.seed is not None else None
                for i in range(bs)]
        times.append(ms(lambda: sampler(logits, [p] * bs, gens, [None] * bs), reps=10))
    out[bs] = times
print(json.dumps(out))
"""
PATHS = (
    "graph replay (_fill)",
    "eager (prepare_step)",
    "sample greedy",
    "sample t=1",
    "sample top-p 0.9",
    "sample top-p 0.9 seeded",
    "sample top-k 50",
)


def measure(root: Path, batches: str, blocks: int) -> dict[int, tuple[float, ...]]:
    """Milliseconds per step of each of PATHS per batch, with `root`'s runtime, in a child."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", _CHILD, batches, str(blocks)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the run with {root} failed:\n{out.stderr[-3000:]}")
    return {int(b): tuple(v) for b, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--blocks", type=int, default=32, help="block-table width (64-token blocks)")
    p.add_argument("--against", help="git revision of a baseline")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    sides = {"checkout": ROOT}
    runs: dict[str, list[dict[int, tuple[float, ...]]]] = {"baseline": [], "checkout": []}
    with tempfile.TemporaryDirectory() as tmp:
        git = ["git", "-C", str(ROOT)]
        if a.against:
            base = Path(tmp) / "baseline"
            subprocess.run(
                [*git, "worktree", "add", "--detach", "-q", str(base), a.against], check=True
            )
            sides = {"baseline": base, **sides}
        try:
            for i in range(a.rounds if a.against else 1):
                for side, root in sides.items():
                    r = measure(root, a.batches, a.blocks)
                    runs[side].append(r)
                    cells = "; ".join(
                        f"batch {b}: "
                        + ", ".join(f"{n} {v:.3f} ms" for n, v in zip(PATHS, t, strict=True))
                        for b, t in r.items()
                    )
                    print(f"round {i + 1} {side}: {cells}", flush=True)
        finally:
            if a.against:
                subprocess.run([*git, "worktree", "remove", "--force", str(base)], check=False)
    if not a.against:
        return
    print(f"\nmedians over {a.rounds} alternated rounds ({a.against} -> this checkout):")
    for b in runs["checkout"][0]:
        for k, name in enumerate(PATHS):
            before = statistics.median(r[b][k] for r in runs["baseline"])
            after = statistics.median(r[b][k] for r in runs["checkout"])
            print(f"  batch {b} {name}: {before:.3f} -> {after:.3f} ms ({before / after:.2f}x)")


if __name__ == "__main__":
    main()
