"""Dataset loaders for the `*_local` lm-eval tasks.

`lite eval` runs where the Hugging Face hub cannot be reached, so the upstream tasks
(`piqa`, `arc_easy`, `hellaswag`, ...) cannot fetch their data. These loaders read the files
their datasets were built from and hand lm-eval the same documents, so the YAMLs next to this
file can keep upstream's prompts and metrics and their numbers stay comparable with published
lm-eval figures. The HellaSwag cleanup and the WikiText page split and detokenizer are
reimplemented here, not imported from lm-eval's task modules, whose layout is not an API.

lm-eval calls a task's `custom_dataset` with its whole metadata as keyword arguments: the YAML's
(`version`), lm-eval's own (`config_source`), the model arguments under `simple_evaluate` and
whatever `--metadata` / `TaskManager(metadata=...)` adds. Each loader takes the keys it knows and
ignores the rest. The keys:

- `data_dir`: the folder holding the files; falls back to the environment variable
  `LITESERVE_EVAL_DATA`.
- `piqa_file`, `piqa_labels_file`, `arc_easy_file`, `arc_challenge_file`, `hellaswag_file`,
  `lambada_file`, `wikitext_file`: another file name, relative to the data folder or absolute.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import datasets

DATA_DIR_KEY = "data_dir"
DATA_DIR_ENV = "LITESERVE_EVAL_DATA"
Docs = dict[str, datasets.Dataset]


class EvalDataError(FileNotFoundError):
    """A task's data file cannot be found or read as the expected format."""


def _data_file(task: str, file_key: str, name: str, data_dir: str | None) -> Path:
    """The file `name` of `task`, under `data_dir`, else under $LITESERVE_EVAL_DATA."""
    path = Path(name).expanduser()
    how = (
        f"set the data folder with the metadata key '{DATA_DIR_KEY}' "
        f'(lm_eval --metadata \'{{"{DATA_DIR_KEY}": "DIR"}}\', lite eval --data-dir DIR) '
        f"or the environment variable {DATA_DIR_ENV}; another file name with the metadata key "
        f"'{file_key}'"
    )
    if not path.is_absolute():
        root = data_dir or os.environ.get(DATA_DIR_ENV)
        if not root:
            raise EvalDataError(f"{task} reads {name} but no data folder is given: {how}")
        path = Path(root).expanduser() / path
    if not path.is_file():
        raise EvalDataError(f"{task} reads {path}, which does not exist: {how}")
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise EvalDataError(f"{path}:{n}: not JSON ({e})") from e
    if not rows:
        raise EvalDataError(f"{path} holds no documents")
    return rows


