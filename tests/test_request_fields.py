"""No request field is silently ignored: every field of OpenAI's request types is implemented or
refused by name, and the ones that were ignored before (logit_bias, presence/frequency
penalties, top_k unset, skip_special_tokens, the launch config's serving fields) now act."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import ValidationError

from runtime import EngineConfig
from runtime.artifact.manifest import LaunchConfig
from runtime.engine.sampler import Sampler, SamplingParams, _apply_bias_and_penalties
from runtime.server.protocol import (
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
)
from runtime.validation import validation_message
from tests.test_server import MODEL, engine_config, serve

MSGS = [{"role": "user", "content": "hi"}]
BASE = {
    ChatCompletionRequest: {"model": "m", "messages": MSGS},
    CompletionRequest: {"model": "m", "prompt": "hi"},
}
OPENAI_FIELDS = {
    ChatCompletionRequest: typing.get_type_hints(chat_params.CompletionCreateParamsBase),
    CompletionRequest: typing.get_type_hints(completion_params.CompletionCreateParamsBase),
}


def _accepted(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_every_openai_field_is_implemented_or_refused(model: type) -> None:
    unknown = set(OPENAI_FIELDS[model]) - _accepted(model) - set(REFUSED)
    assert not unknown, f"OpenAI fields neither implemented nor refused: {sorted(unknown)}"
    assert not set(REFUSED) & _accepted(model)  # one or the other, never both


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_refused_field_is_named(model: type, field: str) -> None:
    noops, why = REFUSED[field]
    for value in noops:  # the values that change nothing pass
        model.model_validate({**BASE[model], field: value})
    with pytest.raises(ValidationError) as e:
        model.model_validate({**BASE[model], field: "something"})
    message, param = validation_message(e.value)
    assert param == field and message == f"{field}: {why}"


# ---- sampler ----


def test_logit_bias_and_penalties_are_additive_as_openai_defines() -> None:
    logits = torch.zeros(2, 8)
    params = [
        SamplingParams(
            logit_bias={1: 5.0, 7: -100.0}, presence_penalty=0.5, frequency_penalty=0.25
        ),
        SamplingParams(),
    ]
    out = _apply_bias_and_penalties(logits, params, [torch.tensor([3, 3, 3, 4]), None])
    want = torch.zeros(2, 8)
    want[0, 1], want[0, 7] = 5.0, -100.0
    want[0, 3] = -(3 * 0.25 + 0.5)
    want[0, 4] = -(1 * 0.25 + 0.5)
    assert torch.equal(out, want)


def test_bias_steers_greedy_and_sampled_tokens() -> None:
    logits = torch.randn(2, 50)
    params = [
        SamplingParams(temperature=0, logit_bias={17: 100.0}),
        SamplingParams(temperature=1, seed=0, logit_bias={i: -100.0 for i in range(50) if i != 9}),
    ]
    gen = torch.Generator().manual_seed(0)
    tokens, _ = Sampler()(logits, params, [None, gen], [None, None])
    assert tokens.tolist() == [17, 9]


def test_frequency_penalty_stops_a_repeat() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0)]
    tokens, _ = Sampler()(logits, params, [None], [None], outputs=[torch.tensor([0])])
    assert tokens.tolist() == [1]  # 2 - 2 < 1


@pytest.mark.parametrize(
    "field,value,needle",
    [("presence_penalty", 3.0, "[-2, 2]"), ("logit_bias", {1: 101.0}, "[-100, 100]")],
)
def test_sampling_params_range(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value}).validate()
    assert needle in str(e.value)


# ---- the launch config ----


def test_launch_config_fills_what_no_flag_set() -> None:
    launch = LaunchConfig(cache_block_seq_len=32, max_batch_size=7, max_prefill_tokens=300)
    filled = EngineConfig().with_launch_defaults(launch)
    assert (filled.cache_block_seq_len, filled.max_batch_size, filled.max_prefill_token_num) == (
        32,
        7,
        300,
    )
    flags = EngineConfig(cache_block_seq_len=16, max_batch_size=2, max_prefill_token_num=64)
    kept = flags.with_launch_defaults(launch)
    assert (kept.cache_block_seq_len, kept.max_batch_size, kept.max_prefill_token_num) == (
        16,
        2,
        64,
    )


# ---- the server ----


@pytest.fixture(scope="module")
def served(rtn_artifact: Path) -> Iterator:
    s = serve(rtn_artifact, config=engine_config())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


def test_served_engine_took_the_launch_config(served) -> None:
    launch = served.engine.artifact.manifest.launch
    assert served.engine.config.max_batch_size == launch.max_batch_size
    cap = served.engine.ops.step_tokens or launch.max_prefill_tokens  # the CPU's, below it
    assert served.engine.config.max_prefill_token_num == min(launch.max_prefill_tokens, cap)


def test_top_k_unset_keeps_the_artifact_default(served, monkeypatch) -> None:
    generation = served.engine.artifact.manifest.generation
    monkeypatch.setattr(generation, "top_k", 17)
    state = served.state

    def top_k(**kw: object) -> int:
        req = ChatCompletionRequest.model_validate({**BASE[ChatCompletionRequest], **kw})
        return state.params(req, state.sampling_fields(req), 0, 4).top_k

    assert top_k() == 17
    assert top_k(top_k=-1) == 0 and top_k(top_k=0) == 0 and top_k(top_k=3) == 3


def test_skip_special_tokens_reaches_the_detokenizer(served, client: openai.OpenAI) -> None:
    tok = served.engine.tokenizer
    special = next(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    text = tok.decode([special], skip_special_tokens=False)
    force = {"logit_bias": {str(special): 100}, "ignore_eos": True}

    def complete(skip: bool) -> str:
        r = client.completions.create(
            model=MODEL,
            prompt="a",
            max_tokens=2,
            temperature=0,
            extra_body={**force, "skip_special_tokens": skip},
        )
        return r.choices[0].text

    assert complete(False) == text * 2
    assert complete(True) == ""


def test_penalties_change_the_output(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="def f(x):", max_tokens=24, temperature=0)
    plain = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    penalised = client.completions.create(
        **args, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"ignore_eos": True}
    )
    assert penalised.choices[0].text != plain


def test_refused_field_over_http_and_the_server_serves_on(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, extra_body={"best_of": 3})
    assert e.value.status_code == 400 and e.value.body["param"] == "best_of"
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, logit_bias={"999999": 1})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary" in str(e.value)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, store=False)
    assert r.choices[0].message.content is not None
