"""The comparison report of `lite eval`: one dict, rendered for people and kept for scripts.

A quantized artifact is only worth serving if it scores close to its source model, so the
evaluation ends in a report of deltas against a baseline. The dict (schema in
docs/eval-results.md) is the single source: the console table, report.md, the chart and the
artifact's model card are all renderings of it, so they can never disagree. Files are replaced
atomically because an eval takes hours and an interrupted one must not leave a torn result
next to a good one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from lite.model_card import EVAL_MARKER
from runtime.artifact.manifest import MODEL_CARD_FILE

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SCHEMA_VERSION = 1
MODES = ("tasks", "ppl")
TOP_KEYS = (
    "schema_version",
    "created",
    "liteserve_version",
    "command",
    "mode",
    "baseline",
    "settings",
    "variants",
    "rows",
)
VARIANT_KEYS = ("name", "kind", "model", "artifact", "kv_quant", "method")
ROW_KEYS = ("task", "metric", "higher_is_better", "samples", "values", "stderr")
MISSING = "—"
MAX_CHART_HEIGHT = 40  # inches: past this the bars get thinner rather than the image taller
PPL_LEGEND = (
    "ppl = perplexity; kl = mean KL(baseline ‖ variant) in nats/token; "
    "top1 = fraction of positions where the argmax matches the baseline's."
)


# --- validation ---------------------------------------------------------------------------


def _require_keys(obj: object, keys: tuple[str, ...], where: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    for key in keys:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r}")
    return obj


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _validate_variants(variants: object) -> list[str]:
    if not isinstance(variants, list) or not variants:
        raise ValueError("report: variants must be a non-empty list")
    names: list[str] = []
    for i, v in enumerate(variants):
        _require_keys(v, VARIANT_KEYS, f"variants[{i}]")
        if not isinstance(v["name"], str) or not v["name"]:
            raise ValueError(f"variants[{i}]: name must be a non-empty string")
        if v["name"] in names:
            raise ValueError(f"variants[{i}]: duplicate variant name {v['name']!r}")
        names.append(v["name"])
    return names


def _validate_per_variant(mapping: object, names: list[str], where: str, key: str) -> None:
    if not isinstance(mapping, dict):
        raise ValueError(f"{where}: {key} must be an object keyed by variant name")
    for name, x in mapping.items():
        if name not in names:
            raise ValueError(f"{where}: unknown variant {name!r} in {key}")
        if x is not None and not _is_number(x):
            raise ValueError(f"{where}: {key}[{name!r}] must be a number or null, got {x!r}")


def _validate_row(row: object, i: int, names: list[str]) -> None:
    where = f"rows[{i}]"
    _require_keys(row, ROW_KEYS, where)
    where = f"rows[{i}] ({row['task']}/{row['metric']})"
    if row["higher_is_better"] not in (True, False, None):
        raise ValueError(f"{where}: higher_is_better must be true, false or null")
    samples = row["samples"]
    if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool)):
        raise ValueError(f"{where}: samples must be an integer or null, got {samples!r}")
    _validate_per_variant(row["values"], names, where, "values")
    _validate_per_variant(row["stderr"], names, where, "stderr")


def validate(report: dict) -> None:
    """Raise ValueError naming the first thing that does not match schema version 1."""
    _require_keys(report, TOP_KEYS, "report")
    if report["schema_version"] != SCHEMA_VERSION:
        raise ValueError(
            f"report: schema_version is {report['schema_version']!r}, "
            f"this liteserve reads {SCHEMA_VERSION}"
        )
    if report["mode"] not in MODES:
        raise ValueError(f"report: mode is {report['mode']!r}, expected one of {MODES}")
    if not isinstance(report["settings"], dict):
        raise ValueError("report: settings must be an object")
    names = _validate_variants(report["variants"])
    if report["baseline"] not in names:
        raise ValueError(
            f"report: baseline {report['baseline']!r} is not among the variants {names}"
        )
    if not isinstance(report["rows"], list) or not report["rows"]:
        raise ValueError("report: rows must be a non-empty list")
    for i, row in enumerate(report["rows"]):
        _validate_row(row, i, names)


# --- deltas ---------------------------------------------------------------------------------


def _others(report: dict) -> list[str]:
    return [v["name"] for v in report["variants"] if v["name"] != report["baseline"]]


def _better(delta: float | None, higher_is_better: bool | None) -> bool | None:
    """None when the direction is unknown or nothing changed (a tie is neither)."""
    if delta is None or higher_is_better is None or delta == 0:
        return None
    return (delta > 0) == higher_is_better


def deltas(report: dict) -> list[dict]:
    """Per row and non-baseline variant; `stderr` is the variant's own (null when unknown)."""
    validate(report)
    out = []
    for row in report["rows"]:
        base = row["values"].get(report["baseline"])
        for name in _others(report):
            value = row["values"].get(name)
            delta = None if base is None or value is None else value - base
            out.append(
                {
                    "task": row["task"],
                    "metric": row["metric"],
                    "variant": name,
                    "delta": delta,
                    "baseline": base,
                    "value": value,
                    "stderr": row["stderr"].get(name),
                    "better": _better(delta, row["higher_is_better"]),
                }
            )
    return out


