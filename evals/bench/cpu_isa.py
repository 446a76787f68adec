"""The CPU engine on every instruction-set path this host runs natively, in one run (issue 19).

A CPU figure holds for the machine it was measured on. The developers' machine is an AVX2-only
EPYC; a machine lent for the GPU check has a server CPU of its own (AVX-512 on current Xeons
and EPYCs), so the GPU check runs this beside its GPU stages. It measures `engine.py`'s
protocol (batch-1 and batch-8 decode, 128-token prefill, transformers fp32 in the same run)
with `--threads` threads pinned to as many physical cores, once per path: the native build
and, on an AVX-512 host, the AVX2 path forced (`LITESERVE_CPU_ISA=avx2`), as an AVX2-only
machine of the same clock would run it.

The model is a random Llama of SmolLM2-135M's shape with the real 49152-token tokenizer and
its RTN g64 artifact (`random_model.py smollm2`): speed depends on the shapes, not the
weights, and the real GGUF (98 MB) is too large to carry to a lent machine.

    python evals/bench/cpu_isa.py WORK [--tokenizer .tok] [--threads 2] [--cpus 14,15]
        [--shape smollm2] [--batches 1,8] [--new-tokens 64]

prints markdown: each run's full output as it ends (the CPU, its copy bandwidth, the dispatch
table, where a step's time goes), a summary table with one row per path, and, with two paths,
`engine_ab.py --isas`'s medians of `--rounds` alternated runs of each (one run per path cannot
tell 20% from a shared host's drift).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
# engine.py's first table: | batch | prefill | decode | hf fp32 | hf bf16 | / fp32 | / bf16 |
ROW = re.compile(r"^\| (\d+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| [^|]+ \| ([\d.]+)x \|")


HEADER = (
    "| path | C kernels | batch-1 decode tok/s | largest batch decode tok/s "
    "| batch-1 prefill tok/s | hf fp32 batch-1 decode tok/s | batch 1 / hf fp32 |\n"
    "|---|---|---:|---:|---:|---:|---:|"
)


def core_groups(allowed: set[int]) -> list[list[int]]:
    """The allowed CPUs grouped by physical core (SMT siblings together), in CPU order; a CPU
    whose topology cannot be read is a core of its own."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(allowed):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            siblings = tuple(parse_cpu_list(path.read_text()))
        except (OSError, ValueError):
            siblings = (cpu,)
        groups.setdefault(siblings, []).append(cpu)
    return list(groups.values())


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's CPU list format) as [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def reserve(threads: int, groups: list[list[int]]) -> tuple[list[int], list[int]] | None:
    """(CPUs the benchmark runs on: one per core, the last `threads` cores; every CPU of those
    cores, to keep other work off them), or None when the host has too few cores to leave
    others for the rest of the check."""
    if len(groups) < threads + 2:
        return None
    chosen = groups[-threads:]
    return [g[0] for g in chosen], [c for g in chosen for c in g]


def paths(flags: set[str], machine: str = platform.machine()) -> list[str]:
    """The ISA paths worth timing here: the native build everywhere; AVX2 forced where the
    host has AVX-512 (the path an AVX2-only server of this kind would take)."""
    if machine in ("x86_64", "AMD64") and "avx512f" in flags and "avx2" in flags:
        return ["native", "avx2"]
    return ["native"]


def summarize(path: str, output: str) -> str:
    """One summary row from engine.py's output: its C kernels' path, batch-1 and largest-batch
    decode, batch-1 prefill, and the batch-1 ratio to transformers fp32."""
    kernels = next(
        (ln.split(":", 1)[1].split(";")[0].strip() for ln in output.splitlines()
         if ln.startswith("C kernels' path:")),
        "none (no C compiler?)",
    )  # fmt: skip
    rows = {int(m[1]): m for ln in output.splitlines() if (m := ROW.match(ln))}
    if 1 not in rows:
        return f"| {path} | {kernels} | - | - | - | - | engine.py printed no table |"
    top = rows[max(rows)]
    return (
        f"| {path} | {kernels} | {rows[1][3]} | {top[3]} (batch {top[1]}) | {rows[1][2]} | "
        f"{rows[1][4]} | {rows[1][5]}x |"
    )


