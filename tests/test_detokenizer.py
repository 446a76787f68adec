"""IncrementalDetokenizer against real tokenizers trained offline: byte-level BPE (GPT-2 style),
Metaspace BPE (SentencePiece style) and a Llama-style BPE with byte fallback; and
ByteLevelDetokenizer, which the engine takes for byte-level ones, on the same checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from runtime.engine.detokenizer import (
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    TokenBytes,
    detokenizer,
)

SPECIAL = ["<s>", "</s>", "<unk>"]
CORPUS = [
    "héllo wörld café naïve résumé über straße façade",
    "日本語のテキストです 中文文本 한국어 テスト",
    "emoji 😀 😃 🎉 👍🏽 ok 🚀",
    "the quick brown fox jumps over the lazy dog, 12345!\nnew line",
] * 20
# Words for random texts; every character occurs in CORPUS (the Metaspace tokenizer has no
# byte fallback, so an unseen character would become <unk>).
WORDS = sorted({w for line in CORPUS for w in line.split()}) + ["😀😃", "日本語😀", "é", "🎉!"]
# Characters outside CORPUS, for the byte-level and byte-fallback tokenizers only.
EXTRA = ["🦀", "Ω≈ç", "𝔘𝔫𝔦", "ñandú", "👨‍👩‍👧"]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _llama() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, byte-fallback tokens <0xXX> for characters not in the
    (deliberately limited) alphabet, and a decoder that strips the first leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=SPECIAL, limit_alphabet=30, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    n = max(vocab.values()) + 1
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = n + b
    spec["model"]["byte_fallback"] = True
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": _byte_level(), "metaspace": _metaspace(), "llama": _llama()}
# a tokenizer's name, or "NAME/bytes" for ByteLevelDetokenizer on it (byte-level ones only)
CASES = [*TOKENIZERS, "byte_level/bytes"]
BYTE_CAPABLE = ("byte_level", "llama", "byte_level/bytes")


def _words(extra: bool) -> st.SearchStrategy[str]:
    pool = WORDS + (EXTRA if extra else [])
    sep = st.sampled_from([" ", " ", " ", "", "  ", "\n"])
    return st.lists(st.tuples(st.sampled_from(pool), sep), max_size=12).map(
        lambda xs: "".join(w + s for w, s in xs)
    )


def _tok(case: str) -> Tokenizer:
    return TOKENIZERS[case.split("/")[0]]


def _run(case: str, prompt_ids: list[int], gen_ids: list[int], skip: bool = True):
    tok = _tok(case)
    if case.endswith("/bytes"):
        detok = ByteLevelDetokenizer(TokenBytes(tok), prompt_ids, skip_special_tokens=skip)
    else:
        detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    outs = [detok.step(t) for t in gen_ids]
    return detok, outs


def _expected(tok: Tokenizer, prompt_ids: list[int], gen_ids: list[int], skip: bool = True):
    full = tok.decode(prompt_ids + gen_ids, skip_special_tokens=skip)
    pre = tok.decode(prompt_ids, skip_special_tokens=skip)
    assert full.startswith(pre)
    return full[len(pre) :]


def _check(name: str, prompt: str, gen: str) -> None:
    tok = _tok(name)
    p = tok.encode(prompt, add_special_tokens=False).ids
    g = tok.encode(gen, add_special_tokens=False).ids
    assert 2 not in p + g  # no <unk>: the texts only use known characters
    detok, outs = _run(name, p, g)
    assert all("\ufffd" not in o for o in outs), outs
    assert "".join(outs) == detok.text == _expected(tok, p, g)
    # no prompt: exactly decode(output ids)
    detok, outs = _run(name, [], g)
    assert all("\ufffd" not in o for o in outs), outs
    assert "".join(outs) == detok.text == tok.decode(g)
    assert detok.flush() == ""


@pytest.mark.parametrize("name", CASES)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(prompt=_words(extra=False), gen=_words(extra=False))
def test_random_texts_match_decode(name, prompt, gen):
    _check(name, prompt, gen)


@pytest.mark.parametrize("name", BYTE_CAPABLE)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(prompt=_words(extra=True), gen=_words(extra=True))
def test_random_texts_with_unseen_characters(name, prompt, gen):
    _check(name, prompt, gen)


@pytest.mark.parametrize("name", BYTE_CAPABLE)
def test_characters_split_over_tokens_are_held_back(name):
    tok = _tok(name)
    # outside the training text, so byte tokens for certain ("日" was in the limited alphabet
    # of the llama tokenizer in some trainings: the trainer breaks frequency ties freely)
    for ch in ("🦀", "Ω"):
        assert len(tok.encode(ch, add_special_tokens=False).ids) > 1  # really split
    prompt = tok.encode("hi there", add_special_tokens=False).ids
    gen = tok.encode("x 🦀 日本 Ω 👨‍👩‍👧 y", add_special_tokens=False).ids
    detok, outs = _run(name, prompt, gen)
    assert "" in outs  # something was held back ...
    assert all("\ufffd" not in o for o in outs)
    assert detok.text == _expected(tok, prompt, gen)  # ... and completed later
    assert detok.text.endswith("👨‍👩‍👧 y")


def test_metaspace_spaces():
    tok = TOKENIZERS["metaspace"]
    prompt = tok.encode("the quick", add_special_tokens=False).ids
    gen = tok.encode("brown fox", add_special_tokens=False).ids
    detok, outs = _run("metaspace", prompt, gen)
    assert detok.text == " brown fox"  # the "▁" of the first word is a real space here
    detok, outs = _run("metaspace", [], gen)
    assert detok.text == "brown fox"  # ... and stripped at the start, as decode() does


@pytest.mark.parametrize("name", CASES)
def test_skip_special_tokens(name):
    tok = _tok(name)
    s, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    prompt = [s] + tok.encode("the quick", add_special_tokens=False).ids
    a = tok.encode("brown fox", add_special_tokens=False).ids
    b = tok.encode("jumps 😀", add_special_tokens=False).ids
    gen = a + [eos, s] + b + [eos] * 50
    detok, outs = _run(name, prompt, gen)
    assert "</s>" not in detok.text and "<s>" not in detok.text
    assert detok.text == _expected(tok, prompt, gen)
    # a run of skipped tokens does not grow the window (the bytes one has none)
    assert len(getattr(detok, "_window", [])) <= 16
    kept, outs = _run(name, prompt, gen, skip=False)
    assert kept.text.count("</s>") == 51
    assert kept.text == _expected(tok, prompt, gen, skip=False)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_window_stays_bounded(name):
    tok = TOKENIZERS[name]
    gen = tok.encode(" ".join(CORPUS), add_special_tokens=False).ids
    assert len(gen) > 500
    detok = IncrementalDetokenizer(tok, [])
    longest = 0
    for t in gen:
        detok.step(t)
        longest = max(longest, len(detok._window))
    assert longest <= 12
    assert detok.text == tok.decode(gen)
    assert detok.num_tokens == len(gen)


def test_invalid_bytes_are_eventually_emitted_and_flushed():
    tok = TOKENIZERS["llama"]
    cont = tok.token_to_id("<0x80>")  # a lone UTF-8 continuation byte: never completes
    detok = IncrementalDetokenizer(tok, tok.encode("hi", add_special_tokens=False).ids)
    for _ in range(40):
        detok.step(cont)
        assert len(detok._window) <= 18  # two chunks of at most _MAX_HELD + 1 tokens
    assert detok.text.count("\ufffd") >= 30
    assert detok.text + detok.flush() == "\ufffd" * 40
    # a sequence that ends in the middle of a character: flush() gives it up
    first = tok.encode("🦀", add_special_tokens=False).ids[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step(t) for t in first] == [""] * len(first)
    tail = detok.flush()
    assert tail.endswith("\ufffd") and detok.text == tok.decode(first)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, 310), max_size=40), skip=st.booleans())
def test_token_bytes_decode_as_the_tokenizer_does(ids: list[int], skip: bool) -> None:
    """Any ids at all (special ones, lone bytes that never form a character, ids past the
    vocabulary): the bytes detokenizer's text, flushed, is the tokenizer's own decode."""
    tok = TOKENIZERS["byte_level"]
    assert tok.get_vocab_size() < 310  # some ids are past it
    detok = ByteLevelDetokenizer(TokenBytes(tok), [], skip_special_tokens=skip)
    text = "".join(detok.step(t) for t in ids) + detok.flush()
    assert text == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_the_engine_detokenizes_by_bytes_only_where_the_decoder_is_byte_level() -> None:
    for name, tok in TOKENIZERS.items():
        kind = type(detokenizer(tok, TokenBytes.of(tok), [1, 2]))
        want = ByteLevelDetokenizer if name == "byte_level" else IncrementalDetokenizer
        assert kind is want, name


def test_a_lone_continuation_byte_comes_out_at_once() -> None:
    tok = TOKENIZERS["byte_level"]
    cont = next(i for i in range(tok.get_vocab_size()) if TokenBytes(tok)[i] == b"\x80")
    detok = ByteLevelDetokenizer(TokenBytes(tok), tok.encode("hi", add_special_tokens=False).ids)
    assert [detok.step(cont) for _ in range(3)] == ["\ufffd"] * 3
    crab = tok.encode("🦀", add_special_tokens=False).ids
    assert [detok.step(t) for t in crab[:-1]] == [""] * (len(crab) - 1)
    assert detok.flush() == "\ufffd" and detok.text == "\ufffd" * 4
