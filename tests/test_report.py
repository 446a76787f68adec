"""lite.report: the eval report's validation, deltas, renderings, files and model-card section."""

from __future__ import annotations

import copy
import io
import json
import random
import re
import shutil
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.figure import Figure
from rich.console import Console

from lite.model_card import EVAL_MARKER
from lite.report import (
    SCHEMA_VERSION,
    deltas,
    render_chart,
    render_markdown,
    render_terminal,
    update_card,
    validate,
    write_report,
)
from runtime.artifact.reader import Artifact

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def variant(name: str, artifact: str | None = None, kv: str | None = None) -> dict:
    kind = "artifact" if artifact else "source"
    return {
        "name": name,
        "kind": kind,
        "model": None if artifact else "tiny-llama",
        "artifact": artifact,
        "kv_quant": kv,
        "method": "awq" if artifact else None,
    }


def make_report(
    seed: int = 0,
    tasks: tuple[str, ...] = ("piqa_local", "arc_easy", "hellaswag"),
    artifacts: dict[str, str] | None = None,
    created: str = "2026-11-29T18:00:00Z",
) -> dict:
    """A tasks-mode report with random-ish accuracies; every stderr of `arc_easy` is unknown."""
    rng = random.Random(seed)
    artifacts = artifacts or {"awq kv=none": "out/awq", "awq kv=int8": "out/awq"}
    variants = [variant("source")]
    variants += [variant(n, a, n.split("kv=")[-1]) for n, a in artifacts.items()]
    names = [v["name"] for v in variants]
    rows = []
    for task in tasks:
        for metric in ("acc", "acc_norm"):
            values = {n: round(rng.uniform(0.3, 0.8), 4) for n in names}
            known = task != "arc_easy"
            stderr = {n: round(rng.uniform(0.005, 0.02), 4) if known else None for n in names}
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "higher_is_better": True,
                    "samples": rng.randint(100, 2000),
                    "values": values,
                    "stderr": stderr,
                }
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "created": created,
        "liteserve_version": "0.1.0",
        "command": "lite eval --model tiny-llama --artifact out/awq --kv-quant none,int8",
        "mode": "tasks",
        "baseline": "source",
        "settings": {"limit": 500, "tasks": list(tasks), "num_fewshot": 0, "dtype": "auto"},
        "variants": variants,
        "rows": rows,
    }


def ppl_report() -> dict:
    names = ["source", "awq kv=none"]
    rows = [
        ("ppl", False, {"source": 12.3456, "awq kv=none": 12.9871}, {"source": 0.21}),
        ("kl", False, {"source": 0.0, "awq kv=none": 0.0123456}, {"awq kv=none": 0.0004}),
        ("top1", True, {"source": 1.0, "awq kv=none": 0.9312}, {}),
    ]
    return {
        **make_report(artifacts={"awq kv=none": "out/awq"}),
        "mode": "ppl",
        "settings": {"text": "pydoc-heldout", "seqlen": 512},
        "variants": [variant(n, "out/awq" if n != "source" else None, "none") for n in names],
        "rows": [
            {
                "task": "pydoc-heldout",
                "metric": metric,
                "higher_is_better": hib,
                "samples": 40960,
                "values": values,
                "stderr": stderr,
            }
            for metric, hib, values, stderr in rows
        ],
    }


def table_lines(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("|")]


def card_table(card: str) -> list[str]:
    """The card's own facts table comes first; the results table is in the Evaluation section."""
    return table_lines(card.split(EVAL_MARKER)[1])


# --- validate -------------------------------------------------------------------------------


def test_validate_accepts_good_reports() -> None:
    validate(make_report())
    validate(ppl_report())


def _drop(key: str):
    return lambda r: r.pop(key)


