"""Tensor parallelism on the CPU: two real rank processes over gloo against one process.

The tiny models have head_dim 64 (so a rank's heads start on the layout's 64-column unit) and
intermediate 256 (two 128-channel halves); one has a single KV head, which both ranks then
replicate. Everything else about them is the shared tiny random model.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from click.testing import CliRunner

import runtime
from lite.cli import main as lite_main
from runtime import EngineConfig
from runtime.artifact.manifest import Architecture
from runtime.artifact.reader import Artifact
from runtime.cli import main as runtime_main
from runtime.distributed.group import RankFailure
from runtime.distributed.shard import plan_shards, split
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.cpu import CpuBackend
from runtime.model.llama import LlamaModel
from tests.conftest import make_tiny_model, wait_healthy

FLOAT_ACTIVATIONS = True  # exact math against the reference (conftest.py)


@pytest.fixture(autouse=True)
def _group_closed() -> None:
    """Every test leaves this process out of any process group: one engine per process."""
    yield
    assert not torch.distributed.is_initialized(), "a test left its process group open"


CASES = {  # name: (family, KV heads)
    "llama": ("llama", 2),
    "mistral": ("mistral", 2),
    "qwen2": ("qwen2", 2),
    "qwen3": ("qwen3", 2),
    "llama-1kv": ("llama", 1),  # fewer KV heads than ranks: replicated
}


@pytest.fixture(scope="module")
def artifacts(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for name, (family, kv_heads) in CASES.items():
        hf = make_tiny_model(
            family, root / f"hf-{name}", tokenizer_dir, head_dim=64, kv_heads=kv_heads,
            intermediate=256,
        )  # fmt: skip
        out[name] = root / name
        args = ["auto_awq", str(hf), "--work-dir", str(out[name]), "--calib-samples", "0"]
        result = CliRunner().invoke(lite_main, [*args, "--w-group-size", "32", "--quiet"])
        assert result.exit_code == 0, result.output
    return out


def _config(tp: int, **kw) -> EngineConfig:
    base = dict(
        kv_quant="none",
        num_blocks=64,
        cache_block_seq_len=16,
        session_len=256,
        dtype="float32",
        max_prefill_token_num=32,  # the long prompt prefills in chunks, beside decodes
        tp=tp,
        tp_timeout=20.0,
    )
    return EngineConfig(**{**base, **kw})


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(art: Path, tp: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of three prompts batched together, and the full logits of two."""
    engine = Engine(art, _config(tp))
    try:
        prompts = [_ids(70, 1), _ids(5, 2), _ids(23, 3)]
        greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        tokens = [s.output_ids for s in engine.generate(prompts, greedy)]
        return tokens, engine.score(prompts[::2])
    finally:
        engine.close()


@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_tp1(case: str, artifacts: dict[str, Path]) -> None:
    """Same greedy tokens, and log-probabilities of every prompt position within 1e-4.

    The ranks' partial sums of o and down are added by the all-reduce instead of inside one
    GEMM: only the fp32 summation order changes, about 1e-7 relative per sum (measured max
    difference of the log-probabilities ~1e-6). A wrong head, KV or vocabulary slice, a bias
    added twice or a missing all-reduce moves them by 1e-2 or more."""
    tokens1, logits1 = _run(artifacts[case], 1)
    tokens2, logits2 = _run(artifacts[case], 2)
    assert tokens2 == tokens1
    for a, b in zip(logits1, logits2, strict=True):
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        assert la.shape == lb.shape == (a.shape[0], 512)
        assert torch.allclose(la, lb, atol=1e-4, rtol=0), (la - lb).abs().max()


