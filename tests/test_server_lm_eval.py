"""lm-eval's `local-completions` model against a running server, on a small generated
multiple-choice task, gives the same accuracy and the same per-document choices (and scores)
as scoring the same documents through the engine in-process.

The gold answers are set from the in-process predictions (right on half of the documents,
wrong on the other half), so the expected accuracy is exactly 0.5: a server that scored
differently would move it, and the per-document comparison pins down which document.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from tests.test_server import MODEL, build_artifact, engine_config, serve

TASK = "liteserve_tiny_mc"
DOCS = [
    ("The capital of France is", ["Paris", "a small town", "Rome"]),
    ("Water boils at", ["100 degrees", "the top of the mountain", "noon", "zero"]),
    ("def add(a, b): return", ["a + b", "None", "a - b"]),
    ("The opposite of hot is", ["cold", "warm water", "lukewarm tea"]),
    ("import os; os.path.join('a', 'b') gives", ["'a/b'", "an error", "'ab'"]),
    ("A week has", ["seven days", "ten days", "one long weekend", "52 days"]),
    ("The keyword to define a class in Python is", ["class", "def", "struct"]),
    ("Two plus two equals", ["four", "five", "twenty two"]),
    ("The color of the clear sky is", ["blue", "green", "a deep shade of red"]),
    ("for i in range(3): print(", ["i)", "x)", "range)"]),
]


def choice_scores(engine: Engine, context: str, choices: list[str]) -> list[float]:
    """What lm-eval computes for each choice, here in-process: the context and the context
    plus " choice" are tokenized; the continuation is the tokens past the context's; its
    score is the sum of those tokens' log-probabilities (prompt logprobs of one greedy pass)."""
    tok = engine.tokenizer
    ctx = tok.encode(context, add_special_tokens=False).ids
    scores = []
    for choice in choices:
        whole = tok.encode(context + " " + choice, add_special_tokens=False).ids
        assert whole[: len(ctx)] == ctx, "pick documents whose context tokens are a prefix"
        seq = engine.generate(
            [whole], SamplingParams(prompt_logprobs=0, max_new_tokens=1, temperature=0)
        )[0]
        # prompt_logprobs[j] is the logprob of token j + 1
        scores.append(sum(lp.logprob for lp in seq.prompt_logprobs[len(ctx) - 1 :]))
    return scores


def write_mc_task(
    root: Path, task: str, docs: list[tuple[str, list[str]]], golds: list[int]
) -> None:
    """A local lm-eval multiple-choice task (jsonl + YAML) over `docs` in `root`."""
    data = root / "docs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": g}) + "\n"
            for (q, c), g in zip(docs, golds, strict=True)
        )
    )
    (root / "task.yaml").write_text(
        f"task: {task}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        f"  cache_dir: {root / 'hf-cache'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: question\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )


@pytest.fixture(scope="module")
def artifact(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_artifact(tokenizer_dir, tmp_path_factory.mktemp("lm-eval"))


def test_lm_eval_local_completions_matches_in_process(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    engine = Engine(artifact, engine_config())
    scores = [choice_scores(engine, q, choices) for q, choices in DOCS]
    preds = [max(range(len(s)), key=s.__getitem__) for s in scores]
    golds = [p if i % 2 == 0 else (p + 1) % len(DOCS[i][1]) for i, p in enumerate(preds)]

    write_mc_task(tmp_path, TASK, DOCS, golds)

    s = serve(artifact)  # no keys: lm-eval sends "Bearer " with an empty key
    try:
        args = (
            f"model={MODEL},base_url={s.url}/v1/completions,tokenizer_backend=remote,"
            "tokenized_requests=False,num_concurrent=1,max_retries=1"
        )
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=args,
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        s.stop()

    assert out["results"][TASK]["acc,none"] == pytest.approx(0.5)
    samples = sorted(out["samples"][TASK], key=lambda x: x["doc_id"])
    assert [x["doc_id"] for x in samples] == list(range(len(DOCS)))
    for sample, want, pred in zip(samples, scores, preds, strict=True):
        got = [ll for ll, _ in sample["filtered_resps"]]
        assert got == pytest.approx(want, abs=1e-4)
        assert max(range(len(got)), key=got.__getitem__) == pred
