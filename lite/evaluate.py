"""`lite eval`: the source model and every artifact x KV policy on the same tasks, one report.

The baseline is lm-eval's own `hf` model on the source checkpoint, so the reference number is
the one users already trust; each variant is the `liteserve` model, which runs the artifact in
the runtime engine exactly as `runtime serve` would (KV quantization included). Models run one
after another and are freed in between, so only one is resident at a time.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

from lite.perplexity import (
    PerplexityResult,
    artifact_label,
    eval_dtype,
    run_ppl,
    variant_name,
)
from lite.report import SCHEMA_VERSION
from runtime.artifact.reader import Artifact, read_manifest

BASELINE = "source"
_LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", None}


class EvalError(ValueError):
    """A problem with the evaluation's inputs, explained for the user."""


@dataclass(frozen=True)
class EvalPlan:
    model: str | None
    artifacts: tuple[Path, ...]
    kv_quants: tuple[str, ...] = ("none",)
    tasks: tuple[str, ...] = ()
    include_path: Path | None = None
    data_dir: Path | None = None
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int = 16
    max_length: int | None = None  # None: 2048, or less where an artifact holds less
    dtype: str = "auto"
    seed: int = 1234

    def __post_init__(self) -> None:
        """Every variant has its own name in the report: a repeat would be evaluated twice
        and then refused when the report is written, after the whole run."""
        _refuse_repeats("--kv-quant lists", self.kv_quants)
        _refuse_repeats("--artifact gives", [str(Path(a).resolve()) for a in self.artifacts])
        names = [artifact_label(a) for a in self.artifacts]
        for name in {n for n in names if names.count(n) > 1}:
            paths = ", ".join(str(a) for a in self.artifacts if artifact_label(a) == name)
            raise EvalError(
                f"two artifacts are named {name!r} ({paths}); the report names each variant by "
                "its directory: give one another name (a symbolic link will do)"
            )

    @cached_property
    def variants(self) -> list[dict[str, Any]]:
        """Baseline first; each artifact's manifest read once."""
        out = []
        if self.model:
            out.append(_variant(BASELINE, "source", model=self.model))
        for art in self.artifacts:
            method = Artifact(art, checksums=False).manifest.quantization.method
            for kv in self.kv_quants:
                out.append(_variant(variant_name(art, kv), "artifact", art, kv, method))
        return out


def _refuse_repeats(what: str, values: Sequence[str]) -> None:
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise EvalError(f"{what} {', '.join(repeated)} more than once; give each once")


def _variant(
    name: str,
    kind: str,
    artifact: Path | None = None,
    kv_quant: str | None = None,
    method: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "model": model,
        "artifact": str(artifact) if artifact else None,
        "kv_quant": kv_quant,
        "method": method,
    }


def _report(plan: EvalPlan, mode: str, command: str, settings: dict, rows: list) -> dict:
    from runtime import __version__

    variants = plan.variants
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "liteserve_version": __version__,
        "command": command,
        "mode": mode,
        "baseline": variants[0]["name"],
        "settings": settings,
        "variants": variants,
        "rows": rows,
    }


def check_artifacts(plan: EvalPlan) -> None:
    """Every artifact verified (checksums included) before hours of evaluation start."""
    if len({artifact_label(a) for a in plan.artifacts}) != len(plan.artifacts):
        raise EvalError("two --artifact directories share a name; rename one of them")
    for art in plan.artifacts:
        Artifact(art)


# --- perplexity mode -----------------------------------------------------------------------


