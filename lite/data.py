"""Calibration and held-out text sets for the AWQ quantizer and perplexity evaluation.

`--calib-dataset` accepts the built-in offline set ``pydoc``, a local ``.txt``/``.jsonl``/
``.parquet`` file, or one of the Hugging Face hub sets in `HUB_SETS`. Every problem a user can
fix raises `CalibrationError` whose message says what is wrong and what to do instead.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BUILTIN = "pydoc"
HUB_SETS = ("pileval", "wikitext2", "c4", "ptb")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")

# The first 60 sorted pydoc topics calibrate, the rest are held out; other tools reproduce this
# split from the same Python version, so benchmarks compare like with like.
_PYDOC_CALIB_TOPICS = 60

# (load_dataset positional args, load_dataset keyword args, text field)
_HUB_SOURCES: dict[str, tuple[tuple[str, ...], dict[str, Any], str]] = {
    "pileval": (("mit-han-lab/pile-val-backup",), {"split": "validation"}, "text"),
    "wikitext2": (("wikitext", "wikitext-2-raw-v1"), {"split": "train"}, "text"),
    "c4": (
        ("allenai/c4",),
        {
            "data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"},
            "split": "validation",
        },
        "text",
    ),
    "ptb": (("ptb_text_only", "penn_treebank"), {"split": "train"}, "sentence"),
}

# Hub sets hold up to hundreds of millions of tokens; tokenizing all of them to pick a few
# hundred blocks would take minutes and many GB, so the block pool is cut off here (never
# below n_samples * seqlen). The built-in set and ordinary files stay far below it.
_MAX_POOL_TOKENS = 1 << 23
_TOKENIZE_BATCH_DOCS = 1024

_ACCEPTED = (
    f"use {BUILTIN!r} (built-in, offline), one of {', '.join(repr(n) for n in HUB_SETS)} "
    f"(downloaded from the Hugging Face hub), or a path to a "
    f"{', '.join(FILE_SUFFIXES[:-1])} or {FILE_SUFFIXES[-1]} file"
)
_RECORD_SHAPE = "a 'text' string or a 'messages' list of {\"role\": ..., \"content\": ...} objects"


class CalibrationError(ValueError):
    """A calibration-data problem the user can fix; the message names the problem and the fix."""


@dataclass(frozen=True, eq=False)
class CalibrationSet:
    """Token blocks fed to the quantizer; `sha256` identifies them in the artifact manifest."""

    name: str
    tokens: torch.Tensor
    sha256: str

    @property
    def n_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def seqlen(self) -> int:
        return self.tokens.shape[1]


def _pydoc_topics() -> tuple[list[str], list[str]]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    return (
        [topics[k] for k in keys[:_PYDOC_CALIB_TOPICS]],
        [topics[k] for k in keys[_PYDOC_CALIB_TOPICS:]],
    )


def pydoc_split() -> tuple[str, str]:
    """Offline (calibration, held-out) texts, so quantizing and evaluating never share text."""
    calib, heldout = _pydoc_topics()
    return "\n\n".join(calib), "\n\n".join(heldout)


def heldout_text() -> str:
    """Default perplexity text: disjoint from the default calibration text."""
    return pydoc_split()[1]


def load_texts(spec: str, tokenizer: Any = None) -> list[str]:
    """Non-blank documents of a `--calib-dataset` value.

    The tokenizer is only needed to render chat `messages` with its chat template.
    """
    if spec == BUILTIN:
        return _pydoc_topics()[0]
    if spec in HUB_SETS:
        texts = _load_hub(spec)
    else:
        path = Path(spec)
        suffix = path.suffix.lower()
        if suffix not in FILE_SUFFIXES:
            if path.is_file():
                raise CalibrationError(
                    f"calibration file {spec!r} has an unsupported suffix {path.suffix!r}; "
                    f"{_ACCEPTED}"
                )
            raise CalibrationError(f"unknown calibration dataset {spec!r}; {_ACCEPTED}")
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise CalibrationError(f"calibration file {spec!r} {what}; {_ACCEPTED}")
        if suffix == ".txt":
            texts = [_read_utf8(path)]
        elif suffix == ".jsonl":
            texts = _load_jsonl(path, tokenizer)
        else:
            texts = _load_parquet(path, tokenizer)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError(
            f"calibration dataset {spec!r} is empty: it holds no non-blank text; "
            f"add text to it or use --calib-dataset {BUILTIN}"
        )
    return texts


def _load_hub(name: str) -> list[str]:
    args, kwargs, field = _HUB_SOURCES[name]
    try:
        import datasets

        # [:] reads the whole column in one go (datasets>=4 returns a lazy Column).
        return datasets.load_dataset(*args, **kwargs)[field][:]
    except Exception as exc:  # offline, missing package, hub errors: all mean "not available"
        raise CalibrationError(
            f"calibration dataset {name!r} could not be downloaded from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}); offline, use --calib-dataset {BUILTIN} (built-in) "
            f"or a local {', '.join(FILE_SUFFIXES)} file"
        ) from exc


def _read_utf8(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CalibrationError(
            f"calibration file {str(path)!r} is not valid UTF-8 (byte {exc.start}: {exc.reason});"
            " re-save it as UTF-8"
        ) from exc
    except OSError as exc:
        raise CalibrationError(
            f"calibration file {str(path)!r} could not be read ({exc}); check its permissions"
        ) from exc


def _load_jsonl(path: Path, tokenizer: Any) -> list[str]:
    texts = []
    # Split on "\n" only: JSON strings may legally contain U+2028, which splitlines() breaks on.
    for lineno, line in enumerate(_read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{str(path)!r} line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(
                f"{where} is not valid JSON ({exc.msg}); each line must be one JSON object "
                f"with {_RECORD_SHAPE}"
            ) from exc
        if not isinstance(record, dict):
            raise CalibrationError(f"{where} is not a JSON object; expected {_RECORD_SHAPE}")
        texts.append(_record_text(record, tokenizer, where))
    return texts


def _load_parquet(path: Path, tokenizer: Any) -> list[str]:
    import pyarrow.parquet as pq

    def unreadable(exc: Exception) -> CalibrationError:
        return CalibrationError(
            f"calibration file {str(path)!r} could not be read as Parquet ({exc}); "
            "write it with pyarrow or pandas.DataFrame.to_parquet"
        )

    try:
        columns = pq.read_schema(path).names
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise unreadable(exc) from exc
    column = next((c for c in ("text", "messages") if c in columns), None)
    if column is None:
        raise CalibrationError(
            f"calibration file {str(path)!r} has columns {columns}; it needs a 'text' column "
            "of strings or a 'messages' column of chat messages"
        )
    try:
        values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    except (OSError, ValueError) as exc:
        raise unreadable(exc) from exc
    return [
        _record_text({column: value}, tokenizer, f"{str(path)!r} row {row}")
        for row, value in enumerate(values, start=1)
        if value is not None
    ]


def _record_text(record: dict[str, Any], tokenizer: Any, where: str) -> str:
    if "text" in record:
        if not isinstance(record["text"], str):
            raise CalibrationError(f"{where}: 'text' must be a string; expected {_RECORD_SHAPE}")
        return record["text"]
    messages = record.get("messages")
    if not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise CalibrationError(f"{where}: expected {_RECORD_SHAPE}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(
            f"{where}: 'messages' need a tokenizer with a chat template, and this one has none; "
            "use a chat model's tokenizer, or give the rendered conversation as 'text'"
        )
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # the template is user-supplied Jinja and may raise anything
        raise CalibrationError(
            f"{where}: the tokenizer's chat template could not render these messages "
            f"({type(exc).__name__}: {exc}); fix the messages or give the text as 'text'"
        ) from exc


def _tokenize(texts: list[str], tokenizer: Any, max_tokens: int) -> torch.Tensor:
    """Token ids of the texts joined by "\\n\\n", cut at `max_tokens`.

    Documents are tokenized separately (batched, in order), so no single over-long sequence
    trips the tokenizer's model_max_length warning and big sets can stop early.
    """
    sep = list(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    chunks: list[torch.Tensor] = []
    total = 0
    for start in range(0, len(texts), _TOKENIZE_BATCH_DOCS):
        batch = texts[start : start + _TOKENIZE_BATCH_DOCS]
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        flat: list[int] = []
        for ids in encoded:
            if flat or chunks:
                flat.extend(sep)
            flat.extend(ids)
        chunks.append(torch.tensor(flat, dtype=torch.int64))
        total += len(flat)
        if total >= max_tokens:
            break
    return torch.cat(chunks)[:max_tokens]


def _tokens_sha256(tokens: torch.Tensor) -> str:
    data = tokens.to(torch.int32).contiguous().numpy().astype("<i4", copy=False).tobytes()
    return hashlib.sha256(data).hexdigest()


def build_calibration(
    spec: str, tokenizer: Any, n_samples: int, seqlen: int, seed: int = 42
) -> CalibrationSet:
    """`n_samples` random non-overlapping `seqlen`-token blocks of the `spec` text.

    Blocks are drawn with a seeded generator and kept in text order, so the same spec, tokenizer
    and seed always give the same tokens (and `sha256`).
    """
    if n_samples < 1:
        raise CalibrationError(
            f"the number of calibration samples must be at least 1, got {n_samples}; "
            "pass a positive count"
        )
    if seqlen < 2:
        raise CalibrationError(
            f"the calibration sequence length must be at least 2, got {seqlen}; "
            "pass a larger --calib-seqlen"
        )
    texts = load_texts(spec, tokenizer)
    tokens = _tokenize(texts, tokenizer, max(_MAX_POOL_TOKENS, n_samples * seqlen))
    n_blocks = tokens.numel() // seqlen
    if n_blocks == 0:
        raise CalibrationError(
            f"calibration dataset {spec!r} has only {tokens.numel()} tokens, fewer than one "
            f"block of {seqlen}; pass a smaller --calib-seqlen or use more text"
        )
    blocks = tokens[: n_blocks * seqlen].view(n_blocks, seqlen)
    if n_blocks > n_samples:
        generator = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(n_blocks, generator=generator)[:n_samples].sort().values
        blocks = blocks[chosen]
    elif n_blocks < n_samples:
        warnings.warn(
            f"asked for {n_samples} calibration samples but {spec!r} has only {n_blocks} "
            f"blocks of {seqlen} tokens; using all {n_blocks}",
            stacklevel=2,
        )
    return CalibrationSet(name=spec, tokens=blocks, sha256=_tokens_sha256(blocks))
