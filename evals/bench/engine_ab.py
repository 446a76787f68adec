"""Engine throughput of this checkout against another git revision's, alternated.

On a machine whose speed drifts by 30% within minutes (the developers' 2-core VM), one run of
`engine.py` before a change and one after cannot tell 20% from noise. This script checks out
`--against` in a temporary git worktree and runs the same measurement (`engine.py`'s
`bench_runtime`, each revision's own: 128-token prompts, then `--new-tokens` greedy tokens,
int8 KV) on that revision's `runtime` and on this checkout's, each in a fresh child process
run from its root, taking turns
`--rounds` times. Each revision builds and caches its own C kernels and dispatch table.

    python evals/bench/engine_ab.py --artifact out/smollm2-awq --against 961c0f9 [--rounds 3]
        [--batches 1,8] [--new-tokens 32]

Prints one line per run and, per batch, the median of each side and their ratio (above 1:
this checkout faster).
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

# run in the child from the revision's root (first on sys.path), with its own harness
_CHILD = """
import json, sys
import runtime.kernels.isa  # noqa: F401  first: LITESERVE_CPU_ISA limits torch before it loads
from evals.bench.engine import bench_runtime
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
batches = [int(b) for b in sys.argv[2].split(",")]
engine = Engine(sys.argv[1], EngineConfig(kv_quant="int8", session_len=1024,
                                          max_batch_size=max(batches)))
bench_runtime(engine, 2, 4)  # warm-up
result = {b: bench_runtime(engine, b, int(sys.argv[3])) for b in batches}
print(json.dumps(result))
"""


def measure(root: Path, artifact: str, batches: str, new: int) -> dict[int, tuple[float, float]]:
    """(prefill, decode) tokens/s per batch, with `root`'s runtime, in a child process."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", _CHILD, artifact, batches, str(new)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the run with {root} failed:\n{out.stderr[-3000:]}")
    last = out.stdout.strip().splitlines()[-1]
    return {int(b): tuple(v) for b, v in json.loads(last).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True)
    p.add_argument("--against", required=True, help="git revision of the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    artifact = str(Path(a.artifact).resolve())
    runs: dict[str, list[dict[int, tuple[float, float]]]] = {"baseline": [], "checkout": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        git = ["git", "-C", str(ROOT)]
        add = ["worktree", "add", "--detach", "-q", str(base), a.against]
        subprocess.run([*git, *add], check=True)
        try:
            for i in range(a.rounds):
                for side, root in (("baseline", base), ("checkout", ROOT)):
                    r = measure(root, artifact, a.batches, a.new_tokens)
                    runs[side].append(r)
                    cells = ", ".join(
                        f"batch {b} prefill {pf:.0f} decode {dc:.1f} tok/s"
                        for b, (pf, dc) in r.items()
                    )
                    print(f"round {i + 1} {side}: {cells}", flush=True)
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(base)], check=False)
    print(f"\nmedians over {a.rounds} alternated rounds ({a.against} -> this checkout):")
    for b in runs["checkout"][0]:
        for k, name in enumerate(("prefill", "decode")):
            before = statistics.median(r[b][k] for r in runs["baseline"])
            after = statistics.median(r[b][k] for r in runs["checkout"])
            print(f"  batch {b} {name}: {before:.1f} -> {after:.1f} tok/s ({after / before:.2f}x)")


if __name__ == "__main__":
    main()
