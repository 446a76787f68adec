"""The runtime engine on tiny random models of every family: logits against transformers,
scheduling paths, streaming, abort and bad input."""

from __future__ import annotations

import json
import math
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main as lite_main
from runtime import EngineConfig, GenerationConfig, pipeline
from runtime.artifact.reader import Artifact, ArtifactError
from runtime.engine.engine import ContextLengthError, Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.cpu import CpuBackend
from tests.conftest import make_llama3_rope_model

FLOAT_ACTIVATIONS = True  # exact math against the reference (conftest.py)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def artifacts(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-art")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        result = CliRunner().invoke(
            lite_main,
            [
                "auto_awq",
                str(tiny_models[family]),
                "--work-dir",
                str(out[family]),
                "--calib-samples",
                "4",
                "--calib-seqlen",
                "64",
                "--w-group-size",
                "32",
                "--quiet",
            ],
        )
        assert result.exit_code == 0, result.output
    return out


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(**kw) -> EngineConfig:
    base = dict(
        kv_quant="none", num_blocks=64, cache_block_seq_len=16, session_len=512, dtype="float32"
    )
    return EngineConfig(**{**base, **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family: str, artifacts: dict[str, Path]) -> None:
    """Every prompt position's log-probabilities against transformers' forward on the same
    dequantized weights. Tolerance 1e-4 absolute in fp32 (measured ~5e-7): a wrong rotary
    convention, norm, bias or GQA mapping moves them by 1e-2 or more."""
    from lite.hf import load_dequantized

    engine = Engine(artifacts[family], _config(max_prefill_token_num=32))  # 3 prefill chunks
    ids = _ids(70, seed=1)
    seq = engine.add_request(
        ids, SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    )
    while not seq.finished:
        engine.step()
    with torch.no_grad():
        ref = load_dequantized(Artifact(artifacts[family]))(input_ids=torch.tensor([ids]))
    ref = torch.log_softmax(ref.logits[0].float(), -1)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in seq.prompt_logprobs])
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    assert seq.output_ids == [int(ref[-1].argmax())]


def test_score_returns_full_distributions(artifacts: dict[str, Path]) -> None:
    """Engine.score: every position's whole next-token distribution, batched and chunked,
    against transformers on the same weights (fp32, 1e-4 absolute on log-probabilities)."""
    from lite.hf import load_dequantized

    engine = Engine(artifacts["mistral"], _config(max_prefill_token_num=24))
    prompts = [_ids(n, seed=n) for n in (2, 37, 61)]
    got = engine.score(prompts)
    model = load_dequantized(Artifact(artifacts["mistral"]))
    for ids, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        assert logits.shape == ref.shape
        err = (logits.log_softmax(-1) - ref.log_softmax(-1)).abs().max()
        assert float(err) < 1e-4, float(err)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.score([[5]])
    # a prompt of the whole session scores: no token is generated after it (it was refused
    # as one over, and lite ppl sized its engine a token larger to get round it)
    full = Engine(artifacts["mistral"], _config(session_len=64, max_prefill_token_num=24))
    assert full.score([_ids(64, seed=8)])[0].shape == (63, 512)


def test_prompt_logprobs_survive_preemption(artifacts: dict[str, Path]) -> None:
    """A pool too small for every prompt at once preempts sequences mid-prompt; the recompute
    must not record their rows twice."""
    prompts = [_ids(45 + 7 * i, seed=30 + i) for i in range(5)]
    params = SamplingParams(temperature=0, max_new_tokens=20, prompt_logprobs=0, ignore_eos=True)
    alone = [Engine(artifacts["llama"], _config()).generate([p], params)[0] for p in prompts]
    tiny = Engine(artifacts["llama"], _config(num_blocks=9, max_prefill_token_num=32))
    got = tiny.generate(prompts, params)
    assert tiny.scheduler.num_preemptions > 0
    for a, b in zip(alone, got, strict=True):
        assert len(b.prompt_logprobs) == b.num_prompt - 1
        x = torch.tensor([lp.logprob for lp in a.prompt_logprobs])
        y = torch.tensor([lp.logprob for lp in b.prompt_logprobs])
        assert torch.allclose(x, y, atol=1e-5)