def _set_row(key: str, value: object):
    return lambda r: r["rows"][0].__setitem__(key, value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_drop("rows"), "missing key 'rows'"),
        (_drop("command"), "missing key 'command'"),
        (lambda r: r.__setitem__("schema_version", 2), "schema_version is 2"),
        (lambda r: r.__setitem__("mode", "vibes"), "mode is 'vibes'"),
        (lambda r: r.__setitem__("baseline", "fp16"), "baseline 'fp16' is not among the variants"),
        (lambda r: r["variants"][1].pop("artifact"), "variants[1]: missing key 'artifact'"),
        (lambda r: r["variants"].append(variant("source")), "duplicate variant name 'source'"),
        (lambda r: r["rows"][0].pop("metric"), "rows[0]: missing key 'metric'"),
        (
            lambda r: r["rows"][1]["values"].__setitem__("ghost", 0.5),
            "rows[1] (piqa_local/acc_norm): unknown variant 'ghost' in values",
        ),
        (
            lambda r: r["rows"][0]["stderr"].__setitem__("ghost", 0.01),
            "unknown variant 'ghost' in stderr",
        ),
        (
            lambda r: r["rows"][0]["values"].__setitem__("source", "0.5"),
            "values['source'] must be a number",
        ),
        (_set_row("higher_is_better", "yes"), "higher_is_better must be"),
        (_set_row("samples", 1.5), "samples must be an integer"),
        (lambda r: r.__setitem__("rows", []), "rows must be a non-empty list"),
    ],
)
def test_validate_names_the_problem(mutate, message: str) -> None:
    report = make_report()
    mutate(report)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(report)


# --- deltas ---------------------------------------------------------------------------------


def test_deltas_arithmetic_and_direction() -> None:
    report = make_report(seed=3)
    ds = deltas(report)
    assert len(ds) == len(report["rows"]) * 2
    by_key = {(r["task"], r["metric"]): r for r in report["rows"]}
    for d in ds:
        row = by_key[d["task"], d["metric"]]
        assert d["baseline"] == row["values"]["source"]
        assert d["value"] == row["values"][d["variant"]]
        assert d["delta"] == pytest.approx(d["value"] - d["baseline"])
        assert d["stderr"] == row["stderr"][d["variant"]]
        assert d["better"] is (d["delta"] > 0)


def test_deltas_lower_is_better_unknown_direction_ties_and_gaps() -> None:
    report = ppl_report()
    report["rows"].append(
        {
            "task": "pydoc-heldout",
            "metric": "bits",
            "higher_is_better": None,
            "samples": None,
            "values": {"source": 1.0, "awq kv=none": 1.5},
            "stderr": {},
        }
    )
    report["rows"].append({**report["rows"][0], "metric": "nll", "values": {"source": 2.0}})
    report["rows"].append({**report["rows"][0], "metric": "same", "values": {"source": 2.0}})
    report["rows"][-1]["values"]["awq kv=none"] = 2.0
    got = {d["metric"]: d for d in deltas(report)}
    assert got["ppl"]["delta"] == pytest.approx(12.9871 - 12.3456)
    assert got["ppl"]["better"] is False  # perplexity went up
    assert got["kl"]["better"] is False
    assert got["kl"]["stderr"] == 0.0004
    assert got["top1"]["delta"] == pytest.approx(-0.0688)
    assert got["top1"]["better"] is False
    assert got["bits"]["better"] is None  # direction unknown
    assert got["nll"]["delta"] is None and got["nll"]["better"] is None  # no value
    assert got["same"]["delta"] == 0 and got["same"]["better"] is None  # a tie


# --- renderings -----------------------------------------------------------------------------


def test_markdown_is_one_table_with_every_column_delta_and_stderr() -> None:
    report = make_report(seed=7)
    md = render_markdown(report)
    lines = md.splitlines()
    assert "Δ = variant − baseline" in lines[0] and "±" in lines[0] and "mode: tasks" in lines[0]
    table = table_lines(md)
    assert len(table) == 2 + len(report["rows"])
    assert table == lines[2:]  # legend, blank line, then one contiguous table
    assert table[0] == "| task | metric | n | source | awq kv=none (Δ) | awq kv=int8 (Δ) |"
    ds = iter(deltas(report))
    for row, line in zip(report["rows"], table[2:], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:3] == [row["task"], f"{row['metric']} ↑", str(row["samples"])]
        base, err = row["values"]["source"], row["stderr"]["source"]
        assert cells[3] == (f"{base:.4f}" if err is None else f"{base:.4f} ± {err:.4f}")
        for cell in cells[4:]:
            d = next(ds)
            assert cell == f"{d['value']:.4f} ({d['delta']:+.4f})"
            assert cell.split("(")[1][0] in "+-"


