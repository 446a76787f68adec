"""The `*_local` lm-eval tasks in evals/tasks read their data from local files, in every format
they accept, and render the documents exactly as the upstream tasks they mirror would: that is
what makes `lite eval` figures comparable with published lm-eval ones without the hub.

Fixtures are small files of random words written here, never the real data sets, and lm-eval
loads them the way `lite eval` does: through a TaskManager whose metadata names the data folder.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from lm_eval.api.task import ConfigurableTask

TASKS_DIR = Path(__file__).resolve().parents[1] / "evals" / "tasks"
RNG = random.Random()
# No "s": WikiText's detokenizer rewrites "s '", which a random word ending in s would hit.
LETTERS = string.ascii_lowercase.replace("s", "")


@pytest.fixture(autouse=True)
def _seed() -> None:
    """The same fixtures whatever tests run before."""
    RNG.seed(20240611)


def _word() -> str:
    return "".join(RNG.choices(LETTERS, k=RNG.randint(3, 8)))


def _words(n: int) -> str:
    return " ".join(_word() for _ in range(n))


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def _load(task: str, **metadata: Any) -> ConfigurableTask:
    """The task as `lm_eval --include_path evals/tasks --metadata '{...}'` builds it."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
    return manager.load(task)["tasks"][task]


def _rendered(task: ConfigurableTask, n: int) -> tuple[str, list[str] | None, Any]:
    doc = task.eval_docs[n]
    choices = task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None
    return task.doc_to_text(doc), choices, task.doc_to_target(doc)


def _piqa_rows(n: int) -> list[dict[str, str]]:
    """Two solutions of different lengths (2 words: at most 17 chars, 5: at least 19) in a
    random order, so a length-based scorer has a known answer."""
    rows = []
    for _ in range(n):
        short, long = _words(2), _words(5)
        sol1, sol2 = (short, long) if RNG.random() < 0.5 else (long, short)
        rows.append({"goal": _words(4) + "?", "sol1": sol1, "sol2": sol2})
    return rows


def _write_piqa(data: Path, n: int = 8) -> tuple[list[dict[str, str]], list[int]]:
    rows, labels = _piqa_rows(n), [RNG.randint(0, 1) for _ in range(n)]
    _write_jsonl(data / "piqa_valid.jsonl", rows)
    (data / "piqa_valid_labels.lst").write_text("".join(f"{x}\n" for x in labels))
    return rows, labels


def test_piqa_labels_from_lst(tmp_path: Path) -> None:
    rows, labels = _write_piqa(tmp_path)
    task = _load("piqa_local", data_dir=str(tmp_path))
    assert len(task.eval_docs) == len(rows)
    for n in (0, len(rows) - 1):
        text, choices, target = _rendered(task, n)
        assert text == f"Question: {rows[n]['goal']}\nAnswer:"
        assert choices == [rows[n]["sol1"], rows[n]["sol2"]]
        assert target == labels[n]


def test_piqa_labels_inline_and_file_override(tmp_path: Path) -> None:
    rows = [{**row, "label": n % 2} for n, row in enumerate(_piqa_rows(3))]
    _write_jsonl(tmp_path / "piqa_with_labels.jsonl", rows)
    task = _load("piqa_local", data_dir=str(tmp_path), piqa_file="piqa_with_labels.jsonl")
    assert len(task.eval_docs) == 3
    assert [_rendered(task, n)[2] for n in range(3)] == [0, 1, 0]


def _arc_row(fmt: str, n: int, stem: str, texts: list[str], answer: int) -> dict[str, Any]:
    if fmt == "prompt":
        return {"id": f"q{n}", "prompt": stem, "choices": texts, "answer_idx": answer}
    labels = "ABCDE" if n % 2 else "12345"  # AI2's release; numeric labels occur there too
    choices = [{"text": t, "label": labels[i]} for i, t in enumerate(texts)]
    return {
        "id": f"q{n}",
        "question": {"stem": stem, "choices": choices},
        "answerKey": labels[answer],
    }