def test_bf16_activations_stay_close(artifacts: dict[str, Path]) -> None:
    """The CPU default where bf16 is native; bf16 rounding (2^-8) bounds the drift."""
    ids = _ids(50, 6)
    params = SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    ref = Engine(artifacts["qwen3"], _config()).generate([ids], params)[0]
    got = Engine(artifacts["qwen3"], _config(dtype="bfloat16")).generate([ids], params)[0]
    a = torch.tensor([lp.logprob for lp in ref.prompt_logprobs])
    b = torch.tensor([lp.logprob for lp in got.prompt_logprobs])
    assert float((a - b).abs().max()) < 0.05
    assert not torch.equal(a, b)


def _greedy(engine: Engine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return [s.output_ids for s in engine.generate(prompts, params)]


def test_greedy_same_tokens_alone_batched_cached_and_preempted(
    artifacts: dict[str, Path],
) -> None:
    system = _ids(40, seed=99)  # a shared "system prompt" of 2.5 blocks
    prompts = [system + _ids(5 + 3 * i, seed=i) for i in range(8)]
    alone = [_greedy(Engine(artifacts["llama"], _config()), [p])[0] for p in prompts]

    batched = Engine(artifacts["llama"], _config())
    assert _greedy(batched, prompts) == alone

    cached = Engine(artifacts["llama"], _config(enable_prefix_caching=True))
    _greedy(cached, prompts[:1])  # computes and registers the system prompt's full blocks
    assert _greedy(cached, prompts[1:]) == alone[1:]
    assert cached.blocks.prefix_hits >= 7 * 2  # two full shared blocks per later prompt

    tiny = Engine(artifacts["llama"], _config(num_blocks=12))  # 8 prompts need 24+ blocks
    assert _greedy(tiny, prompts) == alone
    assert tiny.scheduler.num_preemptions > 0
    tiny.blocks.check()
    assert tiny.blocks.num_free_blocks == 12


def test_chunked_prefill_keeps_decodes_running(artifacts: dict[str, Path]) -> None:
    engine = Engine(artifacts["llama"], _config(max_prefill_token_num=16))
    short = engine.add_request(
        _ids(4, 1), SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )
    engine.step()  # the short prompt is prefilled and decoding
    long = engine.add_request(
        _ids(100, 2), SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    )
    steps_while_long_prefills = 0
    while long.in_prefill or long.num_computed == 0:
        before = len(short.output_ids)
        engine.step()
        steps_while_long_prefills += 1
        assert len(short.output_ids) == before + 1  # the decode never waited
    assert steps_while_long_prefills >= 6  # 100 tokens under a 16-token budget


def test_the_cpu_backend_caps_the_launch_configs_step_budget_not_the_users(
    artifacts: dict[str, Path],
) -> None:
    """The artifact's launch config (4096 tokens a step, for a GPU) is capped at the CPU
    backend's step_tokens; a budget the user sets is theirs, above the cap too."""
    launch = Artifact(artifacts["llama"]).manifest.launch
    assert launch.max_prefill_tokens > CpuBackend.step_tokens
    default = Engine(artifacts["llama"], _config(backend="cpu"))
    assert default.config.max_prefill_token_num == CpuBackend.step_tokens
    assert default.scheduler.token_budget == CpuBackend.step_tokens
    asked = Engine(artifacts["llama"], _config(backend="cpu", max_prefill_token_num=2048))
    assert asked.scheduler.token_budget == 2048


def test_seeded_sampling_is_independent_of_the_batch(artifacts: dict[str, Path]) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=7, ignore_eos=True)
    prompt = _ids(10, 3)
    alone = Engine(artifacts["qwen2"], _config()).generate([prompt], params)[0].output_ids
    engine = Engine(artifacts["qwen2"], _config())
    others = [
        engine.add_request(_ids(7, s), SamplingParams(temperature=1.0, max_new_tokens=16))
        for s in range(3)
    ]
    seq = engine.add_request(prompt, params)
    while not seq.finished or any(not o.finished for o in others):
        engine.step()
    assert seq.output_ids == alone
    other_seed = (
        Engine(artifacts["qwen2"], _config())
        .generate(
            [prompt],
            SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=8, ignore_eos=True),
        )[0]
        .output_ids
    )
    assert other_seed != alone


