import functools
import hashlib
import json
import struct
import sys
from pydoc_data.topics import topics

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lite import data
from lite.data import (
    BUILTIN,
    HUB_SETS,
    CalibrationError,
    CalibrationSet,
    build_calibration,
    heldout_text,
    load_texts,
    pydoc_split,
)

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
WORDS = "the quick brown fox jumps over the lazy dog while python sorts keys in order "


@functools.cache
def _backend() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([WORDS * 20, pydoc_split()[0][:20000]], trainer=trainer)
    return tok


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(), unk_token="<unk>", model_max_length=32
    )
    tok.chat_template = chat_template
    return tok


@pytest.fixture
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False, verbose=False)["input_ids"]


def joined_ids(tok, texts: list[str]) -> list[int]:
    out: list[int] = []
    for i, text in enumerate(texts):
        if i:
            out += ids(tok, "\n\n")
        out += ids(tok, text)
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


# --- pydoc ---------------------------------------------------------------------------------


def test_pydoc_split_is_first_60_sorted_topics_then_the_rest():
    keys = sorted(topics)
    calib, heldout = pydoc_split()
    assert calib == "\n\n".join(topics[k] for k in keys[:60])
    assert heldout == "\n\n".join(topics[k] for k in keys[60:])
    assert calib.strip() and heldout.strip()
    assert pydoc_split() == (calib, heldout)
    assert heldout_text() == heldout
    assert {topics[k] for k in keys[:60]}.isdisjoint(topics[k] for k in keys[60:])
    assert "\n\n".join(load_texts(BUILTIN)) == calib


def test_pydoc_calibration_shape_and_properties(tok):
    calib = build_calibration(BUILTIN, tok, n_samples=4, seqlen=64)
    assert isinstance(calib, CalibrationSet)
    assert calib.name == "pydoc"
    assert calib.tokens.dtype == torch.int64
    assert calib.tokens.shape == (4, 64)
    assert (calib.n_samples, calib.seqlen) == (4, 64)


def test_long_documents_do_not_trigger_the_model_max_length_warning():
    tok = make_tokenizer()  # model_max_length=32, far below one pydoc topic
    build_calibration(BUILTIN, tok, n_samples=2, seqlen=16)
    assert not tok.deprecation_warnings.get(
        "sequence-length-is-longer-than-the-specified-maximum", False
    )


# --- local files ---------------------------------------------------------------------------


def test_txt_file_is_one_text_cut_into_consecutive_blocks(tok, tmp_path):
    text = WORDS * 10 + "\nsecond line ünïcode"
    path = tmp_path / "calib.txt"
    path.write_text(text, encoding="utf-8")
    assert load_texts(str(path)) == [text]
    expected = ids(tok, text)
    n_blocks = len(expected) // 8
    with pytest.warns(UserWarning):
        calib = build_calibration(str(path), tok, n_samples=10_000, seqlen=8)
    assert calib.name == str(path)
    assert calib.tokens.shape == (n_blocks, 8)
    assert calib.tokens.flatten().tolist() == expected[: n_blocks * 8]


def test_jsonl_text_records_are_joined_by_blank_lines(tok, tmp_path):
    texts = [WORDS * 3, "", "the lazy dog " * 7]
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n   \n")  # blank lines are skipped
    assert load_texts(path) == [texts[0], texts[2]]
    expected = joined_ids(tok, [texts[0], texts[2]])
    calib = build_calibration(path, tok, n_samples=len(expected) // 4, seqlen=4)
    assert calib.tokens.flatten().tolist() == expected[: calib.tokens.numel()]


def test_jsonl_messages_are_rendered_with_the_chat_template(tok, tmp_path):
    messages = [
        {"role": "user", "content": "quick fox"},
        {"role": "assistant", "content": "lazy dog"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}] * 3)
    texts = load_texts(path, tok)
    assert texts == ["<|user|>quick fox<|end|>\n<|assistant|>lazy dog<|end|>\n"] * 3
    calib = build_calibration(path, tok, n_samples=1, seqlen=8)
    flat = calib.tokens.flatten().tolist()
    assert tok.convert_tokens_to_ids("<|user|>") in flat
    assert tok.convert_tokens_to_ids("<|end|>") in flat


