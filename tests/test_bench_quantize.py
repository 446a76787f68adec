"""The quantization benchmark's protocol helpers (evals/bench/quantize.py): which texts are
scored and how the ratios against llm-compressor are formed."""

from __future__ import annotations

import json
import math
from pathlib import Path

from evals.bench.quantize import PYDOC, arc_text, eval_texts, llmc_run, loss_vs_llmc


def test_arc_text_pairs_each_question_with_its_correct_answer(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Which is a gas?", "choices": ["ice", "steam"], "answer_idx": 1},
        {"prompt": "What do plants need?", "choices": ["light", "noise"], "answer_idx": 0},
    ]
    path = tmp_path / "arc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert arc_text(path) == "Which is a gas? steam\n\nWhat do plants need? light"


def test_eval_texts_without_the_ood_files_is_the_in_domain_protocol(tmp_path: Path) -> None:
    texts = eval_texts(tmp_path)
    assert list(texts) == [PYDOC] and len(texts[PYDOC]) > 10_000
    (tmp_path / "groups_merged.txt").write_text("general English")
    assert list(eval_texts(tmp_path)) == [PYDOC, "groups_merged.txt"]


def test_llmc_ratios_reproduce_the_recorded_figures() -> None:
    """In domain: 13.372 against 11.977 was 0.78x llm-compressor's loss (RESULTS.md). Out of
    domain the llm-compressor figure is derived from 1.185x the source at 0.97x, so that
    point must come back as 0.97x whatever the source perplexity; no figure: None."""
    assert math.isclose(loss_vs_llmc(PYDOC, 13.372, 11.977), 1.395 / 1.79, rel_tol=1e-9)
    for src in (9.0, 23.5):
        assert math.isclose(loss_vs_llmc("groups_merged.txt", 1.185 * src, src), 0.97)
    assert loss_vs_llmc("ARC-Easy questions", 20.0, 18.0) is None


def test_measured_llmc_perplexity_replaces_the_recorded_figures(tmp_path: Path) -> None:
    """With llm-compressor scored on the same windows, the ratio is against that perplexity,
    in domain and out of it, and a text without a recorded figure gets one."""
    assert math.isclose(loss_vs_llmc(PYDOC, 12.5, 12.0, llmc=13.0), 0.5)
    assert math.isclose(loss_vs_llmc("ARC-Easy questions", 21.0, 19.0, llmc=23.0), 0.5)
    assert loss_vs_llmc("groups_merged.txt", 20.0, 17.0, llmc=20.0) == 1.0
    facts = {"wall_s": 1602.0, "peak_rss_gib": 3.4, "calib": "ab"}
    (tmp_path / "llmc-run.json").write_text(json.dumps(facts))
    assert llmc_run(tmp_path) == (tmp_path, 1602.0, 3.4)