def test_each_rank_reads_and_holds_about_half(
    artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's model, built as a worker builds it, reads from the artifact exactly the
    bytes `runtime plan --tp` counts for it, and holds about half the weights: measured as
    the bytes of every weight tensor the rank's model keeps (in the CPU backend's forms)."""
    art = Artifact(artifacts["llama"])
    reads: list[int] = []
    read = Artifact.tensor

    def counting(self, name, rows=None, cols=None):
        t = read(self, name, rows, cols)
        reads.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(Artifact, "tensor", counting)
    ops = CpuBackend()
    whole = LlamaModel(art, torch.float32, 256, ops)
    whole_read, reads[:] = sum(reads), []
    shards = plan_shards(art.manifest.architecture, 32, 2)
    held = []
    for shard in shards:
        held.append(LlamaModel(art, torch.float32, 256, ops, shard).weight_bytes())
        assert sum(reads) == shard.stored_bytes(art)
        assert 0.4 < sum(reads) / whole_read < 0.6
        reads[:] = []
    print(f"weight bytes: tp1 {whole.weight_bytes()}, tp2 ranks {held}")
    for h in held:
        assert 0.4 < h / whole.weight_bytes() < 0.6


def test_engine_rank0_holds_its_shard(artifacts: dict[str, Path]) -> None:
    """The running TP engine's own model is rank 0's slice (its pool: its KV heads)."""
    engine = Engine(artifacts["qwen3"], _config(2))
    try:
        single = LlamaModel(Artifact(artifacts["qwen3"]), torch.float32, 256, CpuBackend())
        assert 0.4 < engine.model.weight_bytes() / single.weight_bytes() < 0.6
        assert engine.kv_spec.num_kv_heads == 1
    finally:
        engine.close()
    assert all(p.exitcode == 0 for p in engine.workers.procs)


def _worker_pid(parent: int) -> int:
    (child,) = [p for p in psutil.Process(parent).children() if "spawn" in " ".join(p.cmdline())]
    return child.pid


def test_killed_rank_fails_the_engine_within_the_timeout(artifacts: dict[str, Path]) -> None:
    """SIGKILL to rank 1 while generation runs (at a random moment, maybe mid-collective):
    the next step, or the one running, raises RankFailure naming the rank, well within the
    collective timeout; every later step raises it at once; close does not hang."""
    engine = Engine(artifacts["llama"], _config(2, tp_timeout=30.0))
    try:
        pid = _worker_pid(os.getpid())
        engine.add_request(_ids(60, 4), SamplingParams(temperature=0, max_new_tokens=150))
        engine.step()
        delay = float(torch.rand(()) * 0.2)
        threading.Timer(delay, os.kill, (pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 .* was killed by SIGKILL"):
            while engine.has_work():
                engine.step()
        assert time.monotonic() - start < 15  # at once, in fact; the timeout is 30 s
        with pytest.raises(RankFailure, match="rank 1"):
            engine.step()
    finally:
        engine.close()


def test_interrupted_mid_step_the_workers_are_stopped_not_waited_for(
    artifacts: dict[str, Path],
) -> None:
    """Ctrl-C on rank 0 while a step runs: the workers wait in that step's collectives, and
    the stop message waited out the collective timeout (60 s by default) before `runtime
    generate --tp 2` could exit. The engine is failed after it, and close kills the workers
    at once (a join of 60 s here is a hang; the timeout is 600 s)."""
    engine = Engine(artifacts["llama"], _config(2, tp_timeout=600.0))
    pid = _worker_pid(os.getpid())
    try:
        engine.add_request(_ids(20, 6), SamplingParams(temperature=0, max_new_tokens=50))
        engine.step()

        def interrupted() -> None:
            raise KeyboardInterrupt

        engine.runner.model = interrupted  # after the step went to the workers
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        with pytest.raises(RankFailure, match="rank 0 left a step unfinished"):
            engine.step()
    finally:
        closing = threading.Thread(target=engine.close)
        closing.start()
        closing.join(60)
    assert not closing.is_alive()
    assert psutil.pid_exists(pid) is False or psutil.Process(pid).status() == "zombie"


def test_stuck_rank_times_out(artifacts: dict[str, Path]) -> None:
    """A rank that is alive but stuck (SIGSTOP) is not seen by the health check: the
    collective timeout ends the step with an error instead of a hang."""
    engine = Engine(artifacts["llama"], _config(2, tp_timeout=2.0))
    pid = _worker_pid(os.getpid())
    try:
        engine.add_request(_ids(20, 5), SamplingParams(temperature=0, max_new_tokens=50))
        engine.step()
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 0: the .* failed"):
            while engine.has_work():
                engine.step()
        assert 2.0 <= time.monotonic() - start < 20  # the timeout, then 2 s for a death
    finally:
        engine.close()  # kills the stopped worker
    assert psutil.pid_exists(pid) is False or psutil.Process(pid).status() == "zombie"


def test_serve_stops_when_a_rank_dies(artifacts: dict[str, Path]) -> None:
    """`runtime serve --tp 2` answers; after its worker is killed the server exits with an
    error that names the rank, within moments (the health check sees the process end)."""
    import httpx2

    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "runtime", "serve", str(artifacts["qwen2"]), "--tp", "2"]
    args = ["--server-port", str(port), "--num-blocks", "64", "--dtype", "float32"]
    proc = subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=60)
        body = {"model": "qwen2", "prompt": "def f():", "max_tokens": 4, "temperature": 0}
        r = httpx2.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.kill(_worker_pid(proc.pid), signal.SIGKILL)
        code = proc.wait(timeout=15)
        out = proc.stdout.read().decode()
        assert code != 0 and "rank 1" in out and "SIGKILL" in out, out
    finally:
        proc.kill()


def test_a_dead_rank_fails_health_before_any_request(artifacts: dict[str, Path]) -> None:
    """A rank killed while the server is idle: `/health` is 503 naming it at once, and a Ray
    Serve replica's health check raises, so Ray replaces it. Before, both said ok until a
    request's step found the rank gone, and Ray kept the replica, every request a 500."""
    import httpx2

    from runtime.server.cluster import EngineReplica
    from tests.test_server import serve

    served = serve(artifacts["llama"], config=_config(2))
    try:
        assert httpx2.get(served.url + "/health").status_code == 200
        replica = object.__new__(EngineReplica)  # its Ray-free part: the check on its engine
        replica.state, replica.replica = served.state, "r1"
        replica.check_health()
        os.kill(_worker_pid(os.getpid()), signal.SIGKILL)
        deadline = time.monotonic() + 15
        while served.engine.workers.failure is None:  # the monitor sees the process end
            assert time.monotonic() < deadline, "the dead rank was not noticed"
            time.sleep(0.05)
        r = httpx2.get(served.url + "/health")
        assert r.status_code == 503, r.text
        assert "rank 1" in r.json()["error"]["message"] and "SIGKILL" in r.text
        with pytest.raises(RuntimeError, match="replica r1: tensor-parallel rank 1 .*SIGKILL"):
            replica.check_health()
    finally:
        served.stop()
        served.engine.close()  # the CLI's part after the server: the ranks and their group