@pytest.mark.parametrize("kv_quant", ["int8", "int4"])
def test_quantized_kv_stays_close(kv_quant: str, artifacts: dict[str, Path]) -> None:
    ids = _ids(60, 5)
    params = SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    ref = Engine(artifacts["llama"], _config()).generate([ids], params)[0]
    got = Engine(artifacts["llama"], _config(kv_quant=kv_quant)).generate([ids], params)[0]
    a = torch.tensor([lp.logprob for lp in ref.prompt_logprobs])
    b = torch.tensor([lp.logprob for lp in got.prompt_logprobs])
    assert float((a - b).abs().mean()) < (0.01 if kv_quant == "int8" else 0.1)
    assert not torch.equal(a, b)  # the KV really was quantized


def test_stream_and_abort(artifacts: dict[str, Path]) -> None:
    pipe = pipeline(artifacts["llama"], _config())
    gen = GenerationConfig(max_new_tokens=24, temperature=0, ignore_eos=True)
    full = pipe([_ids(8, 4)], gen)[0]
    chunks = list(pipe.stream(_ids(8, 4), gen))
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].token_ids == full.token_ids

    stream = pipe.stream(_ids(8, 5), gen)
    next(stream)
    next(stream)
    stream.close()  # the client went away
    engine = pipe.engine
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.scheduler.has_work()
    engine.blocks.check()


def test_a_stream_finished_by_other_calls_still_delivers_all_its_text(
    artifacts: dict[str, Path],
) -> None:
    """Every call's step advances every request: a stream read in turn with a longer one, or
    left while a batch call ran, is finished by those steps. It lost the rest of its text and
    never gave its finish reason."""
    pipe = pipeline(artifacts["llama"], _config())
    short = GenerationConfig(max_new_tokens=6, temperature=0, ignore_eos=True)
    long = GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True)
    want_a, want_b = pipe([_ids(8, 4)], short)[0], pipe([_ids(9, 5)], long)[0]
    a, b = pipe.stream(_ids(8, 4), short), pipe.stream(_ids(9, 5), long)
    got: dict[str, list] = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:  # read in turn, one chunk each
        for name, it in list(live.items()):
            chunk = next(it, None)
            if chunk is None:
                del live[name]
            else:
                got[name].append(chunk)
    for chunks, want in ((got["a"], want_a), (got["b"], want_b)):
        assert "".join(c.text for c in chunks) == want.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].token_ids == want.token_ids
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)

    stream = pipe.stream(_ids(8, 4), short)
    first = next(stream)
    pipe([_ids(10, 6)], long)  # its steps finish the stream's request
    rest = list(stream)
    assert first.text + "".join(c.text for c in rest) == want_a.text
    assert rest[-1].finish_reason == "length"


def test_one_pipeline_from_several_threads(artifacts: dict[str, Path]) -> None:
    """Six threads calling one pipeline at once all failed ("sequence 3 has 4 tokens, cannot
    have 6 computed"): the engine's steps are not reentrant. Each now gets what it gets alone."""
    pipe = pipeline(artifacts["llama"], _config())
    gen = GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = [_ids(6 + k, k) for k in range(6)]
    alone = [pipe([p], gen)[0].text for p in prompts]

    def call(k: int) -> str:
        if k % 2:
            return "".join(c.text for c in pipe.stream(prompts[k], gen))
        return pipe([prompts[k]], gen)[0].text

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(call, range(6))) == alone
    engine = pipe.engine
    assert not engine.sequences and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_generation_config_of_another_type_is_refused_by_name(
    artifacts: dict[str, Path],
) -> None:
    pipe = pipeline(artifacts["llama"], _config())
    with pytest.raises(TypeError, match="gen must be a GenerationConfig, not dict"):
        pipe([_ids(4, 1)], {"max_new_tokens": 4})
    with pytest.raises(TypeError, match="gen must be a GenerationConfig, not dict"):
        next(pipe.stream(_ids(4, 1), {"max_new_tokens": 4}))