def test_parquet_text_column(tok, tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["alpha beta", None, "gamma"]}), path)
    assert load_texts(str(path)) == ["alpha beta", "gamma"]


def test_parquet_messages_column(tok, tmp_path):
    path = tmp_path / "chat.parquet"
    rows = [[{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "yo"}]]
    pq.write_table(pa.table({"messages": rows}), path)
    assert load_texts(str(path), tok) == ["<|user|>hi<|end|>\n", "<|assistant|>yo<|end|>\n"]


# --- block selection and hashing -----------------------------------------------------------


def test_seed_is_deterministic_and_keeps_text_order(tok, tmp_path):
    path = tmp_path / "many.txt"
    path.write_text(" ".join(f"w{i}" for i in range(3000)), encoding="utf-8")
    full = torch.tensor(ids(tok, path.read_text(encoding="utf-8")))
    n_blocks = full.numel() // 8
    assert n_blocks > 20
    pool = full[: n_blocks * 8].view(n_blocks, 8)

    a = build_calibration(str(path), tok, n_samples=5, seqlen=8, seed=1)
    b = build_calibration(str(path), tok, n_samples=5, seqlen=8, seed=1)
    c = build_calibration(str(path), tok, n_samples=5, seqlen=8, seed=2)
    assert torch.equal(a.tokens, b.tokens) and a.sha256 == b.sha256
    assert not torch.equal(a.tokens, c.tokens)

    expected = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(1))[:5].sort()
    assert torch.equal(a.tokens, pool[expected.values])


def test_sha256_is_of_little_endian_int32_tokens_and_tracks_them(tok):
    a = build_calibration(BUILTIN, tok, n_samples=3, seqlen=16, seed=0)
    b = build_calibration(BUILTIN, tok, n_samples=3, seqlen=16, seed=5)
    flat = a.tokens.flatten().tolist()
    assert a.sha256 == hashlib.sha256(struct.pack(f"<{len(flat)}i", *flat)).hexdigest()
    assert not torch.equal(a.tokens, b.tokens)
    assert a.sha256 != b.sha256


def test_too_few_blocks_warns_and_uses_all(tok, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(WORDS, encoding="utf-8")
    n_blocks = len(ids(tok, WORDS)) // 4
    with pytest.warns(UserWarning, match=f"asked for 100 .*only {n_blocks} blocks of 4"):
        calib = build_calibration(str(path), tok, n_samples=100, seqlen=4)
    assert calib.n_samples == n_blocks


def test_pool_of_big_sets_is_cut_at_the_token_cap(tok, monkeypatch):
    monkeypatch.setattr(data, "_MAX_POOL_TOKENS", 64)
    calib = build_calibration(BUILTIN, tok, n_samples=2, seqlen=16, seed=3)
    prefix = joined_ids(tok, load_texts(BUILTIN)[:2])[:64]
    blocks = torch.tensor(prefix).view(4, 16)
    assert all(any(torch.equal(row, b) for b in blocks) for row in calib.tokens)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_empty_txt_file(tok, tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(CalibrationError, match="empty.txt.* is empty"):
        build_calibration(str(path), tok, n_samples=1, seqlen=2)


def test_non_utf8_txt_names_the_file(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(CalibrationError, match="latin1.txt.*not valid UTF-8"):
        load_texts(str(path))


def test_jsonl_line_without_text_or_messages_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"prompt": "no"}])
    with pytest.raises(CalibrationError, match=r"c\.jsonl' line 2: expected a 'text' string"):
        load_texts(path)


def test_jsonl_bad_json_names_the_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(CalibrationError, match=r"c\.jsonl' line 3 is not valid JSON"):
        load_texts(str(path))