@pytest.mark.parametrize(
    ("task_name", "fmt"),
    [
        ("arc_easy_local", "prompt"),
        ("arc_easy_local", "ai2"),
        ("arc_challenge_local", "prompt"),
        ("arc_challenge_local", "ai2"),
    ],
)
def test_arc_both_formats(tmp_path: Path, task_name: str, fmt: str) -> None:
    questions = []  # (stem, choices, gold index), 3 to 5 choices
    for n in range(5):
        texts = [_words(2) for _ in range(3 + n % 3)]
        questions.append((_words(6) + "?", texts, RNG.randrange(len(texts))))
    rows = [_arc_row(fmt, n, *q) for n, q in enumerate(questions)]
    _write_jsonl(tmp_path / (task_name.removesuffix("_local") + "_test.jsonl"), rows)
    task = _load(task_name, data_dir=str(tmp_path))
    assert len(task.eval_docs) == 5
    for n in (1, 2):
        stem, texts, answer = questions[n]
        assert _rendered(task, n) == (f"Question: {stem}\nAnswer:", texts, answer)


def test_hellaswag_upstream_preprocess(tmp_path: Path) -> None:
    a, b, c, d, e = (_word() for _ in range(5))
    rows = [
        {
            "ind": 7,
            "activity_label": f"{a} {b}",
            "ctx_a": f" {c} [header] {d}.",
            "ctx_b": f"{e} [title] then",
            "ctx": "unused",
            "endings": [f"{a} [step] {b}.", f" {c}  {d} ", f"{e} [title] {a}", f"{b}"],
            "label": 2,
            "split": "val",
            "split_type": "indomain",
            "source_id": "wikihow~1",
        },
        {
            "activity_label": _word(),
            "ctx_a": _words(5),
            "ctx_b": _words(2),
            "endings": [_words(3) for _ in range(4)],
            "label": "0",
        },
    ]
    _write_jsonl(tmp_path / "hellaswag_val.jsonl", rows)
    task = _load("hellaswag_local", data_dir=str(tmp_path))
    assert len(task.eval_docs) == 2
    # query: "a b:  c [header] d. E [title] then", stripped, " [title]" -> ". ", [..] dropped,
    # double spaces halved
    assert _rendered(task, 0) == (
        f"{a} {b}: {c} {d}. {e.capitalize()}. then",
        [f"{a} {b}.", f"{c} {d}", f"{e}. {a}", b],
        2,
    )
    assert _rendered(task, 1)[2] == 0


def test_lambada_last_word(tmp_path: Path) -> None:
    texts = [_words(3 + n) for n in range(4)]
    _write_jsonl(tmp_path / "lambada_test.jsonl", [{"text": t} for t in texts])
    task = _load("lambada_local", data_dir=str(tmp_path))
    assert task.OUTPUT_TYPE == "loglikelihood"
    assert len(task.eval_docs) == 4
    *context, last = texts[3].split(" ")
    assert _rendered(task, 3) == (" ".join(context), None, " " + last)


def _wiki_raw() -> tuple[str, list[str]]:
    """Two pages in WikiText's raw layout (a blank first line, " = Title = " heads, section
    heads inside pages, tokenized punctuation); the pages as upstream splits them (the first
    loses the newline ending its last line, as upstream's "\\n".join of lines does); the first
    page detokenized."""
    t1, t2, s, w = _word(), _word(), _word(), [_word() for _ in range(6)]
    page1 = (
        f" = {t1} = \n \n {w[0]} @-@ {w[1]} , {w[2]} ( {w[3]} ) . \n \n"
        f" = = {s} = = \n \n 1 @,@ 000 {w[4]} 's {w[5]} . \n"
    )
    page2 = f" = {t2} = \n \n {_words(5)} . \n \n"
    detok1 = f" = {t1} =\n\n{w[0]}-{w[1]}, {w[2]} ({w[3]}).\n\n== {s} ==\n\n1,000 {w[4]}'s {w[5]}. "
    return " \n" + page1 + page2, [page1.removesuffix("\n"), page2, detok1]


