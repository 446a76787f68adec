"""Schemathesis over the running server's own OpenAPI schema (issue 16): a real uvicorn on
127.0.0.1 serving the tiny RTN artifact, every operation fuzzed with valid and invalid
requests. Whatever is sent: no 5xx, no hang (each call has a deadline), and every error in
OpenAI's shape ({"error": {"message", "type", "param", "code"}}).

The example count is bounded (FUZZ_EXAMPLES per operation, and both generation modes) so the
run fits CI on two cores in a couple of minutes; raise LITESERVE_FUZZ_EXAMPLES for a longer
hunt. A short session keeps any generated max_tokens cheap on the tiny model.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from tests.test_server import MODEL, Served, build_artifact, engine_config, serve, wait_idle

schemathesis = pytest.importorskip("schemathesis")

FUZZ_EXAMPLES = int(os.environ.get("LITESERVE_FUZZ_EXAMPLES", "25"))
CALL_TIMEOUT_S = 30.0  # a request that has not answered by then counts as a hang
SESSION_LEN = 96
VALID_PROMPT = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "def f(x):"},
}


@pytest.fixture(scope="module")
def fuzz_server(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    artifact = build_artifact(tokenizer_dir, tmp_path_factory.mktemp("fuzz"))
    s = serve(artifact, config=engine_config(session_len=SESSION_LEN), max_body_bytes=64 * 1024)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Served):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def assert_openai_error(response: requests.Response) -> None:
    """An error body as OpenAI's clients parse it."""
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], body
    assert isinstance(err.get("type"), str) and err["type"], body
    assert "param" in err and "code" in err, body


def check_case(case, seen: Counter, repair: bool) -> None:
    if repair and isinstance(case.body, dict) and case.operation.path in VALID_PROMPT:
        case.body.update(VALID_PROMPT[case.operation.path])
    response = case.call(timeout=CALL_TIMEOUT_S)
    seen[case.operation.path, response.status_code // 100] += 1
    assert response.status_code < 500, (case.as_curl_command(), response.text[:2000])
    if response.status_code >= 400:
        assert_openai_error(response)


# Schemathesis' own pytest plugin (from_fixture + parametrize) breaks on pytest 9 (it reads a
# private node attribute), so each operation's strategy runs under hypothesis directly.
@pytest.mark.parametrize("mode", ["positive", "negative", "valid-prompt"])
def test_no_5xx_no_hang_errors_in_openai_shape(api_schema, mode: str) -> None:
    """positive and negative: schemathesis' own modes. valid-prompt: positive cases with a
    usable prompt or conversation put in, since the schema alone rarely yields one (content
    is optional in it for assistant tool calls), so the sampling fields reach the engine."""
    generation = schemathesis.GenerationMode("negative" if mode == "negative" else "positive")
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {"/v1/chat/completions", "/v1/completions"} <= {op.path for op in operations}
    seen: Counter = Counter()  # (path, status class) -> responses
    for operation in operations:
        if mode == "negative" and not operation.body and not operation.query:
            continue  # nothing there to break: no invalid request exists for it
        fuzz_operation(operation, generation, seen, repair=mode == "valid-prompt")
    if mode == "valid-prompt":  # valid requests got through to the engine, not only refusals
        assert seen["/v1/completions", 2] and seen["/v1/chat/completions", 2], seen


def fuzz_operation(operation, generation, seen: Counter, repair: bool) -> None:
    """FUZZ_EXAMPLES cases of one operation, shrunk to the smallest failing one on failure."""

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,  # the same examples every run: a CI failure reproduces
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=generation))
    def fuzz(case) -> None:
        check_case(case, seen, repair)

    fuzz()


def test_the_fuzzed_server_is_idle_and_consistent_afterwards(fuzz_server: Served) -> None:
    """Runs after the fuzzing (file order): nothing in flight, every KV block free."""
    wait_idle(fuzz_server, timeout=30)
