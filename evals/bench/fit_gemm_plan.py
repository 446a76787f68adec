"""Fit the csrc GEMM planner's machine constants to a GPU's timings of every candidate launch.

`cuda_gemm.py --sweep 1,16 --sweep-json SWEEP.jsonl` on a GPU times every fused launch the
planner ranks (each tile config and split-K) per shape and M. The planner
(runtime/kernels/cuda/gemm_plan.py) only has to rank them: what counts is how much slower its
first choice runs than the fastest measured launch (the regret). This script searches a grid of
the constants the model's time depends on most and the GPU cannot be asked for (how much of the
issue rate a warp fills, a load's round trip under load, the achievable HBM rate, the
instructions per weight word), scores each setting by the geometric mean of the regret over
every (shape, M) (ties broken by the estimates' log error against the measured times), and
prints the best setting against the current one, with the choice it changes per shape and M.

Runs anywhere (no GPU): the timings are data.

    python evals/bench/fit_gemm_plan.py SWEEP.jsonl [SWEEP2.jsonl ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from runtime.kernels.cuda import gemm_plan

# the constants searched, and the values tried (the module's current value is always tried)
GRID: dict[str, tuple[float, ...]] = {
    "_ISSUE_PER_WARP": (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5),
    "_LATENCY_S": (0.5e-6, 0.65e-6, 0.8e-6, 1.0e-6, 1.2e-6),
    "_HBM_BYTES_PER_S": (3.3e12, 3.7e12, 4.0e12, 4.3e12),
    "_WORD_INSTR": (14.0, 18.0, 22.0),
    "_SWAP_WORD_INSTR": (9.0, 13.0),
}


@dataclass(frozen=True)
class Timing:
    """One timed launch of the sweep."""

    shape: str
    m: int
    n: int
    k: int
    group_size: int
    sms: int
    tile: gemm_plan.TileConfig
    split_k: int
    ms: float

    @property
    def case(self) -> tuple[str, int]:
        return self.shape, self.m


def read(paths: list[Path]) -> list[Timing]:
    names = [f.name for f in fields(gemm_plan.TileConfig)]
    out = []
    for path in paths:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            tile = gemm_plan.TileConfig(**{f: r[f] for f in names if f in r})  # swap_ab: 0
            keys = ("shape", "m", "n", "k", "group_size", "sms", "split_k", "ms")
            out.append(Timing(**{f: r[f] for f in keys}, tile=tile))
    if not out:
        raise SystemExit("no timings in " + ", ".join(map(str, paths)))
    return out


@contextmanager
def constants(values: dict[str, float]) -> Iterator[None]:
    """gemm_plan's module constants set to ``values`` for the duration."""
    before = {name: getattr(gemm_plan, name) for name in values}
    for name, v in values.items():
        setattr(gemm_plan, name, v)
    try:
        yield
    finally:
        for name, v in before.items():
            setattr(gemm_plan, name, v)


def estimate(t: Timing) -> float:
    return gemm_plan.estimate_seconds(t.tile, t.m, t.n, t.k, t.group_size, t.split_k, t.sms)


@dataclass
class Score:
    regret: float  # geometric mean over cases of (the model's choice's ms) / (fastest ms)
    log_error: float  # RMS of ln(estimate / measured), after one common scale
    choices: dict[tuple[str, int], Timing]


def score(cases: dict[tuple[str, int], list[Timing]]) -> Score:
    """The current constants' regret and estimate error over every case."""
    logs, errs, choices = [], [], {}
    for case, timings in cases.items():
        estimates = [estimate(t) for t in timings]
        chosen = timings[min(range(len(timings)), key=estimates.__getitem__)]
        choices[case] = chosen
        logs.append(math.log(chosen.ms / min(t.ms for t in timings)))
        errs += [math.log(e * 1e3 / t.ms) for e, t in zip(estimates, timings, strict=True)]
    mean = sum(errs) / len(errs)
    rms = math.sqrt(sum((e - mean) ** 2 for e in errs) / len(errs))
    return Score(math.exp(sum(logs) / len(logs)), rms, choices)


def fit(timings: list[Timing]) -> tuple[dict[str, float], Score, Score]:
    """(best constants, their score, the current constants' score)."""
    cases: dict[tuple[str, int], list[Timing]] = defaultdict(list)
    for t in timings:
        cases[t.case].append(t)
    current = {name: getattr(gemm_plan, name) for name in GRID}
    now = score(cases)
    best, best_score = current, now
    grids = [sorted({*GRID[name], current[name]}) for name in GRID]
    for values in itertools.product(*grids):
        setting = dict(zip(GRID, values, strict=True))
        with constants(setting):
            s = score(cases)
        if (s.regret, s.log_error) < (best_score.regret, best_score.log_error):
            best, best_score = setting, s
    return best, best_score, now


def label(t: Timing) -> str:
    return f"config {t.tile.id} split {t.split_k} ({t.ms:.4f} ms)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", type=Path, nargs="+", help="cuda_gemm.py --sweep-json files")
    a = p.parse_args()
    timings = read(a.sweeps)
    best, fitted, now = fit(timings)
    cases = sorted({t.case for t in timings})
    print(f"# The GEMM planner's constants fit to {len(timings)} launches, {len(cases)} cases\n")
    print("| constant | current | fit |\n|---|---:|---:|")
    for name in GRID:
        print(f"| {name} | {getattr(gemm_plan, name):.3g} | {best[name]:.3g} |")
    print(
        f"\nRegret (the model's choice against the fastest, geomean): {now.regret:.3f}x now, "
        f"{fitted.regret:.3f}x fit. Estimates' log error (RMS): {now.log_error:.3f} now, "
        f"{fitted.log_error:.3f} fit.\n"
    )
    print("| shape | M | current choice | fit's choice | fastest |\n|---|---:|---|---|---|")
    by_case = defaultdict(list)
    for t in timings:
        by_case[t.case].append(t)
    for case in cases:
        fastest = min(by_case[case], key=lambda t: t.ms)
        print(
            f"| {case[0]} | {case[1]} | {label(now.choices[case])} | "
            f"{label(fitted.choices[case])} | {label(fastest)} |"
        )


if __name__ == "__main__":
    main()