# --- the table, shared by markdown, the console and the card ----------------------------------


@dataclass(frozen=True)
class _Cell:
    text: str
    delta: str = ""
    better: bool | None = None


def _decimals(metric: str) -> int:
    if metric == "kl":
        return 5
    if metric == "ppl" or "perplexity" in metric:
        return 3
    return 4


def _fmt(x: float | None, decimals: int) -> str:
    return MISSING if x is None else f"{x:.{decimals}f}"


def _fmt_delta(delta: float, decimals: int) -> str:
    if abs(delta) < 0.5 * 10**-decimals:
        delta = 0.0  # never print "-0.000"
    return f"{delta:+.{decimals}f}"


def _metric_label(row: dict) -> str:
    arrow = {True: " ↑", False: " ↓", None: ""}[row["higher_is_better"]]
    return f"{row['metric']}{arrow}"


def _baseline_cell(row: dict, baseline: str) -> _Cell:
    d = _decimals(row["metric"])
    text = _fmt(row["values"].get(baseline), d)
    err = row["stderr"].get(baseline)
    return _Cell(text if err is None or text == MISSING else f"{text} ± {_fmt(err, d)}")


def _variant_cell(row: dict, d: dict) -> _Cell:
    decimals = _decimals(row["metric"])
    text = _fmt(d["value"], decimals)
    if d["delta"] is None:
        return _Cell(text)
    return _Cell(text, _fmt_delta(d["delta"], decimals), d["better"])


def _table(report: dict) -> tuple[list[str], list[list[_Cell]]]:
    """Header and body: task | metric | n | baseline | each variant with its delta."""
    baseline, others = report["baseline"], _others(report)
    header = ["task", "metric", "n", baseline, *(f"{name} (Δ)" for name in others)]
    by_row = iter(deltas(report))
    body = []
    for row in report["rows"]:
        n = MISSING if row["samples"] is None else str(row["samples"])
        cells = [_Cell(row["task"]), _Cell(_metric_label(row)), _Cell(n)]
        cells.append(_baseline_cell(row, baseline))
        cells.extend(_variant_cell(row, next(by_row)) for _ in others)
        body.append(cells)
    return header, body


def _legend(report: dict) -> str:
    text = (
        f"Δ = variant − baseline (`{report['baseline']}`); ↑/↓ = higher/lower is better; "
        f"± = standard error of the baseline's value; n = samples scored; "
        f"mode: {report['mode']}."
    )
    return f"{text} {PPL_LEGEND}" if report["mode"] == "ppl" else text


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def _md_cell(cell: _Cell) -> str:
    text = f"{cell.text} ({cell.delta})" if cell.delta else cell.text
    return _md_escape(text)