def ppl_report(
    plan: EvalPlan,
    command: str,
    text_file: Path | None,
    seqlen: int,
    limit: int | None,
    progress: bool = True,
) -> dict:
    check_artifacts(plan)
    results = run_ppl(
        plan.model,
        plan.artifacts,
        text_file,
        seqlen,
        limit,
        plan.kv_quants,
        plan.dtype,
        batch_size=min(plan.batch_size, 4),
        progress=progress,
    )
    names = [v["name"] for v in plan.variants]
    task = text_file.name if text_file else "pydoc-heldout"
    rows = _ppl_rows(task, dict(zip(names, results, strict=True)), names[0])
    settings = {
        "text": str(text_file) if text_file else "pydoc held-out split",
        "seqlen": seqlen,
        "windows": results[0].windows,
        "tokens": results[0].tokens,
        "dtype": str(eval_dtype(plan.dtype)).removeprefix("torch."),
        "protocol": "non-overlapping windows, each scored alone; KL(baseline || variant) in "
        "nats and top-1 agreement over every predicted token; stderr over windows",
    }
    return _report(plan, "ppl", command, settings, rows)


def _ppl_rows(task: str, results: dict[str, PerplexityResult], base: str) -> list[dict]:
    def row(metric: str, higher: bool, value, stderr) -> dict:
        return {
            "task": task,
            "metric": metric,
            "higher_is_better": higher,
            "samples": results[base].tokens,
            "values": {n: value(r) for n, r in results.items()},
            "stderr": {n: stderr(r) for n, r in results.items()},
        }

    return [
        row("ppl", False, lambda r: r.ppl, lambda r: r.ppl_stderr),
        row("kl", False, lambda r: r.kl.mean if r.kl else 0.0, lambda r: r.kl and r.kl.stderr),
        row(
            "top1",
            True,
            lambda r: r.top1.mean if r.top1 else 1.0,
            lambda r: r.top1 and r.top1.stderr,
        ),
    ]


# --- task mode (lm-eval) -------------------------------------------------------------------


def task_manager(plan: EvalPlan):
    """Local tasks alone when they cover the request (indexing lm-eval's own ~15k tasks costs
    seconds); the hub tasks otherwise, after a quick reachability check."""
    from lm_eval.tasks import TaskManager

    metadata = {"data_dir": str(plan.data_dir)} if plan.data_dir else None
    include = str(plan.include_path) if plan.include_path else None
    if include:
        local = TaskManager(include_path=include, include_defaults=False, metadata=metadata)
        if all(t in local.all_subtasks or t in local.all_groups for t in plan.tasks):
            return local
    manager = TaskManager(include_path=include, metadata=metadata)
    unknown = [t for t in plan.tasks if t not in manager.all_tasks]
    if unknown:
        hint = "" if include else "; local tasks need --include-path evals/tasks"
        raise EvalError(f"unknown task(s) {', '.join(unknown)}{hint}")
    _require_hub(plan.tasks)
    return manager


def read_documents(plan: EvalPlan, manager) -> None:
    """Every task's documents read once before any model loads: a missing data folder or a
    damaged file was found after the first model had loaded (minutes, for a large one). The
    tasks are built again for each model, as lm-eval builds them; local files read fast."""
    from lm_eval.tasks import get_task_dict

    get_task_dict(list(plan.tasks), manager)


def _require_hub(tasks: tuple[str, ...]) -> None:
    from lite.sources import hub_unreachable

    offline = hub_unreachable()
    if offline:
        raise EvalError(
            f"task(s) {', '.join(tasks)} download their data from the Hugging Face hub "
            f"({offline}). Offline, use the local tasks (piqa_local, arc_easy_local, "
            f"arc_challenge_local, hellaswag_local, lambada_local, wikitext_local) with "
            f"--include-path evals/tasks --data-dir DIR (see evals/README.md)"
        )


def _max_length(plan: EvalPlan) -> int:
    """One context for every model, checked before any loads: a --max-length an artifact
    cannot hold would be cut on one side only."""
    from lite.lm_eval_model import DEFAULT_MAX_LENGTH, default_max_length, session_len

    positions = {a: read_manifest(a).architecture.max_position_embeddings for a in plan.artifacts}
    if plan.max_length is None:
        return min([DEFAULT_MAX_LENGTH, *map(default_max_length, positions.values())])
    for art, n in positions.items():
        try:
            session_len(plan.max_length, n)
        except ValueError as e:
            raise EvalError(f"--max-length: {e} ({art})") from e
    return plan.max_length


