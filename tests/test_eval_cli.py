"""`lite eval` end to end on a tiny model and its artifact: the accuracy it reports equals a
direct computation, the files it writes, the card it updates, and its errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from tests.test_server_lm_eval import choice_scores, write_mc_task

TASK = "tiny_mc_eval"
DOCS = [
    ("The capital of France is", ["Paris", "a small town", "Rome"]),
    ("Water boils at", ["100 degrees", "the top of the mountain", "noon", "zero"]),
    ("def add(a, b): return", ["a + b", "None", "a - b"]),
    ("The opposite of hot is", ["cold", "warm water", "lukewarm tea"]),
    ("A week has", ["seven days", "ten days", "one long weekend", "52 days"]),
    ("The keyword to define a class in Python is", ["class", "def", "struct"]),
    ("Two plus two equals", ["four", "five", "twenty two"]),
    ("for i in range(3): print(", ["i)", "x)", "range)"]),
]
GOLDS = [0, 2, 1, 0, 3, 1, 2, 0]  # fixed; the models' choices decide the accuracy


def _engine_choice(engine: Engine, context: str, choices: list[str]) -> int:
    scores = choice_scores(engine, context, choices)
    return max(range(len(scores)), key=scores.__getitem__)


def _hf_choice(model, tok, context: str, choices: list[str]) -> int:
    ctx = tok(context, add_special_tokens=False).input_ids
    scores = []
    for choice in choices:
        whole = tok(context + " " + choice, add_special_tokens=False).input_ids
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([whole])).logits[0].float().log_softmax(-1)
        picked = lp[len(ctx) - 1 : -1].gather(1, torch.tensor(whole[len(ctx) :])[:, None])
        scores.append(float(picked.sum()))
    return max(range(len(scores)), key=scores.__getitem__)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tasks")
    write_mc_task(root, TASK, DOCS, GOLDS)
    return root


def test_reported_accuracy_equals_direct_computation(
    tiny_models: dict[str, Path], rtn_artifact: Path, task_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "report"
    args = ["eval", "--model", str(tiny_models["llama"]), "--artifact", str(rtn_artifact)]
    args += ["--kv-quant", "none,int4", "--tasks", TASK, "--include-path", str(task_dir)]
    args += ["--output", str(out), "--quiet", "--batch-size", "4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "liteserve loglikelihood" not in result.output  # --quiet: no bar of ours

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    want = {"source": [_hf_choice(model, tok, q, c) for q, c in DOCS]}
    for kv in ("none", "int4"):
        engine = Engine(rtn_artifact, EngineConfig(kv_quant=kv, num_blocks=16, dtype="float32"))
        want[f"art kv={kv}"] = [_engine_choice(engine, q, c) for q, c in DOCS]
    report = json.loads((out / "results.json").read_text())
    (row,) = report["rows"]  # acc only: lm-eval's bookkeeping (sample_len) is not a metric
    assert row["metric"] == "acc"
    assert row["task"] == TASK and row["samples"] == len(DOCS)
    for name, preds in want.items():
        acc = sum(p == g for p, g in zip(preds, GOLDS, strict=True)) / len(DOCS)
        assert row["values"][name] == pytest.approx(acc), name
        assert f"{acc:.4f}" in result.output
    assert [v["name"] for v in report["variants"]] == ["source", "art kv=none", "art kv=int4"]
    assert (out / "report.md").read_text().count(TASK) >= 1
    assert (out / "deltas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ppl_mode_writes_report_and_updates_card(
    tiny_models: dict[str, Path], rtn_artifact: Path, tmp_path: Path
) -> None:
    from lite.data import pydoc_split
    from lite.perplexity import run_ppl
    from runtime.artifact.reader import Artifact

    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    text = tmp_path / "text.txt"
    text.write_text(pydoc_split()[1][:12000])
    out = tmp_path / "report"
    args = ["ppl", "--model", str(tiny_models["llama"]), "--artifact", str(art)]
    args += ["--kv-quant", "none,int8", "--text-file", str(text), "--seqlen", "40"]
    args += ["--limit", "3", "--output", str(out), "--update-card", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "results.json").read_text())
    assert report["mode"] == "ppl"
    got = {r["metric"]: r["values"] for r in report["rows"]}
    want = run_ppl(str(tiny_models["llama"]), (art,), text, 40, 3, ("none", "int8"))
    names = [v["name"] for v in report["variants"]]
    assert names == ["source", "art kv=none", "art kv=int8"]
    for name, r in zip(names, want, strict=True):
        assert got["ppl"][name] == pytest.approx(r.ppl, rel=1e-6)
        assert got["kl"][name] == pytest.approx(r.kl.mean if r.kl else 0.0, abs=1e-9)
    assert "ppl" in result.output and "kl" in result.output
    card = (art / "README.md").read_text()
    assert "art kv=int8" in card and "No evaluation yet" not in card
    Artifact(art, checksums=True)  # the card is outside the checksums


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-quant", "int3"], "use none, int8, int4"),
        ([], "give --tasks"),
        (["--tasks", "no_such_task_xyz", "--include-path", "{tasks}"], "unknown task"),
        (["--tasks", "piqa"], "(HF_HUB_OFFLINE is set). Offline, use the local tasks"),
        (["--tasks", "piqa_local"], "unknown task(s) piqa_local; local tasks need --include-path"),
        (["--tasks", "piqa_local", "--kv-quant", "int8,none,int8"], "lists int8 more than once"),
        (["--tasks", "piqa_local", "--artifact", "{artifact}"], "more than once; give each"),
        (["--tasks", "piqa_local", "--artifact", "{copy}"], "two artifacts are named 'art'"),
        (["--tasks", "piqa_local", "--limit", "inf"], "'inf': give a number of documents"),
        (["--tasks", "piqa_local", "--limit", "nan"], "--limit"),
        (["--tasks", "piqa_local", "--limit", "0"], "--limit"),
        (["--ppl", "--tasks", "piqa_local"], "--ppl scores a text, not tasks: drop --tasks"),
        # read by one mode only: ignored in silence by the other
        (["--ppl", "--seed", "7", "--max-length", "64"], "drop --max-length, --seed"),
        (["--ppl", "--data-dir", "{tasks}"], "--ppl scores a text, not tasks: drop --data-dir"),
        (["--tasks", "piqa_local", "--seqlen", "64"], "the --ppl text options: drop --seqlen"),
        (["--ppl", "--limit", "0.5"], "'0.5': give a whole number of windows"),
    ],
)
def test_bad_input_is_explained(
    extra: list[str],
    message: str,
    rtn_artifact: Path,
    tiny_models: dict[str, Path],
    task_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    copy = tmp_path / "elsewhere" / rtn_artifact.name  # another artifact of the same name
    if "{copy}" in extra:
        shutil.copytree(rtn_artifact, copy)
    args = ["eval", "--model", str(tiny_models["llama"]), "--artifact", str(rtn_artifact)]
    args += [a.format(tasks=task_dir, artifact=rtn_artifact, copy=copy) for a in extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, ValueError)


def test_a_text_file_that_is_not_utf8_is_named(
    rtn_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = tmp_path / "latin1.txt"
    text.write_bytes("café crème brûlée ".encode("latin-1") * 50)
    args = ["ppl", "--artifact", str(rtn_artifact), "--text-file", str(text), "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert f"--text-file {text} is not valid UTF-8 (byte 3" in result.output, result.output


def test_an_unusable_output_is_refused_before_evaluating(rtn_artifact: Path, tmp_path) -> None:
    """It was found after the whole evaluation, as a traceback, and the results were lost."""
    (tmp_path / "afile").write_text("")
    args = ["ppl", "--artifact", str(rtn_artifact), "--output", str(tmp_path / "afile" / "sub")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--output" in result.output, result.output
    assert "Not a directory" in result.output and "Traceback" not in result.output


def test_artifact_options_without_an_artifact_are_refused(tiny_models: dict[str, Path]) -> None:
    """--kv-quant and --update-card did nothing without an --artifact, and said nothing."""
    for extra in (["--kv-quant", "int8"], ["--update-card"]):
        args = ["ppl", "--model", str(tiny_models["llama"]), *extra]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        assert f"no --artifact is given: drop {extra[0]}" in result.output


def test_missing_task_data_is_found_before_any_model_loads(
    rtn_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was found when lm-eval built the tasks, after the first model had loaded."""
    import lite.evaluate

    def loaded(*_: object) -> None:
        raise AssertionError("a model loaded before the task data was read")

    monkeypatch.setattr(lite.evaluate, "_load", loaded)
    monkeypatch.delenv("LITESERVE_EVAL_DATA", raising=False)
    tasks = Path(__file__).parents[1] / "evals" / "tasks"
    args = ["eval", "--artifact", str(rtn_artifact), "--tasks", "piqa_local"]
    result = CliRunner().invoke(main, [*args, "--include-path", str(tasks)])
    assert result.exit_code == 1, result.output
    assert "piqa_local reads piqa_valid.jsonl but no data folder is given" in result.output
