"""The lm-eval model `liteserve` against independent computations on a tiny artifact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from lite.lm_eval_model import LiteserveLM
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams

TEXT = (
    "The sqlite3 module provides a SQL interface compliant with the DB-API 2.0 specification. "
    "A context manager closes the file when the block ends, even when an exception is raised."
)


# the engine the scores are checked against: float math, as LiteserveLM runs by default
REFERENCE = EngineConfig(num_blocks=32, dtype="float32", kv_quant="none", int8_activations=False)


def _req(kind: str, *args: object) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def lm(rtn_artifact: Path) -> LiteserveLM:
    return LiteserveLM(
        str(rtn_artifact), max_length=64, dtype="float32", batch_size=3, kv_quant="none"
    )


def _logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from the engine's whole distributions."""
    logits = engine.score([ids])[0].log_softmax(-1)
    return logits.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_loglikelihood_matches_direct_computation(lm: LiteserveLM, rtn_artifact: Path) -> None:
    pairs = [("The sqlite3 module", " provides a SQL interface"), ("A context", " manager")]
    words = TEXT.split(" ")
    pairs += [(" ".join(words[:i]), " " + " ".join(words[i : i + 3])) for i in range(2, 14, 2)]
    got = lm.loglikelihood([_req("loglikelihood", c, x) for c, x in pairs], disable_tqdm=True)
    engine = Engine(rtn_artifact, REFERENCE)
    tok = engine.tokenizer
    for (context, cont), (ll, greedy) in zip(pairs, got, strict=True):
        ctx = tok.encode(context, add_special_tokens=False).ids
        whole = tok.encode(context + cont, add_special_tokens=False).ids
        assert whole[: len(ctx)] == ctx and len(whole) <= lm.max_length
        lps = _logprobs(engine, whole)[len(ctx) - 1 :]
        assert ll == pytest.approx(float(lps.sum()), abs=1e-4)
        logits = engine.score([whole])[0][len(ctx) - 1 :]
        want_greedy = bool((logits.argmax(-1) == torch.tensor(whole[len(ctx) :])).all())
        assert greedy == want_greedy


def test_loglikelihood_truncates_on_the_left(lm: LiteserveLM, rtn_artifact: Path) -> None:
    """Longer than max_length: the last max_length + 1 tokens are kept, as lm-eval's hf does."""
    context, *last = TEXT.rsplit(" ", 3)
    cont = " " + " ".join(last)
    ((ll, _),) = lm.loglikelihood([_req("loglikelihood", context, cont)], True)
    engine = Engine(rtn_artifact, REFERENCE)
    tok = engine.tokenizer
    ctx = tok.encode(context, add_special_tokens=False).ids
    whole = tok.encode(TEXT, add_special_tokens=False).ids
    assert whole[: len(ctx)] == ctx
    n = len(whole) - len(ctx)
    assert len(whole) > lm.max_length + 1
    kept = whole[-(lm.max_length + 1) :]
    assert ll == pytest.approx(float(_logprobs(engine, kept)[-n:].sum()), abs=1e-4)


def test_loglikelihood_rolling_scores_every_token_once(
    lm: LiteserveLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[int], list[int]]] = []
    original = lm._loglikelihood_tokens

    def spy(requests, **kw):
        seen.extend((ctx, cont) for _, ctx, cont in requests)
        return original(requests, **kw)

    monkeypatch.setattr(lm, "_loglikelihood_tokens", spy)
    total = lm.loglikelihood_rolling([_req("loglikelihood_rolling", TEXT * 2)], True)[0]
    tokens = lm.tok_encode(TEXT * 2)
    assert len(tokens) > 2 * lm.max_length  # several windows
    assert [t for _, cont in seen for t in cont] == tokens
    assert seen[0][0] == [lm.prefix_token_id]
    assert all(len(cont) <= lm.max_length for _, cont in seen)
    monkeypatch.undo()
    parts = lm._loglikelihood_tokens([(None, c, x) for c, x in seen])
    assert total == pytest.approx(sum(ll for ll, _ in parts), abs=1e-4)