def test_wikitext_pages_from_raw(tmp_path: Path) -> None:
    raw, (page1, page2, detok1) = _wiki_raw()
    (tmp_path / "wiki.test.raw").write_text(raw, encoding="utf-8")
    task = _load("wikitext_local", data_dir=str(tmp_path))
    assert task.OUTPUT_TYPE == "loglikelihood_rolling"
    assert [doc["page"] for doc in task.eval_docs] == [page1, page2]
    assert task.doc_to_target(task.eval_docs[0]) == detok1
    # upstream's re.split(r"\s+") count of the raw page: 24 tokens, and an empty string at
    # each end (the page starts and ends with a space)
    words, size = 26, len(page1.encode())
    assert task.process_results(task.eval_docs[0], [-3.0]) == {
        "word_perplexity": (-3.0, words),
        "byte_perplexity": (-3.0, size),
        "bits_per_byte": (-3.0, size),
    }


def test_wikitext_jsonl_pages(tmp_path: Path) -> None:
    pages = [_words(8), _words(3)]
    _write_jsonl(tmp_path / "wiki.jsonl", [{"page": p} for p in pages])
    task = _load("wikitext_local", data_dir=str(tmp_path), wikitext_file="wiki.jsonl")
    assert [doc["page"] for doc in task.eval_docs] == pages


def test_data_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_piqa(tmp_path, n=3)
    monkeypatch.setenv("LITESERVE_EVAL_DATA", str(tmp_path))
    assert len(_load("piqa_local").eval_docs) == 3


def test_no_data_dir_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LITESERVE_EVAL_DATA", raising=False)
    with pytest.raises(FileNotFoundError) as err:
        _load("arc_challenge_local")
    for needle in ("arc_challenge_test.jsonl", "data_dir", "LITESERVE_EVAL_DATA"):
        assert needle in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "piqa_valid.jsonl", _piqa_rows(2))  # no labels, no .lst
    with pytest.raises(FileNotFoundError) as err:
        _load("piqa_local", data_dir=str(tmp_path))
    for needle in (str(tmp_path / "piqa_valid_labels.lst"), "piqa_labels_file", "data_dir"):
        assert needle in str(err.value)


def test_piqa_accuracy_end_to_end(tmp_path: Path) -> None:
    """A scorer that gives each continuation minus its length: `acc` then picks the shorter
    solution, `acc_norm` (divided by the choice's length, without the leading space) the
    longer one."""
    import lm_eval
    from lm_eval.api.model import LM

    class LengthLM(LM):
        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return [(-float(len(r.args[1])), False) for r in requests]

        def loglikelihood_rolling(self, requests) -> list[float]:
            raise NotImplementedError

        def generate_until(self, requests) -> list[str]:
            raise NotImplementedError

    rows, labels = _write_piqa(tmp_path)
    shorter = [int(len(r["sol2"]) < len(r["sol1"])) for r in rows]
    want_acc = sum(s == y for s, y in zip(shorter, labels, strict=True)) / len(rows)

    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=LengthLM(),
        tasks=["piqa_local"],
        task_manager=TaskManager(
            include_path=str(TASKS_DIR),
            include_defaults=False,
            metadata={"data_dir": str(tmp_path)},
        ),
        bootstrap_iters=0,
        log_samples=False,
    )
    assert 0 < want_acc < 1, "pick a seed whose labels are mixed"
    assert out["results"]["piqa_local"]["acc,none"] == pytest.approx(want_acc)
    assert out["results"]["piqa_local"]["acc_norm,none"] == pytest.approx(1 - want_acc)