def make_model(shape: str, work: Path, tokenizer: Path | None) -> tuple[Path, Path]:
    """(source, RTN g64 artifact) of a random model of `shape`, built on the CPU."""
    src, art = work / f"src-{shape}", work / f"art-{shape}"
    cmd = [sys.executable, str(BENCH / "random_model.py"), shape, str(work), "--device", "cpu"]
    cmd += ["--artifact", "--group-size", "64"]
    cmd += ["--tokenizer", str(tokenizer)] if tokenizer and tokenizer.is_dir() else []
    subprocess.run(cmd, check=True, stdout=sys.stderr, cwd=ROOT)
    return src, art


def run_engine(path: str, art: Path, src: Path, threads: int, a: argparse.Namespace) -> str:
    """engine.py's output for one ISA path, in a child process limited to `threads` threads
    (the CPUs this process is pinned to, when --cpus or the GPU check pinned it)."""
    env = {**os.environ, "LITESERVE_CPU_ISA": path, "OMP_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(BENCH / "engine.py"), "--artifact", str(art), "--model", str(src)]
    cmd += ["--batches", a.batches, "--new-tokens", str(a.new_tokens), "--no-hf-bf16"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"engine.py on the {path} path failed:\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path, help="folder for the random model and its artifact")
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".tok")
    p.add_argument("--shape", default="smollm2", help="random_model.py's shape")
    p.add_argument("--threads", type=int, default=2, help="as on the developers' 2-core machine")
    p.add_argument("--cpus", help="CPUs to pin to (default: those this process may use)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="alternated runs of the paths")
    a = p.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, parse_cpu_list(a.cpus))
    allowed = sorted(os.sched_getaffinity(0))
    threads = min(a.threads, len(allowed))
    start = time.perf_counter()
    a.work.mkdir(parents=True, exist_ok=True)
    src, art = make_model(a.shape, a.work, a.tokenizer)
    built = time.perf_counter() - start
    from runtime.kernels.isa import host_flags  # here: gpu_check.py imports this module

    chosen = paths(host_flags())
    if not (a.tokenizer / "tokenizer.json").is_file():
        print(f"No tokenizer in {a.tokenizer}: a 512-token vocabulary, so the lm_head's share of a "
              "step is far below SmolLM2's (prepare-device.sh writes .tok).\n")  # fmt: skip
    print(
        f"A random model of {a.shape}'s shape and its RTN g64 artifact, made in {built:.0f} s; "
        f"{threads} threads on CPUs {','.join(map(str, allowed))}; paths: {', '.join(chosen)}.",
        flush=True,
    )
    rows = []
    for path in chosen:  # each run's output as soon as it ends: a time-out keeps the first
        out = run_engine(path, art, src, threads, a)
        rows.append(summarize(path, out))
        print(f"\n### LITESERVE_CPU_ISA={path}\n\n```\n{out.rstrip()}\n```", flush=True)
    print("\n### Summary (one run per path)\n\n" + HEADER)
    print("\n".join(rows))
    if len(chosen) > 1:  # single runs drift apart on a shared host: alternate the two paths
        medians = alternate(art, chosen, threads, a).rstrip()
        print(f"\n### The paths alternated\n\n```\n{medians}\n```")


def alternate(art: Path, chosen: list[str], threads: int, a: argparse.Namespace) -> str:
    """engine_ab.py's medians of alternated runs of the paths, the last named first (the
    native build's gain over the path an older machine of this kind would take)."""
    cmd = [sys.executable, str(BENCH / "engine_ab.py"), "--artifact", str(art)]
    cmd += ["--isas", ",".join(reversed(chosen)), "--rounds", str(a.rounds)]
    cmd += ["--batches", a.batches, "--new-tokens", str(a.new_tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"engine_ab.py failed:\n{done.stderr[-3000:]}")
    return done.stdout


if __name__ == "__main__":
    main()