def test_loglikelihood_rolling_one_window_is_the_whole_sequence(rtn_artifact: Path) -> None:
    lm = LiteserveLM(str(rtn_artifact), max_length=256, dtype="float32", kv_quant="none")
    text = TEXT[:120]
    total = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)], True)[0]
    ids = [lm.prefix_token_id, *lm.tok_encode(text)]
    assert total == pytest.approx(float(_logprobs(lm.engine, ids).sum()), abs=1e-4)


def test_generate_until_stops_at_until(lm: LiteserveLM, rtn_artifact: Path) -> None:
    engine = Engine(rtn_artifact, REFERENCE)
    prompt = "def open(file, mode"
    free = engine.generate(
        [engine.tokenizer.encode(prompt, add_special_tokens=False).ids],
        SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
    )[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), free
    cut = free[: free.index(stop)]
    out = lm.generate_until(
        [
            _req("generate_until", prompt, {"until": [stop], "max_gen_toks": 24}),
            _req("generate_until", prompt, {"until": ["\x00never"], "max_gen_toks": 5}),
        ],
        True,
    )
    assert out[0] == cut
    assert free.startswith(out[1]) and len(out[1]) < len(free)


def test_bad_arguments(rtn_artifact: Path, lm: LiteserveLM) -> None:
    with pytest.raises(ValueError, match="kv_quant"):
        LiteserveLM(str(rtn_artifact), kv_quant="int3")
    # the tiny model has 1024 positions: 1023 was cut to 768 (1024 - max_gen_toks) where
    # lm-eval's hf model, the baseline, kept 1023, so the two sides scored different tokens
    with pytest.raises(ValueError, match="max_length 1023 does not fit the model's 1024"):
        LiteserveLM(str(rtn_artifact), max_length=1023)
    with pytest.raises(ValueError, match="max_gen_toks 64 leaves no context within max_len"):
        lm.generate_until([_req("generate_until", "x", {"max_gen_toks": 64})], True)
    assert LiteserveLM(str(rtn_artifact), max_length=1022, num_blocks=32).max_length == 1022
    # an empty continuation summed every prompt logprob: the context's own likelihood
    with pytest.raises(ValueError, match="the continuation encodes to no tokens"):
        lm.loglikelihood([_req("loglikelihood", "The sqlite3 module", "")], disable_tqdm=True)
    with pytest.raises(ValueError, match="max_gen_toks"):
        lm.generate_until([_req("generate_until", "x", {"max_gen_toks": 10_000})], True)


def test_registered_for_lm_eval() -> None:
    from lm_eval.api.registry import get_model

    assert get_model("liteserve") is LiteserveLM


