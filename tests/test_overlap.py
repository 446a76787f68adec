"""Overlapped scheduling (runtime.engine.overlap) on the CPU: the same results as step-by-step
scheduling whatever a batch holds, the next step really queued before the previous one's ids
are read, and no row computed for a sequence known to be finished.

On the CPU the device runs synchronously, so overlap gains nothing here (it is off by default
there); these tests check its bookkeeping, which is the same on a GPU.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from runtime import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.overlap import PendingStep
from runtime.engine.sampler import SamplingParams
from runtime.engine.sequence import Sequence

FLOAT_ACTIVATIONS = True  # exact math: tokens compare exactly (conftest.py)


def _config(**kw) -> EngineConfig:
    base = dict(
        kv_quant="int8", num_blocks=64, cache_block_seq_len=16, session_len=256, dtype="float32"
    )
    return EngineConfig(**{**base, **kw})


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(stop_token: int | None) -> list[tuple[list[int], SamplingParams]]:
    """Every kind of row: greedy and seeded draws, top-p/top-k, logprobs, prompt logprobs, a
    stop token, penalties and a grammar (the rows that are not overlapped), under a shared
    prefix and mixed lengths."""
    system = _ids(36, 99)
    kinds = [
        dict(temperature=0),
        dict(temperature=0.9, top_p=0.8, seed=3),
        dict(temperature=1.0, top_k=20, seed=4, logprobs=3),
        dict(temperature=0, prompt_logprobs=2),
        dict(temperature=0, stop_token_ids=() if stop_token is None else (stop_token,)),
        dict(temperature=0, repetition_penalty=1.3),
        dict(temperature=0.8, seed=5, frequency_penalty=0.5),
        dict(temperature=0, json_schema=json.dumps({"type": "object"})),
        dict(temperature=0.7, seed=6, min_p=0.1, stop=["a"]),
    ]
    return [
        (
            system + _ids(3 + 5 * i, i),
            SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True, **kind),
        )
        for i, kind in enumerate(kinds)
    ]


def _run(engine: Engine, requests, arrive_every: int = 2) -> list[Sequence]:
    """Requests arriving two steps apart, so admissions land beside running decodes."""
    seqs: list[Sequence] = []
    pending = list(requests)
    while pending or any(not s.finished for s in seqs):
        if pending:
            seqs.append(engine.add_request(*pending.pop(0)))
        for _ in range(arrive_every):
            engine.step()
    while engine.has_work():
        engine.step()
    return seqs


def _outcome(seq: Sequence) -> tuple[tuple, list[float]]:
    """What must be identical (ids, text, why it finished, which alternatives), and the
    logprobs: a sequence recomputed after a preemption, at another step under overlap, gets
    them from a prefill instead of a decode, equal to fp32 reduction order."""
    lps = seq.logprobs + seq.prompt_logprobs
    ids = [(lp.token_id, [t for t, _ in lp.top]) for lp in lps]
    values = [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]
    return (seq.output_ids, seq.text, seq.finish_reason, ids), values


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def _assert_idle(engine: Engine) -> None:
    engine.blocks.check()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_work()


@pytest.mark.parametrize(
    "extra",
    [{}, {"enable_prefix_caching": True}, {"num_blocks": 14}, {"max_prefill_token_num": 16}],
    ids=["plain", "prefix-cache", "preempting", "chunked"],
)
def test_overlapped_steps_give_the_same_results(rtn_artifact: Path, extra: dict) -> None:
    sync = Engine(rtn_artifact, _config(overlap_schedule=False, **extra))
    prompt, params = _requests(None)[4]
    stop_token = sync.generate([prompt], params)[0].output_ids[3]  # it finishes that request
    want = [_outcome(s) for s in _run(sync, _requests(stop_token))]
    assert any(o[0][2] == "stop" for o in want)
    _assert_idle(sync)

    engine = Engine(rtn_artifact, _config(overlap_schedule=True, **extra))
    assert engine.overlap
    got = [_outcome(s) for s in _run(engine, _requests(stop_token))]
    _assert_same(got, want)
    _assert_idle(engine)
    if "num_blocks" in extra:
        assert engine.scheduler.num_preemptions > 0


def _trace(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """'run' for each model step queued, 'read' for each read of a step's ids."""
    events: list[str] = []
    run, read = engine.runner.run, PendingStep.read

    def traced_run(*a, **k):
        events.append("run")
        return run(*a, **k)

    def traced_read(self):
        events.append("read")
        return read(self)

    monkeypatch.setattr(engine.runner, "run", traced_run)
    monkeypatch.setattr(PendingStep, "read", traced_read)
    return events