def _require(path: Path, row: dict[str, Any], n: int, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise EvalDataError(f"{path}: document {n} lacks {missing} (has {sorted(row)})")


# PIQA ------------------------------------------------------------------------------------------


def _piqa_labels(path: Path, count: int) -> list[int]:
    labels = [int(x) for x in path.read_text(encoding="utf-8").split()]
    if len(labels) != count:
        raise EvalDataError(f"{path} holds {len(labels)} labels for {count} documents")
    return labels


def piqa(
    data_dir: str | None = None,
    piqa_file: str = "piqa_valid.jsonl",
    piqa_labels_file: str = "piqa_valid_labels.lst",
    **_: Any,
) -> Docs:
    """PIQA's release format: `goal`, `sol1`, `sol2` per line and the labels in a separate .lst
    (one 0/1 a line); a jsonl whose every document has `label` needs no .lst."""
    path = _data_file("piqa_local", "piqa_file", piqa_file, data_dir)
    rows = _read_jsonl(path)
    for n, row in enumerate(rows):
        _require(path, row, n, ("goal", "sol1", "sol2"))
    if all("label" in row for row in rows):
        labels = [int(row["label"]) for row in rows]
    else:
        lst = _data_file("piqa_local", "piqa_labels_file", piqa_labels_file, data_dir)
        labels = _piqa_labels(lst, len(rows))
    docs = [
        {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": label}
        for r, label in zip(rows, labels, strict=True)
    ]
    return {"validation": datasets.Dataset.from_list(docs)}


# ARC -------------------------------------------------------------------------------------------


def _arc_doc(path: Path, row: dict[str, Any], n: int) -> dict[str, Any]:
    """One ARC question as {id, question, choices, gold}, from either of the two layouts."""
    if isinstance(row.get("question"), dict):  # AI2's release: question.stem, answerKey
        _require(path, row, n, ("answerKey",))
        choices = row["question"]["choices"]
        labels = [c["label"] for c in choices]
        if row["answerKey"] not in labels:
            raise EvalDataError(f"{path}: document {n}: answerKey not among {labels}")
        return {
            "id": row.get("id", str(n)),
            "question": row["question"]["stem"],
            "choices": [c["text"] for c in choices],
            "gold": labels.index(row["answerKey"]),
        }
    _require(path, row, n, ("prompt", "choices", "answer_idx"))
    return {
        "id": row.get("id", str(n)),
        "question": row["prompt"],
        "choices": list(row["choices"]),
        "gold": int(row["answer_idx"]),
    }


def _arc(task: str, file_key: str, name: str, data_dir: str | None) -> Docs:
    path = _data_file(task, file_key, name, data_dir)
    docs = [_arc_doc(path, row, n) for n, row in enumerate(_read_jsonl(path))]
    return {"test": datasets.Dataset.from_list(docs)}


def arc_easy(
    data_dir: str | None = None, arc_easy_file: str = "arc_easy_test.jsonl", **_: Any
) -> Docs:
    """ARC-Easy test: `{id, prompt, choices, answer_idx}` lines or AI2's original jsonl."""
    return _arc("arc_easy_local", "arc_easy_file", arc_easy_file, data_dir)


def arc_challenge(
    data_dir: str | None = None, arc_challenge_file: str = "arc_challenge_test.jsonl", **_: Any
) -> Docs:
    """ARC-Challenge test: `{id, prompt, choices, answer_idx}` lines or AI2's original jsonl."""
    return _arc("arc_challenge_local", "arc_challenge_file", arc_challenge_file, data_dir)


# HellaSwag -------------------------------------------------------------------------------------


def hellaswag_preprocess(text: str) -> str:
    """Upstream's cleanup; the brackets are artifacts of the WikiHow part of HellaSwag."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_doc(row: dict[str, Any]) -> dict[str, Any]:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return {
        "query": hellaswag_preprocess(row["activity_label"] + ": " + ctx),
        "choices": [hellaswag_preprocess(ending) for ending in row["endings"]],
        "label": int(row["label"]),
    }


def hellaswag(
    data_dir: str | None = None, hellaswag_file: str = "hellaswag_val.jsonl", **_: Any
) -> Docs:
    """HellaSwag's release jsonl (`ctx_a`, `ctx_b`, `activity_label`, `endings`, `label`),
    already turned into upstream's `query` / `choices` / `label`."""
    path = _data_file("hellaswag_local", "hellaswag_file", hellaswag_file, data_dir)
    rows = _read_jsonl(path)
    for n, row in enumerate(rows):
        _require(path, row, n, ("ctx_a", "ctx_b", "activity_label", "endings", "label"))
    return {"validation": datasets.Dataset.from_list([_hellaswag_doc(r) for r in rows])}


# LAMBADA ---------------------------------------------------------------------------------------


def lambada(
    data_dir: str | None = None, lambada_file: str = "lambada_test.jsonl", **_: Any
) -> Docs:
    """LAMBADA as OpenAI released it (lambada_openai): one `{"text": ...}` passage a line."""
    path = _data_file("lambada_local", "lambada_file", lambada_file, data_dir)
    rows = _read_jsonl(path)
    for n, row in enumerate(rows):
        _require(path, row, n, ("text",))
    return {"test": datasets.Dataset.from_list([{"text": r["text"]} for r in rows])}


# WikiText --------------------------------------------------------------------------------------


def _is_title(line: str) -> bool:
    """A top-level ` = Title = ` line; section heads (` = = Career = = `) do not start pages."""
    rline = line.replace("= = =", "===").replace("= =", "==").strip()
    return rline.startswith("= ") and rline.endswith(" =")


def wikitext_pages(raw: str) -> list[str]:
    """Split a wiki.*.raw file into pages the way EleutherAI/wikitext_document_level does:
    each page runs from its title line to the next, lines kept verbatim."""
    pages, lines = [], []
    for line in raw.split("\n"):
        if _is_title(line):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


def wikitext(data_dir: str | None = None, wikitext_file: str = "wiki.test.raw", **_: Any) -> Docs:
    """WikiText-2 raw test text split into pages, or a jsonl of `{"page": ...}` documents."""
    path = _data_file("wikitext_local", "wikitext_file", wikitext_file, data_dir)
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path)
        for n, row in enumerate(rows):
            _require(path, row, n, ("page",))
        pages = [r["page"] for r in rows]
    else:
        pages = wikitext_pages(path.read_text(encoding="utf-8"))
    return {"test": datasets.Dataset.from_list([{"page": p} for p in pages])}


def wikitext_detokenizer(doc: dict[str, Any]) -> str:
    """Upstream's detokenizer: undoes WikiText's tokenization (` @-@ `, ` , `, spaced brackets)
    so the model scores ordinary text."""
    string = doc["page"]
    # contractions
    string = string.replace("s '", "s'")
    string = re.sub(r"/' [0-9]/", r"/'[0-9]/", string)
    # number separators
    string = string.replace(" @-@ ", "-")
    string = string.replace(" @,@ ", ",")
    string = string.replace(" @.@ ", ".")
    # punctuation
    for mark in ":;.!?,":
        string = string.replace(f" {mark} ", f"{mark} ")
    # double brackets
    string = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", string)
    string = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", string)
    string = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", string)
    string = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', string)
    string = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", string)
    # miscellaneous
    string = string.replace("= = = =", "====")
    string = string.replace("= = =", "===")
    string = string.replace("= =", "==")
    string = string.replace(" " + chr(176) + " ", chr(176))
    string = string.replace(" \n", "\n")
    string = string.replace("\n ", "\n")
    string = string.replace(" N ", " 1 ")
    return string.replace(" 's", "'s")


def wikitext_process_results(
    doc: dict[str, Any], results: list[float]
) -> dict[str, tuple[float, int]]:
    """Upstream counts words and bytes of the page *before* detokenization; so do we."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["page"]))
    size = len(doc["page"].encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, size),
        "bits_per_byte": (loglikelihood, size),
    }