def task_report(plan: EvalPlan, command: str, progress: bool = True) -> dict:
    if not plan.tasks:
        raise EvalError("give --tasks (for example piqa_local,arc_easy_local) or --ppl")
    check_artifacts(plan)
    plan = replace(plan, max_length=_max_length(plan))
    manager = task_manager(plan)
    read_documents(plan, manager)
    outputs = {}
    for variant in plan.variants:
        lm = _load(variant, plan, progress)
        outputs[variant["name"]] = _evaluate(lm, plan, manager, progress)
        del lm
        gc.collect()
    settings = {
        "tasks": list(plan.tasks),
        "limit": plan.limit,
        "num_fewshot": plan.num_fewshot,
        "max_length": plan.max_length,
        "batch_size": plan.batch_size,
        "dtype": str(eval_dtype(plan.dtype)).removeprefix("torch."),
        "seed": plan.seed,
        "include_path": str(plan.include_path) if plan.include_path else None,
        "data_dir": str(plan.data_dir) if plan.data_dir else None,
    }
    return _report(plan, "tasks", command, settings, task_rows(outputs, next(iter(outputs))))


def _load(variant: dict, plan: EvalPlan, progress: bool):
    dtype = str(eval_dtype(plan.dtype)).removeprefix("torch.")
    if variant["kind"] == "source":
        from lm_eval.models.huggingface import HFLM

        from lite.sources import resolve

        return HFLM(
            pretrained=str(resolve(variant["model"]).path),
            dtype=dtype,
            batch_size=plan.batch_size,
            max_length=plan.max_length,
            device="cuda" if _cuda() else "cpu",
        )
    from lite.lm_eval_model import LiteserveLM

    return LiteserveLM(
        variant["artifact"],
        kv_quant=variant["kv_quant"],
        max_length=plan.max_length,
        dtype=dtype,
        batch_size=plan.batch_size,
        progress=progress,
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _evaluate(lm, plan: EvalPlan, manager, progress: bool) -> dict:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(plan.tasks),
        num_fewshot=plan.num_fewshot,
        limit=plan.limit,
        task_manager=manager,
        log_samples=False,
        bootstrap_iters=1000,
        random_seed=plan.seed,
        numpy_random_seed=plan.seed,
        torch_random_seed=plan.seed,
        fewshot_random_seed=plan.seed,
        verbosity="WARNING" if not progress else "INFO",
    )
    if out is None:  # lm-eval returns None on non-zero ranks only
        raise EvalError("lm-eval returned no results")
    return out


def task_rows(outputs: dict[str, dict], baseline: str) -> list[dict]:
    """One row per (task, metric) in the baseline's results (the source's, or without one
    the first variant's); stderr from lm-eval."""
    base = outputs[baseline]
    rows = []
    for task, metrics in base["results"].items():
        better = base.get("higher_is_better", {}).get(task, {})
        samples = base.get("n-samples", {}).get(task, {}).get("effective")
        for key, value in metrics.items():
            metric, _, flt = key.partition(",")
            if metric not in better or not isinstance(value, (int, float)):
                continue  # stderr entries and bookkeeping such as sample_len
            stderr_key = f"{metric}_stderr,{flt}"
            rows.append(
                {
                    "task": task,
                    "metric": metric if flt in ("none", "") else key,
                    "higher_is_better": better.get(metric),
                    "samples": samples,
                    "values": {n: o["results"][task].get(key) for n, o in outputs.items()},
                    "stderr": {
                        n: _number(o["results"][task].get(stderr_key)) for n, o in outputs.items()
                    },
                }
            )
    return rows


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) else None