def test_the_next_step_is_queued_before_the_ids_are_read(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(rtn_artifact, _config(overlap_schedule=True))
    events = _trace(engine, monkeypatch)
    n = 5
    plain = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    engine.generate([_ids(9, 1)], plain)
    # the prefill, then n - 1 decodes, each queued before the previous step's ids are read;
    # the step that samples the n-th token is the last: nothing runs after it
    assert events == ["run", "run", "read"] + ["run", "read"] * (n - 2) + ["read"]

    events.clear()
    penalized = SamplingParams(
        temperature=0, max_new_tokens=n, ignore_eos=True, repetition_penalty=1.2
    )
    engine.generate([_ids(9, 1)], penalized)  # its next step counts each id: read first
    assert events == ["run", "read"] * n
    _assert_idle(engine)


def test_a_sequence_that_stops_costs_one_dropped_row(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop token is seen one step late: the step queued meanwhile computes one row for it,
    which is dropped; its output, the pool and the others are untouched."""
    prompt = _ids(9, 2)
    free = SamplingParams(temperature=1.0, seed=1, max_new_tokens=8, ignore_eos=True)
    out = Engine(rtn_artifact, _config()).generate([prompt], free)[0].output_ids
    k = next(i for i in range(2, 8) if out[i] not in out[:i])  # a new token after two
    stop = replace(free, ignore_eos=False, stop_token_ids=(out[k],))
    engine = Engine(rtn_artifact, _config(overlap_schedule=True))
    events = _trace(engine, monkeypatch)
    seq = engine.generate([prompt], stop)[0]
    assert seq.output_ids == out[: k + 1] and seq.finish_reason == "stop"
    assert events.count("run") == k + 2  # the prefill, k decodes and the dropped row
    while engine.has_work():
        engine.step()
    _assert_idle(engine)


def test_abort_while_a_step_is_queued(rtn_artifact: Path) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [_ids(7, 3), _ids(11, 4)]
    want = Engine(rtn_artifact, _config(overlap_schedule=False)).generate([prompts[1]], params)
    engine = Engine(rtn_artifact, _config(overlap_schedule=True))
    gone, kept = (engine.add_request(p, params) for p in prompts)
    for _ in range(4):
        engine.step()
    assert engine._pending is not None and gone in engine._pending.sampled
    engine.abort(gone.seq_id)
    while not kept.finished:
        engine.step()
    assert gone.finish_reason == "abort" and len(gone.output_ids) == 3
    assert kept.output_ids == want[0].output_ids
    while engine.has_work():
        engine.step()
    _assert_idle(engine)


def test_overlap_is_off_on_the_cpu_and_refused_with_tensor_parallelism(
    rtn_artifact: Path,
) -> None:
    assert not Engine(rtn_artifact, _config()).overlap
    with pytest.raises(ValueError, match="overlap_schedule is not supported with tp > 1"):
        _config(tp=2, overlap_schedule=True).validate()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_triton_decode_takes_ids_from_the_device(rtn_artifact: Path, eager: bool) -> None:
    """The triton backend (interpreted): decode steps from the static graph buffers, or
    eager, with their ids fed from the previous step's tensor, in a batch whose order changes
    as requests join."""
    config = _config(backend="triton", dtype="float16", enforce_eager=eager, kv_quant="none")
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    requests = [(_ids(5 + 7 * i, 10 + i), params) for i in range(3)]
    want = [s.output_ids for s in _run(Engine(rtn_artifact, config), requests, 1)]
    engine = Engine(rtn_artifact, replace(config, overlap_schedule=True))
    assert [s.output_ids for s in _run(engine, requests, 1)] == want
    _assert_idle(engine)


def test_server_streams_with_overlap(rtn_artifact: Path) -> None:
    """A real server with overlap on: concurrent streams through the official client, each
    the text of step-by-step generation, one of them cut by a stop string, one aborted."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from runtime import GenerationConfig, pipeline
    from tests.test_server import serve

    prompts = ["def f(x):", "The quick brown fox", "1, 2, 3,", "Hello"]
    gen = GenerationConfig(max_new_tokens=12, temperature=0, ignore_eos=True)
    want = [r.text for r in pipeline(rtn_artifact, _config())(prompts, gen)]
    stop = want[2][len(want[2]) // 2 :][:2]  # a stop string inside the third text
    served = serve(rtn_artifact, config=_config(overlap_schedule=True))
    try:
        assert served.engine.overlap
        client = OpenAI(base_url=served.url + "/v1", api_key="none")

        def stream(i: int) -> str:
            chunks = client.completions.create(
                model="tiny",
                prompt=prompts[i],
                max_tokens=12,
                temperature=0,
                stream=True,
                stop=[stop] if i == 2 else None,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(stream, range(4)))
        assert got[:2] + got[3:] == want[:2] + want[3:]
        assert got[2] == want[2][: want[2].index(stop)]
        dropped = client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=40, stream=True
        )
        next(iter(dropped))
        dropped.close()  # the client goes away mid-stream: the request is aborted
        deadline = time.monotonic() + 30
        while served.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        _assert_idle(served.engine)
    finally:
        served.stop()