def test_markdown_ppl_precision_and_legend() -> None:
    md = render_markdown(ppl_report())
    assert "KL(baseline ‖ variant)" in md and "mode: ppl" in md
    rows = {line.split("|")[2].strip(): line for line in table_lines(md)[2:]}
    assert "| 12.346 ± 0.210 | 12.987 (+0.642) |" in rows["ppl ↓"]
    assert "| 0.00000 | 0.01235 (+0.01235) |" in rows["kl ↓"]
    assert "| 1.0000 | 0.9312 (-0.0688) |" in rows["top1 ↑"]


def test_markdown_escapes_pipes_in_names() -> None:
    report = make_report(artifacts={"awq|int8": "out/awq"})
    header = table_lines(render_markdown(report))[0]
    assert "awq\\|int8 (Δ)" in header


def test_terminal_table_colors_deltas_by_direction() -> None:
    report = ppl_report()
    report["rows"][2]["values"]["awq kv=none"] = 1.0  # top1 tie: no colour
    report["rows"][0]["values"]["awq kv=none"] = 11.0  # ppl went down: better
    console = Console(
        file=io.StringIO(), width=200, force_terminal=True, color_system="standard", record=True
    )
    console.print(render_terminal(report))
    plain = console.export_text(styles=False, clear=False)
    for text in ("source", "awq kv=none (Δ)", "12.346 ± 0.210", "0.01235 (+0.01235)"):
        assert text in plain
    styled = console.export_text(styles=True)
    assert "\x1b[32m(-1.346)" in styled  # green
    assert "\x1b[31m(+0.01235)" in styled  # red
    assert "1.0000 (+0.0000)" in styled  # uncoloured tie


# --- files ----------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert 200 <= image.shape[0] <= 10_000 and 200 <= image.shape[1] <= 10_000


def test_write_report_files(tmp_path: Path) -> None:
    report = make_report(seed=11)
    out = tmp_path / "a" / "b"
    paths = write_report(report, out)
    assert paths == {
        "json": out / "results.json",
        "markdown": out / "report.md",
        "chart": out / "deltas.png",
    }
    assert json.loads(paths["json"].read_text()) == report
    md = paths["markdown"].read_text()
    assert render_markdown(report) in md
    assert report["command"] in md and "`limit`: 500" in md
    assert "- `awq kv=int8`: artifact `out/awq`, method awq, KV cache int8" in md
    assert_png(paths["chart"])
    assert sorted(p.name for p in out.iterdir()) == ["deltas.png", "report.md", "results.json"]


def test_one_row_one_variant(tmp_path: Path) -> None:
    report = make_report(tasks=("piqa_local",), artifacts={"awq": "out/awq"})
    report["rows"] = report["rows"][:1]
    paths = write_report(report, tmp_path)
    assert table_lines(render_markdown(report))[0] == "| task | metric | n | source | awq (Δ) |"
    assert_png(paths["chart"])


def test_ppl_report_files(tmp_path: Path) -> None:
    paths = write_report(ppl_report(), tmp_path)
    assert json.loads(paths["json"].read_text()) == ppl_report()
    assert "0.01235 (+0.01235)" in paths["markdown"].read_text()
    assert_png(paths["chart"])


def test_chart_many_variants_and_rows_and_baseline_only(tmp_path: Path) -> None:
    tasks = tuple(f"task_{i}" for i in range(10))
    many = make_report(seed=5, tasks=tasks, artifacts={f"v{i}": f"out/v{i}" for i in range(14)})
    render_chart(many, tmp_path / "many.png")
    assert_png(tmp_path / "many.png")
    alone = make_report(artifacts={"awq": "out/awq"})
    alone["variants"] = alone["variants"][:1]
    for row in alone["rows"]:
        row["values"].pop("awq")
        row["stderr"].pop("awq")
    render_chart(alone, tmp_path / "alone.png")
    assert_png(tmp_path / "alone.png")