def test_a_batch_with_a_refused_prompt_leaves_nothing_running(
    artifacts: dict[str, Path],
) -> None:
    """The Python API's batch is all or nothing: the prompts before a refused one (and those
    of a step that raised) are not left in the engine, taking steps and KV blocks on every
    later call for results nobody reads."""
    pipe = pipeline(artifacts["llama"], _config())
    engine = pipe.engine
    gen = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    with pytest.raises(ValueError, match="empty"):
        pipe([_ids(8, 4), _ids(9, 5), []], gen)
    assert not engine.sequences and not engine.has_work()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks

    real, steps = engine.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("a step failed")
        return real()

    engine.step = failing_step
    with pytest.raises(RuntimeError, match="a step failed"):
        pipe([_ids(8, 4), _ids(9, 5)], gen)
    engine.step = real
    assert not engine.sequences and not engine.has_work()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check()
    assert len(pipe([_ids(8, 4)], gen)[0].token_ids) == 20


def test_the_python_api_names_a_wrong_type(artifacts: dict[str, Path]) -> None:
    """Wrong types get a TypeError saying what is expected (they were a comparison of int and
    str deep in the engine, or float ids truncated without a word)."""
    pipe = pipeline(artifacts["llama"], _config())
    gen = GenerationConfig(max_new_tokens=2)
    for bad, message in (
        (5, "not int"),
        ([[1.5, 2.0]], "not list of float"),
        ([[True, 3]], "not list of bool"),
    ):
        with pytest.raises(TypeError, match=message):
            pipe(bad, gen)
    with pytest.raises(
        TypeError, match="not list of str; a batch is a list of prompts, stream.. takes"
    ):
        next(pipe.stream(["Hi"], gen))
    with pytest.raises(TypeError, match="config must be an EngineConfig, not dict"):
        pipeline(artifacts["llama"], {"kv_quant": "int8"})
    for field, value in (("session_len", "4096"), ("num_blocks", 2.5), ("tp_timeout", math.nan)):
        with pytest.raises(ValueError, match=f"{field}=.* is invalid"):
            EngineConfig(**{field: value}).validate()
    for field, value in (("temperature", float("inf")), ("seed", 2**70)):
        with pytest.raises(ValueError, match=field):
            pipe([[1, 2]], GenerationConfig(max_new_tokens=2, **{field: value}))
    assert not pipe.engine.sequences


def test_chat_template_is_used(artifacts: dict[str, Path]) -> None:
    pipe = pipeline(artifacts["llama"], _config())
    ids = pipe.encode([{"role": "user", "content": "hi"}])
    text = pipe.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("assistant\n")
    # a message repeating the template's own text right after it stays text
    (end,) = pipe.engine.tokenizer.encode("<|im_end|>", add_special_tokens=False).ids
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|im_end|>"}]
    ids = pipe.encode(chat)
    first = pipe.engine.tokenizer.decode(ids[: ids.index(end)], skip_special_tokens=False)
    assert ids.count(end) == 2 and first == "<|im_start|>user\nhi"  # the template's, per turn


def test_the_session_stays_within_the_trained_positions(artifacts: dict[str, Path]) -> None:
    """The tiny models have 1024 positions: a longer session_len asked for is refused (100M
    ran the host out of memory building the rotary table), the launch config's 4096 capped."""
    assert Artifact(artifacts["llama"]).manifest.launch.session_len == 4096
    with pytest.raises(
        ValueError, match=r"session_len=1025 is over .* \(1024\).*--session-len 1024"
    ):
        Engine(artifacts["llama"], _config(session_len=1025))
    assert Engine(artifacts["llama"], _config(session_len=None)).config.session_len == 1024


def test_bad_input(artifacts: dict[str, Path], tmp_path: Path) -> None:
    engine = Engine(artifacts["llama"], _config(session_len=64))
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) plus max_new_tokens \(10\)"):
        engine.add_request(_ids(60, 1), SamplingParams(max_new_tokens=10))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.scheduler.has_work()
    small = Engine(artifacts["llama"], _config(num_blocks=2))
    # over the whole pool is over max_model_len too: the server's context_length_exceeded
    with pytest.raises(ContextLengthError, match=r"needs 3 KV blocks .* the pool has 2 \(32 "):
        small.add_request(_ids(40, 1), SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 10**6], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000000\] are outside"):
        engine.add_request([1, 2], SamplingParams(max_new_tokens=2, stop_token_ids=(10**9,)))
    with pytest.raises(ValueError, match="kv_quant='int3' is invalid: expected none or int8"):
        Engine(artifacts["llama"], _config(kv_quant="int3"))
    newer = Path(shutil.copytree(artifacts["llama"], tmp_path / "newer"))
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["schema_version"] += 1
    (newer / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="upgrade liteserve"):
        Engine(newer, _config())
    with pytest.raises(ArtifactError, match="not a liteserve artifact"):
        Engine(tmp_path, _config())


