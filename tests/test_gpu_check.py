"""The GPU check's time budget (evals/bench/gpu_check.py): each stage's limit on the H200's
measured stage times, with the real plan's caps and reserves. Pure Python: no GPU, nothing run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

# What each stage took on the H200 on 2026-12-04 (docs/gpu-check.md), in seconds.
H200 = {"environment": 12, "gpu-tests": 97, "model-1b": 43, "model-8b": 45}


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch):
    # the script imports its folder's modules by their bare names, as it runs
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "evals" / "bench"))
    import gpu_check

    return gpu_check


def default_plan(gpu_check, tmp_path: Path):
    a = argparse.Namespace(
        smoke=False, budget=540.0, only=None, layers_8b=4, tokenizer=tmp_path / "no-tok"
    )
    return gpu_check.plan(a, tmp_path, tmp_path, ([6, 7], [6, 7, 14, 15]))


def test_model_builds_may_run_while_the_gpu_tests_may(gpu_check, tmp_path: Path) -> None:
    """The bug: the 8B build got 35 s (it takes 45 s) because the measuring stages' reserves
    were kept out of the wall clock, though they wait for the GPU tests beside it anyway."""
    p = default_plan(gpu_check, tmp_path)
    [tests] = [s for s in p.foreground_first if s.skip is None]
    model, model8 = p.background
    left = 540.0 - H200["environment"]
    fg = gpu_check.stage_limit(tests, p.measuring, left)
    assert fg is not None and fg >= H200["gpu-tests"]
    # the 1B build starts with the tests, the 8B one after it, both beside the tests
    first = gpu_check.stage_limit(model, [model8, *p.measuring], left, fg)
    assert first is not None and first >= H200["model-1b"]
    left8 = left - H200["model-1b"]
    limit8 = gpu_check.stage_limit(model8, p.measuring, left8, fg - H200["model-1b"])
    assert limit8 is not None and limit8 >= H200["model-8b"]
    # and not past what the tests may take: the measuring stages keep their reserves after
    assert limit8 <= fg - H200["model-1b"]


def test_a_stage_keeps_the_later_reserves(gpu_check, tmp_path: Path) -> None:
    p = default_plan(gpu_check, tmp_path)
    kept = sum(s.reserve for s in p.measuring if s.skip is None)
    engine = p.measuring[0]
    later = p.measuring[1:]
    left = kept + 30.0
    limit = gpu_check.stage_limit(engine, later, left)
    assert limit == pytest.approx(left - sum(s.reserve for s in later if s.skip is None))
    assert gpu_check.stage_limit(engine, later, 10.0) is None  # not worth starting
    # a stage never runs past the budget, whatever runs beside it
    assert gpu_check.stage_limit(engine, later, 60.0, overlapped=500.0) == pytest.approx(60.0)