def test_interrupted_write_keeps_the_old_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = write_report(make_report(seed=1), tmp_path)
    before = {k: p.read_bytes() for k, p in old.items()}

    def boom(*args, **kwargs) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", boom)
    new = make_report(seed=2)
    with pytest.raises(KeyboardInterrupt):
        write_report(new, tmp_path)
    assert json.loads(old["json"].read_text()) == new  # the numbers are saved first
    assert old["chart"].read_bytes() == before["chart"]
    assert old["markdown"].read_bytes() == before["markdown"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deltas.png", "report.md", "results.json"]


# --- model card -----------------------------------------------------------------------------


@pytest.fixture
def artifact(rtn_artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(rtn_artifact, tmp_path / "art"))


def card_report(art: Path, seed: int = 0, created: str = "2026-11-29T18:00:00Z") -> dict:
    artifacts = {
        "art kv=none": str(art),
        "art kv=int8": "art",  # relative to the working directory (tmp_path)
        "other kv=none": str(art.parent / "other"),
    }
    return make_report(seed=seed, artifacts=artifacts, created=created)


def test_update_card_shows_only_its_own_artifact(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(artifact.parent)
    card_path = artifact / "README.md"
    title = card_path.read_text().split(EVAL_MARKER)[0]
    report = card_report(artifact)
    update_card(artifact, report)
    card = card_path.read_text()
    assert card.startswith(title)
    assert card.count(EVAL_MARKER) == 1
    assert "No evaluation yet" not in card
    header = card_table(card)[0]
    assert header == "| task | metric | n | source | art kv=none (Δ) | art kv=int8 (Δ) |"
    assert "other" not in card.split(EVAL_MARKER)[1].replace(report["command"], "")
    assert report["created"] in card and report["command"] in card and "limit = 500" in card

    update_card(artifact, report, variant_prefix="art kv=int8")
    header = card_table(card_path.read_text())[0]
    assert header == "| task | metric | n | source | art kv=int8 (Δ) |"


def test_update_card_is_idempotent_and_keeps_the_newest(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(artifact.parent)
    card_path = artifact / "README.md"
    card_path.write_text(card_path.read_text() + "\n## Notes\n\nKeep me.\n")
    first = card_report(artifact, seed=1, created="2026-11-01T00:00:00Z")
    update_card(artifact, first)
    once = card_path.read_text()
    update_card(artifact, first)
    assert card_path.read_text() == once

    newest = card_report(artifact, seed=2, created="2026-12-01T00:00:00Z")
    update_card(artifact, newest)
    card = card_path.read_text()
    assert card.count(EVAL_MARKER) == 1 and card.count("| task | metric |") == 1
    assert "2026-12-01" in card and "2026-11-01" not in card
    sub = {**newest, "variants": newest["variants"][:3]}
    keep = ("source", "art kv=none", "art kv=int8")
    sub["rows"] = [
        {
            **r,
            "values": {k: r["values"][k] for k in keep},
            "stderr": {k: r["stderr"][k] for k in keep},
        }
        for r in newest["rows"]
    ]
    assert table_lines(render_markdown(sub)) == card_table(card)
    assert card.endswith("## Notes\n\nKeep me.\n")
    assert card.index(EVAL_MARKER) < card.index("## Notes")
    Artifact(artifact, checksums=True)  # the card is outside the checksums
    assert not list(artifact.glob(".*.tmp"))


def test_update_card_appends_a_missing_section(artifact: Path) -> None:
    card_path = artifact / "README.md"
    card_path.write_text("# hand-written card\n\nNo section yet.")
    report = card_report(artifact)
    update_card(artifact, report)
    update_card(artifact, report)
    card = card_path.read_text()
    assert card.startswith("# hand-written card\n\nNo section yet.\n\n" + EVAL_MARKER)
    assert card.count(EVAL_MARKER) == 1
    Artifact(artifact, checksums=True)


def test_update_card_refuses_a_report_without_this_artifact(artifact: Path) -> None:
    report = make_report(artifacts={"awq": str(artifact.parent / "elsewhere")})
    before = (artifact / "README.md").read_text()
    with pytest.raises(ValueError, match="no variant of the report is this artifact"):
        update_card(artifact, report)
    with pytest.raises(ValueError, match="starting 'zzz'"):
        update_card(artifact, card_report(artifact), variant_prefix="zzz")
    assert (artifact / "README.md").read_text() == before


def test_update_card_validates_first(artifact: Path) -> None:
    report = card_report(artifact)
    broken = copy.deepcopy(report)
    broken["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version is 99"):
        update_card(artifact, broken)