def test_cli_generate_tp2_matches_tp1(artifacts: dict[str, Path]) -> None:
    args = ["generate", str(artifacts["mistral"]), "--prompt", "import os", "--raw"]
    args += ["--max-new-tokens", "8", "--temperature", "0", "--dtype", "float32"]
    one = CliRunner().invoke(runtime_main, args)
    two = CliRunner().invoke(runtime_main, [*args, "--tp", "2"])
    assert one.exit_code == two.exit_code == 0, (one.output, two.output)
    assert two.output == one.output


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(
    artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tp 2 from cuda:0 on a host with one GPU (simulated: the check only counts devices):
    a message naming the GPUs the ranks need and the fix, and no process started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    children = psutil.Process().children()
    with pytest.raises(
        ValueError, match=r"--tp 2 runs one rank per GPU, cuda:0 to cuda:1: .*1 GPU"
    ):
        Engine(artifacts["llama"], _config(2, backend="triton", device="cuda:0", dtype="float16"))
    assert psutil.Process().children() == children


def test_tp_on_a_gpu_without_one_is_refused_not_run_on_the_cpu(
    artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tp 2 --device cuda on a host with no GPU once fell back to the CPU in silence; only
    --device auto may."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    children = psutil.Process().children()
    with pytest.raises(ValueError, match=r"--tp 2 runs one rank per GPU.*needs a CUDA GPU"):
        Engine(artifacts["llama"], _config(2, device="cuda"))
    assert psutil.Process().children() == children


def test_plan_per_rank(artifacts: dict[str, Path]) -> None:
    """Per-rank weights and KV heads; the pool fits more tokens than on one rank of the same
    memory, as each rank holds half the KV heads."""
    art = artifacts["llama"]
    out = {}
    for tp in (1, 2):
        r = CliRunner().invoke(
            runtime_main, ["plan", str(art), "--memory", "64MiB", "--tp", str(tp)]
        )
        assert r.exit_code == 0, r.output
        out[tp] = r.output
    assert "rank 0:" in out[2] and "rank 1:" in out[2] and "for 1 KV heads" in out[2]

    def tokens(text: str) -> int:
        (line,) = [x for x in text.splitlines() if x.startswith("none ")]
        return int(line.split()[4].replace(",", ""))

    assert tokens(out[2]) > 1.9 * tokens(out[1])


def test_shards_of_real_shapes(artifacts: dict[str, Path]) -> None:
    """SmolLM2 (9 heads over 3 KV heads, group 128): whole GQA groups, 2 + 1, at 384
    columns (a multiple of 64 and 128); the Llama-3-8B shape: even halves; a single KV head
    over 4 ranks: replicated; and a split the layout cannot make is refused by name."""
    base = Artifact(artifacts["llama"]).manifest.architecture

    def shape(**kw) -> Architecture:
        return base.model_copy(update=kw)

    smol = shape(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152)
    s0, s1 = plan_shards(smol, 128, 2)
    assert (s0.heads, s0.kv_heads, s1.heads, s1.kv_heads) == ((0, 6), (0, 2), (6, 9), (2, 3))
    assert (s0.intermediate, s1.intermediate) == ((0, 768), (768, 1536))
    assert (s0.vocab, s1.vocab, s0.vocab_rows) == ((0, 24576), (24576, 49152), 24576)
    llama8b = shape(num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    s0, s1 = plan_shards(llama8b, 128, 2)
    assert (s0.heads, s1.heads, s0.kv_heads, s1.intermediate) == (
        (0, 16),
        (16, 32),
        (0, 4),
        (7168, 14336),
    )
    mqa = shape(num_heads=32, num_kv_heads=1, head_dim=128, intermediate_size=14336)
    shards = plan_shards(mqa, 128, 4)
    assert [s.heads for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert all(s.kv_heads == (0, 1) for s in shards)
    with pytest.raises(ValueError, match="3 KV heads cannot be shared evenly by 4 ranks"):
        plan_shards(smol, 128, 4)
    with pytest.raises(ValueError, match="intermediate 1536"):
        plan_shards(
            shape(num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=1536), 128, 16
        )


@pytest.mark.parametrize("seed", range(5))
def test_split_covers_in_units(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    unit = int(torch.randint(1, 200, (1,), generator=g))
    size = int(torch.randint(1, 9, (1,), generator=g))
    total = int(torch.randint(size * unit - unit + 1, 50 * unit, (1,), generator=g))
    spans = split(total, unit, size)
    assert spans[0][0] == 0 and spans[-1][1] == total and len(spans) == size
    for (a, b), (c, _) in zip(spans, spans[1:], strict=False):
        assert b == c and a % unit == 0 and b > a
    widths = [b - a for a, b in spans[:-1]]
    assert max(widths, default=0) - min(widths, default=0) <= unit
    with pytest.raises(ValueError):
        split(unit * (size - 1), unit, size)


@pytest.fixture(scope="module")
def smollm2_rtn(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 at group size 128: its 9 heads over 3 KV heads split 6 + 3 (whole GQA groups,
    cut at 384 columns, a multiple of 64 and of 128)."""
    out = tmp_path_factory.mktemp("tp-smollm2") / "rtn"
    args = ["auto_awq", str(smollm2), "--work-dir", str(out), "--calib-samples", "0", "--quiet"]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_smollm2_tp2_matches_tp1(smollm2_rtn: Path) -> None:
    """The real model in fp32: the same greedy tokens and prompt logprobs within 1e-3 (30
    layers of reordered fp32 sums; measured max 6e-5). In bf16 the ranks' partial sums round
    differently, by about as much as bf16 itself differs from fp32 (measured: mean worst
    per-position logprob error against fp32 0.32 with TP, 0.31 without), so long greedy runs
    may part ways there: this check is an fp32 one."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, prompt_logprobs=1)
    out = {}
    for tp in (1, 2):
        engine = Engine(smollm2_rtn, _config(tp, session_len=128))
        try:
            ids = [engine.tokenizer.encode(p).ids for p in prompts]
            out[tp] = engine.generate(ids, params)
        finally:
            engine.close()
    for one, two in zip(out[1], out[2], strict=True):
        assert two.output_ids == one.output_ids
        assert len(one.prompt_logprobs) == len(two.prompt_logprobs) > 3
        for a, b in zip(one.prompt_logprobs, two.prompt_logprobs, strict=True):
            if a is None:  # the first token: nothing predicts it
                assert b is None
                continue
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-3
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_script_without_a_main_guard_is_told_to_add_one(
    artifacts: dict[str, Path], tmp_path: Path
) -> None:
    """Workers are spawned and import the script: without the guard each runs it again and
    dies in multiprocessing's bootstrapping check, and all the user saw was "rank 1 exited
    with 1 while starting"."""
    script = tmp_path / "unguarded.py"
    art = next(iter(artifacts.values()))
    script.write_text(
        "from runtime import EngineConfig, pipeline\n"
        f"pipe = pipeline({str(art)!r}, EngineConfig(tp=2, dtype='float32', num_blocks=16,"
        " cache_block_seq_len=16, session_len=64, tp_timeout=20.0))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode != 0
    assert "while starting" in done.stderr
    # the engine's own error names the guard (Python's note is in the worker's traceback only)
    assert "needs its code under `if __name__ == '__main__':`" in done.stderr


def test_a_worker_killed_while_starting_is_one_line(
    artifacts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed while loading (the OOM killer, say) ended `runtime generate --tp 2` in
    a traceback, whose text sent the user to an error above (there was none) and to a
    `__main__` guard (the CLI has one)."""
    import multiprocessing as mp

    from runtime.distributed import worker

    proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,), name="liteserve-tp1")
    proc.start()
    proc.kill()
    proc.join()
    with pytest.raises(RankFailure) as e:
        worker._await_joins(torch.distributed.HashStore(), [proc])
    assert (
        str(e.value)
        == f"tensor-parallel rank 1 (pid {proc.pid}) was killed by SIGKILL while starting"
    )

    def dies(*_args, **_kw):
        raise RankFailure(str(e.value))

    monkeypatch.setattr(runtime, "pipeline", dies)
    args = ["generate", str(artifacts["llama"]), "--prompt", "x", "--tp", "2"]
    r = CliRunner().invoke(runtime_main, args)
    assert r.exit_code == 1 and r.output == f"Error: {e.value}\n", r.output