def test_lite_lm_eval_runs_lm_evals_cli_with_liteserve(rtn_artifact: Path, tmp_path: Path) -> None:
    """The stock lm-eval command line, with `liteserve` registered, on the local PIQA task."""
    import json
    import subprocess
    import sys

    docs = [("How do I boil an egg?", "In boiling water.", "In a cold oven.", 0)] * 3
    (tmp_path / "piqa_valid.jsonl").write_text(
        "".join(json.dumps({"goal": g, "sol1": a, "sol2": b}) + "\n" for g, a, b, _ in docs)
    )
    (tmp_path / "piqa_valid_labels.lst").write_text("0\n0\n0\n")
    tasks = Path(__file__).parents[1] / "evals" / "tasks"
    args = ["run", "--model", "liteserve", "--tasks", "piqa_local", "--include_path", str(tasks)]
    args += ["--model_args", f"artifact={rtn_artifact},kv_quant=int8,dtype=float32"]
    args += ["--metadata", json.dumps({"data_dir": str(tmp_path)})]
    out = subprocess.run(
        [sys.executable, "-m", "lite", "lm-eval", *args], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "|piqa_local|" in out.stdout and "acc" in out.stdout


def test_a_failing_step_leaves_no_request_running(
    lm: LiteserveLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises mid-batch (or Ctrl-C) ends the call with nothing left in the engine
    for the next call to step through."""
    real, calls = lm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a step failed")
        return real()

    monkeypatch.setattr(lm.engine, "step", failing_step)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="a step failed"):
        lm._run([[5, 6, 7], [8, 9], [10, 11, 12]], [params] * 3, "test", True)
    assert not lm.engine.sequences and not lm.engine.has_work()


def test_scores_are_float_math_whatever_the_host_measured(
    rtn_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU engine quantizes activations to int8 where its host measured that faster (a
    speed path): `lite eval`, `lite ppl` and lm-eval's `liteserve` ran it while their reports
    said float32, so a score moved with the machine (SmolLM2 RTN: ppl 62.98 against 62.11 in
    float). Here the int8 paths win every measurement, and the scores stay float math."""
    from lite.perplexity import run_ppl
    from runtime.kernels import cpu_dispatch

    monkeypatch.delenv("LITESERVE_CPU_INT8", raising=False)
    everywhere = {op: cpu_dispatch.Choice(((1 << 30, "int8"),)) for op in ("int4", "logits")}
    real = cpu_dispatch.cached_choices

    def int8_wins(key: str, run, threads: int):  # a float-only engine's table stays its own
        return real(key, run, threads) if key.endswith("-float") else everywhere

    monkeypatch.setattr(cpu_dispatch, "cached_choices", int8_wins)
    pairs = [("The sqlite3 module", TEXT[18:80]), ("A context", " manager closes the file")]
    reqs = [_req("loglikelihood", c, x) for c, x in pairs]

    def scores(**kw: object) -> list[float]:
        lm = LiteserveLM(str(rtn_artifact), max_length=64, kv_quant="none", num_blocks=32, **kw)
        return [ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True)]

    engine = Engine(rtn_artifact, REFERENCE)
    tok = engine.tokenizer
    want = []
    for context, cont in pairs:
        ctx = tok.encode(context, add_special_tokens=False).ids
        whole = tok.encode(context + cont, add_special_tokens=False).ids
        want.append(float(_logprobs(engine, whole)[len(ctx) - 1 :].sum()))
    assert scores() == pytest.approx(want, abs=1e-4)
    if engine.ops.lib is not None:  # the int8 paths are the C kernels'
        assert scores(int8_activations=True) != pytest.approx(want, abs=1e-4)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 4)
    default = run_ppl(None, (rtn_artifact,), text, seqlen=32, limit=2)[0].ppl
    monkeypatch.setenv("LITESERVE_CPU_INT8", "0")
    assert default == pytest.approx(run_ppl(None, (rtn_artifact,), text, seqlen=32, limit=2)[0].ppl)


def test_tokens_are_hfs_for_a_tokenizer_that_adds_bos(
    lm: LiteserveLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama's or Mistral's tokenizer adds BOS: lm-eval's hf model (the source's baseline)
    kept it and this model dropped every special token, so the two sides of a comparison
    scored different token streams."""
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(lm.engine.tokenizer.to_str())
    bos = tok.id_to_token(lm.prefix_token_id)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, lm.prefix_token_id)]
    )
    monkeypatch.setattr(lm.engine, "tokenizer", tok)
    hf = HFLM.__new__(HFLM)  # only its tokenization: no model loaded
    hf.tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos)
    hf.add_bos_token, hf.custom_prefix_token_id = None, None
    assert hf.prefix_token_id == lm.prefix_token_id
    for text in ("Question: what is 2+2?\nAnswer:", bos + "Already has it", " 4"):
        for special in (None, False, True):
            want = HFLM.tok_encode(hf, text, add_special_tokens=special)
            assert lm.tok_encode(text, add_special_tokens=special) == want, (text, special)
    assert lm.tok_encode("x")[0] == lm.prefix_token_id  # the case that differed


def test_gen_kwargs_are_read_as_lm_evals_backends_read_them(lm: LiteserveLM) -> None:
    """max_new_tokens (three bundled tasks' alias) was dropped for the default 256, and
    do_sample false with a temperature sampled: hf decodes greedily."""
    prompt = "def open(file, mode"
    greedy = lm.generate_until([_req("generate_until", prompt, {"max_gen_toks": 6})], True)[0]
    aliases = [
        {"max_new_tokens": 6},
        {"max_tokens": 6},
        {"max_gen_toks": 6, "do_sample": False, "temperature": 0.9},
        {"max_new_tokens": 6, "do_sample": False, "temperature": 1.5, "seed": 3},
    ]
    reqs = [_req("generate_until", prompt, {"until": ["\x00never"], **kw}) for kw in aliases]
    assert lm.generate_until(reqs, True) == [greedy] * len(aliases)
    short = lm.generate_until([_req("generate_until", prompt, {"max_new_tokens": 2})], True)[0]
    assert greedy.startswith(short) and len(short) < len(greedy)