def test_jsonl_non_object_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('["text"]\n', encoding="utf-8")
    with pytest.raises(CalibrationError, match="line 1 is not a JSON object"):
        load_texts(str(path))


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_messages_without_chat_template(tmp_path, with_tokenizer):
    tokenizer = make_tokenizer(chat_template=None) if with_tokenizer else None
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(CalibrationError, match="line 1: 'messages' need a tokenizer with a chat"):
        load_texts(path, tokenizer)


def test_chat_template_failure_names_the_line(tmp_path):
    tok = make_tokenizer("{{ raise_exception('roles must alternate') }}")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(CalibrationError, match="line 1: .*roles must alternate"):
        load_texts(path, tok)


def test_parquet_without_text_or_messages_lists_columns(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "answer": ["b"]}), path)
    with pytest.raises(CalibrationError, match=r"columns \['prompt', 'answer'\]"):
        load_texts(str(path))


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "c.parquet"
    path.write_text("not parquet", encoding="utf-8")
    with pytest.raises(CalibrationError, match="could not be read as Parquet"):
        load_texts(str(path))


@pytest.mark.parametrize("spec", ["wiki", "missing/dir/calib.txt", "nope.jsonl"])
def test_unknown_name_or_missing_path_lists_the_choices(spec):
    with pytest.raises(CalibrationError) as err:
        load_texts(spec)
    message = str(err.value)
    assert spec in message
    for choice in (BUILTIN, *HUB_SETS, ".txt", ".jsonl", ".parquet"):
        assert choice in message


def test_existing_file_with_unsupported_suffix(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("text\nhello\n", encoding="utf-8")
    with pytest.raises(CalibrationError, match="unsupported suffix '.csv'.*.parquet"):
        load_texts(str(path))


def _offline(*args, **kwargs):
    raise ConnectionError("no route to huggingface.co")


@pytest.mark.parametrize("name", HUB_SETS)
def test_hub_set_offline_names_the_offline_choices(monkeypatch, name):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", _offline)
    with pytest.raises(CalibrationError) as err:
        load_texts(name)
    message = str(err.value)
    assert "could not be downloaded" in message and "no route" in message
    for choice in ("pydoc", ".txt", ".jsonl", ".parquet"):
        assert choice in message


def test_hub_set_without_datasets_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(CalibrationError, match="could not be downloaded.*pydoc"):
        load_texts("wikitext2")


@pytest.mark.parametrize(
    ("name", "args", "split", "field"),
    [
        ("pileval", ("mit-han-lab/pile-val-backup",), "validation", "text"),
        ("wikitext2", ("wikitext", "wikitext-2-raw-v1"), "train", "text"),
        ("c4", ("allenai/c4",), "validation", "text"),
        ("ptb", ("ptb_text_only", "penn_treebank"), "train", "sentence"),
    ],
)
def test_hub_sets_load_the_documented_source(monkeypatch, name, args, split, field):
    import datasets

    calls = []

    def fake_load(*a, **kw):
        calls.append((a, kw))
        return {field: ["first doc", " ", "second doc"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    assert load_texts(name) == ["first doc", "second doc"]
    [(got_args, got_kwargs)] = calls
    assert got_args == args and got_kwargs["split"] == split
    if name == "c4":
        assert got_kwargs["data_files"] == {"validation": "en/c4-validation.00000-of-00008.json.gz"}


def test_text_shorter_than_one_block(tok, tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("fox", encoding="utf-8")
    n = len(ids(tok, "fox"))
    with pytest.raises(CalibrationError, match=f"only {n} tokens.*smaller --calib-seqlen"):
        build_calibration(str(path), tok, n_samples=1, seqlen=64)


@pytest.mark.parametrize(("n_samples", "seqlen"), [(0, 16), (-1, 16), (1, 1)])
def test_bad_sizes(tok, n_samples, seqlen):
    with pytest.raises(CalibrationError, match="must be at least"):
        build_calibration(BUILTIN, tok, n_samples=n_samples, seqlen=seqlen)