def test_backend_auto_overrides_a_backend_the_artifact_pins(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    """A recipe's serving section can pin a backend into the launch config: left unset it
    applies and a refusal says so; an explicit auto, like any explicit backend, overrides it."""
    pinned = Path(shutil.copytree(artifacts["llama"], tmp_path / "pinned"))
    manifest = json.loads((pinned / "manifest.json").read_text())
    manifest["launch"]["backend"] = "cuda"
    (pinned / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not float32; .* pins backend cuda: --backend"):
        Engine(pinned, _config(device="cpu"))
    assert Engine(pinned, _config(device="cpu", backend="auto")).backend == "cpu"


def test_llama3_rope_scaling_matches_transformers(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Llama-3.1-style frequency scaling, from the config through the manifest to the rotary."""
    from lite.hf import load_dequantized

    make_llama3_rope_model(tokenizer_dir, tmp_path / "m")
    art = tmp_path / "art"
    r = CliRunner().invoke(
        lite_main,
        [
            "auto_awq",
            str(tmp_path / "m"),
            "--work-dir",
            str(art),
            "--calib-samples",
            "0",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    assert Artifact(art).manifest.architecture.rope_scaling["rope_type"] == "llama3"
    ids = _ids(90, seed=3)
    seq = Engine(art, _config()).generate(
        [ids], SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    )[0]
    with torch.no_grad():
        ref = load_dequantized(Artifact(art))(input_ids=torch.tensor([ids])).logits[0]
    want = torch.log_softmax(ref.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in seq.prompt_logprobs])
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_c_kernels_and_torch_path_generate_alike(
    kv_quant: str, artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU backend with its C decode kernels and without (LITESERVE_NATIVE=0): the same
    greedy tokens for a batch of prompts, and logprobs within 1e-4 (fp32; the two differ only
    in summation order)."""
    from runtime.kernels import native

    prompts = [_ids(9 + 5 * i, seed=40 + i) for i in range(5)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("LITESERVE_NATIVE", switch)
        native.library.cache_clear()
        engine = Engine(artifacts["llama"], _config(kv_quant=kv_quant))
        assert ("C kernels, " in engine.ops.detail) == (switch == "1")
        runs.append(engine.generate(prompts, params))
    native.library.cache_clear()
    for c_seq, torch_seq in zip(*runs, strict=True):
        assert c_seq.token_ids == torch_seq.token_ids
        got = torch.tensor([lp.logprob for lp in c_seq.logprobs])
        want = torch.tensor([lp.logprob for lp in torch_seq.logprobs])
        assert len(got) == 12 and torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_warm_up_prefills_longer_than_a_session_as_several_sequences(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiling backend warms up prefills of its row buckets, up to the largest step; one
    longer than session_len (a 512-row bucket at session_len 320 on an H200) must be several
    sequences, since the rotary table holds session_len positions: read past it, a GPU's
    gather asserts and the server never starts. Run here through the CPU backend, where the
    same read raises."""
    engine = Engine(rtn_artifact, _config(session_len=64, num_blocks=8))
    runner = engine.runner
    steps = []
    real = runner.forward
    monkeypatch.setattr(runner, "forward", lambda step, fed=None: steps.append(step) or real(step))
    monkeypatch.setattr(runner.ops, "warmup_tokens", (1, 100, 200, 400))
    runner.warm_up(150, 64)
    assert [len(s.input_ids) for s in steps] == [1, 100, 200, 1, 1]
    assert [s.query_lens for s in steps[:3]] == [[1], [64, 36], [64, 64, 64, 8]]
    assert [s.context_lens for s in steps[3:]] == [[1], [64]]
    for s in steps:
        assert max(s.positions) < 64 and sum(s.query_lens) == len(s.positions)
        assert s.logits_indices == [
            sum(s.query_lens[: i + 1]) - 1 for i in range(len(s.query_lens))
        ]


def test_engine_config_refuses_wrong_types_and_takes_a_torch_device() -> None:
    """torch.device("cpu") failed with an AttributeError; overlap_schedule="no" passed and,
    being truthy, turned overlap on; cache_max_entry_count="0.5" was a bare TypeError."""
    config = EngineConfig(device=torch.device("cpu"))
    config.validate()
    assert config.device == "cpu"
    for field, value, expected in (
        ("overlap_schedule", "no", "True, False or None"),
        ("enable_prefix_caching", 1, "a bool"),
        ("enforce_eager", None, "a bool"),
        ("verify_checksums", "false", "a bool"),
        ("cache_max_entry_count", "0.5", "a number"),
        ("cache_max_entry_count", True, "a number"),
        ("tp_timeout", "60", "a number"),
        ("device", 0, "auto, cpu, cuda or cuda:N"),
        ("device", torch.device("mps"), "auto, cpu, cuda or cuda:N"),
    ):
        with pytest.raises(ValueError, match=f"^{field}=.* is invalid: expected {expected}$"):
            EngineConfig(**{field: value}).validate()


def test_a_block_never_holds_more_than_one_session(rtn_artifact: Path) -> None:
    """Checked once the launch config fills in the session (4096, capped to the tiny model's
    1024 positions); a short session may keep the default block of 64."""
    with pytest.raises(ValueError, match=r"larger than session_len=1024: .*choose at most 1024$"):
        Engine(rtn_artifact, EngineConfig(cache_block_seq_len=1040, num_blocks=4))
    with pytest.raises(ValueError, match=r"cache_block_seq_len=128 .* choose at most 112$"):
        EngineConfig(session_len=100, cache_block_seq_len=128).validate()
    EngineConfig(session_len=41, cache_block_seq_len=64).validate()  # lite eval's windows


def test_an_explicit_pool_must_fit_the_memory_available(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """num_blocks past the memory was a traceback from torch's allocator (384 GB tried)."""
    from runtime.engine import engine as engine_module

    config = _config(session_len=64, num_blocks=11)
    per_block = 2 * 2 * 16 * 2 * 4 * 16  # layers x kv heads x dims x (K, V) x fp32 x tokens
    monkeypatch.setattr(engine_module.host_memory, "available_bytes", lambda: 10 * per_block + 1)
    with pytest.raises(
        ValueError,
        match=rf"^num_blocks=11 needs {11 * per_block:,} bytes .* but {10 * per_block + 1:,} "
        r"bytes .* are available; choose at most num_blocks=10$",
    ):
        Engine(rtn_artifact, config)
    assert Engine(rtn_artifact, replace(config, num_blocks=10)).cache.num_blocks == 10


@pytest.mark.parametrize(
    "family, biases",
    [("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"attention_bias": True})],
)
def test_output_and_mlp_biases_match_transformers(
    family: str, biases: dict, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Llama's attention_bias (o_proj's too) and mlp_bias, Qwen3's attention_bias: kept
    through the manifest into the reference model (transformers built from the artifact, as
    `lite export` builds its config.json) and added by the engine."""
    from lite.hf import load_dequantized
    from tests.conftest import make_tiny_model

    src = make_tiny_model(family, tmp_path / "m", tokenizer_dir, **biases)
    art = tmp_path / "art"
    args = ["auto_awq", str(src), "--work-dir", str(art), "--calib-samples", "0", "--quiet"]
    r = CliRunner().invoke(lite_main, args)
    assert r.exit_code == 0, r.output
    arch = Artifact(art).manifest.architecture
    assert arch.attention_bias and arch.mlp_bias == biases.get("mlp_bias", False)
    model = load_dequantized(Artifact(art))
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert (model.model.layers[0].mlp.down_proj.bias is not None) == arch.mlp_bias
    ids = _ids(40, seed=5)
    seq = Engine(art, _config()).generate(
        [ids], SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    )[0]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    want = torch.log_softmax(ref.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in seq.prompt_logprobs])
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
