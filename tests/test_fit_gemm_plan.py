"""evals/bench/fit_gemm_plan.py: the planner's constants fit to a sweep's timings.

The timings are synthetic: the model's own estimates under other constants than the module's
(a GPU whose warps fill more of the issue rate and whose loads take longer), scaled and with
a few percent of deterministic noise, over the decode tiles of the C table (written out here,
so no nvcc is needed) on Llama-3-8B's shapes. The fit must find constants whose choices are the
fastest launches (regret 1.0) where the current constants' choices are not, and read the JSON
lines `cuda_gemm.py --sweep-json` writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

from runtime.kernels.cuda import gemm_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals" / "bench"))
import fit_gemm_plan  # noqa: E402

# csrc/w4a16_gemm.cu's decode rows: id, block_m, block_n, block_k, warps, warps_m, warps_k,
# stages, swap_ab
TABLE = tuple(
    gemm_plan.TileConfig(*row)
    for row in [
        (0, 16, 64, 128, 4, 1, 1, 4, 0),
        (1, 16, 128, 128, 4, 1, 1, 4, 0),
        (2, 16, 256, 64, 8, 1, 1, 4, 0),
        (3, 32, 128, 64, 4, 1, 1, 4, 0),
        (8, 16, 128, 128, 8, 1, 2, 4, 0),
        (9, 16, 64, 128, 8, 1, 4, 4, 0),
        (10, 8, 128, 128, 4, 1, 1, 4, 1),
        (11, 8, 128, 128, 8, 1, 2, 4, 1),
        (12, 16, 128, 128, 4, 1, 1, 4, 1),
    ]
)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
TRUTH = {"_ISSUE_PER_WARP": 0.5, "_LATENCY_S": 0.5e-6}


def sweep_lines(truth: dict[str, float]) -> list[str]:
    lines = []
    with fit_gemm_plan.constants(truth):
        for m, (shape, (n, k)) in itertools.product((1, 16), sorted(SHAPES.items())):
            plans = gemm_plan.ranked(TABLE, m, n, k, 128, 132, "sm_90")
            for i, p in enumerate(q for q in plans if isinstance(q, gemm_plan.GemmPlan)):
                est = gemm_plan.estimate_seconds(p.tile, m, n, k, 128, p.split_k, 132) * 1e3
                noise = 1 + 0.01 * math.sin(7 * i + m)  # deterministic, about 1%
                record = dict(shape=shape, m=m, n=n, k=k, group_size=128, sms=132)
                record |= dataclasses.asdict(p.tile) | dict(split_k=p.split_k)
                record |= dict(ms=1.3 * est * noise, model_ms=est, planned=i == 0)
                lines.append(json.dumps(record))
    return lines


def test_fit_finds_the_constants_that_rank_the_fastest_first(tmp_path: Path) -> None:
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(sweep_lines(TRUTH)) + "\n")
    timings = fit_gemm_plan.read([path])
    assert len({t.case for t in timings}) == 8 and len(timings) > 8 * 5
    before = {name: getattr(gemm_plan, name) for name in fit_gemm_plan.GRID}
    best, fitted, now = fit_gemm_plan.fit(timings)
    assert now.regret > 1.02  # the current constants choose slower launches on this "GPU"
    assert fitted.regret < 1.01 and fitted.log_error < now.log_error
    assert best["_ISSUE_PER_WARP"] > before["_ISSUE_PER_WARP"]  # towards the truth
    assert {name: getattr(gemm_plan, name) for name in before} == before  # restored


def test_no_timings_is_an_error(tmp_path: Path) -> None:
    import pytest

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no timings"):
        fit_gemm_plan.read([tmp_path / "empty.jsonl"])


def test_sweeps_from_before_the_swapped_tiles_read_as_unswapped(tmp_path: Path) -> None:
    """The 2026-12 sweeps' records have no swap_ab field: their tiles are the unswapped ones."""
    lines = [json.loads(line) for line in sweep_lines(TRUTH)]
    old = [r for r in lines if not r["swap_ab"]]
    for r in old:
        del r["swap_ab"]
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    timings = fit_gemm_plan.read([tmp_path / "old.jsonl"])
    assert len(timings) == len(old) and not any(t.tile.swap_ab for t in timings)
    assert {t.tile for t in timings} <= set(TABLE)