def render_markdown(report: dict) -> str:
    """A one-line legend, a blank line, then one markdown table."""
    header, body = _table(report)
    lines = [
        _legend(report),
        "",
        "| " + " | ".join(_md_escape(h) for h in header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
    ]
    lines.extend("| " + " | ".join(_md_cell(c) for c in cells) + " |" for cells in body)
    return "\n".join(lines) + "\n"


def _rich_cell(cell: _Cell) -> Text:
    if not cell.delta:
        return Text(cell.text)
    style = {True: "green", False: "red", None: ""}[cell.better]
    return Text.assemble(cell.text, " ", (f"({cell.delta})", style))


def render_terminal(report: dict) -> Table:
    header, body = _table(report)
    table = Table(title=f"lite eval ({report['mode']})", caption=_legend(report))
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if i >= 2 else "left")
    for cells in body:
        table.add_row(*(_rich_cell(c) for c in cells))
    return table


# --- files ----------------------------------------------------------------------------------


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Readers see the old file or the whole new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_text_atomic(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _setting(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(x) for x in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _describe_variant(v: dict, baseline: str) -> str:
    parts = []
    if v["model"]:
        parts.append(f"model `{v['model']}`")
    if v["artifact"]:
        parts.append(f"artifact `{v['artifact']}`")
    if v["method"]:
        parts.append(f"method {v['method']}")
    if v["kv_quant"]:
        parts.append(f"KV cache {v['kv_quant']}")
    role = " (baseline)" if v["name"] == baseline else ""
    return f"- `{v['name']}`{role}: " + (", ".join(parts) or v["kind"])


def _report_markdown(report: dict, chart_name: str) -> str:
    settings = "\n".join(f"- `{k}`: {_setting(v)}" for k, v in report["settings"].items())
    variants = "\n".join(_describe_variant(v, report["baseline"]) for v in report["variants"])
    return f"""# lite eval results ({report["mode"]})

Created {report["created"]} by liteserve {report["liteserve_version"]}:

```
{report["command"]}
```

## Settings

{settings or "none"}

## Results

{render_markdown(report)}
![Δ against the baseline per task and metric]({chart_name})

## Variants

{variants}
"""


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, report.md and deltas.png in out_dir (created), each replaced atomically."""
    validate(report)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json",
        "markdown": out_dir / "report.md",
        "chart": out_dir / "deltas.png",
    }
    _write_text_atomic(paths["json"], json.dumps(report, indent=2) + "\n")
    render_chart(report, paths["chart"])
    _write_text_atomic(paths["markdown"], _report_markdown(report, paths["chart"].name))
    return paths


# --- chart ----------------------------------------------------------------------------------


def _direction(report: dict, metric: str) -> str:
    hib = next(r["higher_is_better"] for r in report["rows"] if r["metric"] == metric)
    return {True: ", higher is better", False: ", lower is better", None: ""}[hib]


def _plot_metric(ax: Axes, report: dict, metric: str, ds: list[dict], colors: list) -> None:
    tasks = list(dict.fromkeys(r["task"] for r in report["rows"] if r["metric"] == metric))
    others = _others(report)
    height = 0.8 / max(1, len(others))
    for j, name in enumerate(others):
        mine = [
            d
            for d in ds
            if d["metric"] == metric and d["variant"] == name and d["delta"] is not None
        ]
        if not mine:
            continue
        ys = [tasks.index(d["task"]) - 0.4 + (j + 0.5) * height for d in mine]
        errs = [float("nan") if d["stderr"] is None else d["stderr"] for d in mine]
        known = any(d["stderr"] is not None for d in mine)
        ax.barh(
            ys,
            [d["delta"] for d in mine],
            height=height,
            xerr=errs if known else None,
            color=colors[j],
            capsize=2,
        )
    if not others:
        ax.text(0.5, 0.5, "no variant to compare", ha="center", va="center", transform=ax.transAxes)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_ylim(len(tasks) - 0.5, -0.5)
    ax.set_title(metric)
    ax.set_xlabel(f"Δ {metric} (variant − {report['baseline']}{_direction(report, metric)})")
    ax.set_ylabel("text set" if report["mode"] == "ppl" else "task")
    ax.grid(axis="x", alpha=0.3)


def _colors(n: int) -> list:
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    cmap = matplotlib.colormaps["viridis"]
    return [cmap(i / (n - 1)) for i in range(n)]


def render_chart(report: dict, path: Path) -> None:
    """Horizontal delta bars, one subplot per metric; drawn on Agg so no display is needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ds = deltas(report)
    metrics = list(dict.fromkeys(r["metric"] for r in report["rows"]))
    others = _others(report)
    ratios = [
        max(1, sum(r["metric"] == m for r in report["rows"])) * max(1, len(others)) * 0.3 + 1.2
        for m in metrics
    ]
    fig = Figure(figsize=(9, min(MAX_CHART_HEIGHT, sum(ratios) + 0.6)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(metrics), 1, squeeze=False, height_ratios=ratios)[:, 0]
    colors = _colors(len(others))
    for ax, metric in zip(axes, metrics, strict=True):
        _plot_metric(ax, report, metric, ds, colors)
    if others:
        handles = [Patch(color=c, label=n) for n, c in zip(others, colors, strict=True)]
        fig.legend(handles=handles, loc="outside lower center", ncols=min(4, len(others)))
    fig.suptitle(f"lite eval ({report['mode']}): Δ against {report['baseline']}")
    _atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=110))


# --- model card -----------------------------------------------------------------------------


def _same_path(a: str, b: Path) -> bool:
    return Path(a).expanduser().resolve() == b.expanduser().resolve()


def _subset(report: dict, names: list[str]) -> dict:
    """The report restricted to some variants (the baseline is always kept)."""
    keep = {report["baseline"], *names}

    def pick(mapping: dict) -> dict:
        return {k: v for k, v in mapping.items() if k in keep}

    rows = [{**r, "values": pick(r["values"]), "stderr": pick(r["stderr"])} for r in report["rows"]]
    variants = [v for v in report["variants"] if v["name"] in keep]
    return {**report, "variants": variants, "rows": rows}


def _card_variants(artifact_dir: Path, report: dict, prefix: str | None) -> list[str]:
    names = [
        v["name"]
        for v in report["variants"]
        if v["name"] != report["baseline"]
        and v["artifact"]
        and _same_path(v["artifact"], artifact_dir)
        and (prefix is None or v["name"].startswith(prefix))
    ]
    if not names:
        raise ValueError(
            f"{artifact_dir}: no variant of the report is this artifact"
            + (f" with a name starting {prefix!r}" if prefix else "")
            + f" (artifacts in the report: {[v['artifact'] for v in report['variants']]})"
        )
    return names


def _card_section(report: dict) -> str:
    settings = "; ".join(f"{k} = {_setting(v)}" for k, v in report["settings"].items())
    return f"""{EVAL_MARKER}

Evaluated {report["created"]} with liteserve {report["liteserve_version"]} \
({report["mode"]} mode; settings: {settings or "none"}):

```
{report["command"]}
```

{render_markdown(report)}"""


def _replace_section(card: str, section: str) -> str:
    """Swap the Evaluation section (to the next `## ` heading or the end); append if absent."""
    lines = card.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip("\r\n") == EVAL_MARKER), None)
    if start is None:
        head = card if card.endswith("\n") or not card else card + "\n"
        return f"{head}\n{section}" if head else section
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
        len(lines),
    )
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + section + (f"\n{tail}" if tail else "")


def update_card(artifact_dir: Path, report: dict, variant_prefix: str | None = None) -> None:
    """Put this artifact's rows (and the baseline) in its model card's Evaluation section.

    Variants are those whose `artifact` resolves to artifact_dir; `variant_prefix` narrows them
    further to names starting with it. The card is outside the artifact's checksums.
    """
    validate(report)
    artifact_dir = Path(artifact_dir)
    names = _card_variants(artifact_dir, report, variant_prefix)
    card_path = artifact_dir / MODEL_CARD_FILE
    card = card_path.read_text(encoding="utf-8") if card_path.is_file() else ""
    section = _card_section(_subset(report, names))
    _write_text_atomic(card_path, _replace_section(card, section))
