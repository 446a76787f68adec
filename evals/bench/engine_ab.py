"""Engine throughput of two variants alternated: this checkout against another git revision's,
or two CPU ISA paths of this checkout against each other.

On a machine whose speed drifts by 30% within minutes (the developers' 2-core VM), one run of
`engine.py` before a change and one after cannot tell 20% from noise. This script runs the
same measurement (`engine.py`'s `bench_runtime`, each revision's own: 128-token prompts, then
`--new-tokens` greedy tokens, int8 KV) on both variants, each in a fresh child process, taking
turns `--rounds` times. `--against REV` checks REV out in a temporary git worktree and runs its
`runtime` from its root; `--isas A,B` runs this checkout with `LITESERVE_CPU_ISA=A` and `=B`
(e.g. `native,avx2` on an AVX-512 host: what the wide path gives over an AVX2-only machine of
the same clock). Each variant builds and caches its own C kernels and dispatch table.

    python evals/bench/engine_ab.py --artifact out/smollm2-awq --against 961c0f9 [--rounds 3]
        [--batches 1,8] [--new-tokens 32]
    python evals/bench/engine_ab.py --artifact out/smollm2-awq --isas avx2,native

Prints one line per run and, per batch, the median of each side and their ratio (above 1:
the second variant, this checkout or B, faster).
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
try:  # first: LITESERVE_CPU_ISA limits torch before it loads (revisions before it lack it)
    import runtime.kernels.isa  # noqa: F401
except ImportError:
    pass
from evals.bench.engine import bench_runtime
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
batches = [int(b) for b in sys.argv[2].split(",")]
engine = Engine(sys.argv[1], EngineConfig(kv_quant="int8", session_len=1024, backend="cpu",
                                          max_batch_size=max(batches)))
bench_runtime(engine, 2, 4)  # warm-up
result = {b: bench_runtime(engine, b, int(sys.argv[3])) for b in batches}
print(json.dumps(result))
"""


def child_path(root: Path) -> str:
    """`root` first on the child's path, then the environment's entries other than this
    checkout: packages installed beside the interpreter's (a lent GPU machine's carried wheels
    in /tmp/site) stay importable, while `runtime` comes from `root` alone."""
    own = str(Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != own]
    return os.pathsep.join([str(root), *rest])


def measure(
    root: Path, artifact: str, batches: str, new: int, isa: str | None = None
) -> dict[int, tuple[float, float]]:
    """(prefill, decode) tokens/s per batch, with `root`'s runtime (on ISA path `isa`, else
    the environment's), in a child process."""
    env = {**os.environ, "PYTHONPATH": child_path(root)}
    if isa is not None:
        env["LITESERVE_CPU_ISA"] = isa
    cmd = [sys.executable, "-c", _CHILD, artifact, batches, str(new)]
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the run with {root} failed:\n{out.stderr[-3000:]}")
    last = out.stdout.strip().splitlines()[-1]
    return {int(b): tuple(v) for b, v in json.loads(last).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", required=True)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--against", help="git revision of the baseline")
    which.add_argument("--isas", help="two LITESERVE_CPU_ISA paths, baseline first: avx2,native")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    artifact = str(Path(a.artifact).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        if a.isas:
            names = a.isas.split(",")
            if len(names) != 2:
                p.error("--isas takes two paths, e.g. avx2,native")
            sides = [(f"ISA {n}", ROOT, n) for n in names]
            run_rounds(sides, artifact, a)
            return
        base = Path(tmp) / "baseline"
        git = ["git", "-C", str(ROOT)]
        add = ["worktree", "add", "--detach", "-q", str(base), a.against]
        subprocess.run([*git, *add], check=True)
        try:
            run_rounds([(a.against, base, None), ("this checkout", ROOT, None)], artifact, a)
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(base)], check=False)


def run_rounds(
    sides: list[tuple[str, Path, str | None]], artifact: str, a: argparse.Namespace
) -> None:
    """Each side once per round, in turn; then the medians and the second side's ratio."""
    runs: dict[str, list[dict[int, tuple[float, float]]]] = {name: [] for name, _, _ in sides}
    for i in range(a.rounds):
        for name, root, isa in sides:
            r = measure(root, artifact, a.batches, a.new_tokens, isa)
            runs[name].append(r)
            cells = ", ".join(
                f"batch {b} prefill {pf:.0f} decode {dc:.1f} tok/s" for b, (pf, dc) in r.items()
            )
            print(f"round {i + 1} {name}: {cells}", flush=True)
    (first, *_), (second, *_) = sides
    print(f"\nmedians over {a.rounds} alternated rounds ({first} -> {second}):")
    for b in runs[second][0]:
        for k, what in enumerate(("prefill", "decode")):
            before = statistics.median(r[b][k] for r in runs[first])
            after = statistics.median(r[b][k] for r in runs[second])
            print(f"  batch {b} {what}: {before:.1f} -> {after:.1f} tok/s ({after / before:.2f}x)")


if __name__ == "__main__":
    main()
