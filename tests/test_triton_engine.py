"""The engine on the triton backend against the CPU backend, its decode steps from the static
padded buffers against eager steps, and `lite tune` pinning GEMM configs that the backend then
uses. Kernels run compiled on a GPU and interpreted on the CPU (conftest); the engine's device is
its backend's choice (the current GPU, or the CPU under the interpreter)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main
from runtime.artifact.reader import Artifact
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.overlap import FeedRows
from runtime.engine.sampler import SamplingParams, TokenLogprobs
from runtime.kernels.ops import BackendError, StepInputs, select_backend
from tests.conftest import GPU

FLOAT_ACTIVATIONS = True  # exact math against the reference (conftest.py)


def engine_config(backend: str, **kw) -> EngineConfig:
    """A small pool and a 32-token prefill budget: prompts of mixed_prompts() prefill in
    chunks while others decode."""
    base = dict(
        kv_quant="none",
        num_blocks=24,
        cache_block_seq_len=16,
        session_len=256,
        dtype="float16",
        backend=backend,
        max_prefill_token_num=32,
    )
    return EngineConfig(**{**base, **kw})


def arch_key(device: torch.device) -> str:
    """The key pinned configs live under: the GPU's compute capability, or the interpreter's."""
    if device.type == "cpu":
        return "interpreter"
    return "sm_{}{}".format(*torch.cuda.get_device_capability(device))


def mixed_prompts() -> list[list[int]]:
    """Three prompts of 5, 21 and 40 tokens."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 21, 40)]


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_triton_backend_matches_cpu(rtn_artifact: Path, kv_quant: str) -> None:
    """Same greedy tokens, and prompt log-probabilities within fp16 rounding (0.02 absolute),
    for chunked prefill, batched decode and every KV policy."""
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, prompt_logprobs=0)
    got = {}
    for backend in ("cpu", "triton"):
        engine = Engine(rtn_artifact, engine_config(backend, kv_quant=kv_quant))
        assert engine.backend == backend
        got[backend] = engine.generate(mixed_prompts(), params)
    for a, b in zip(got["cpu"], got["triton"], strict=True):
        assert a.output_ids == b.output_ids
        x = torch.tensor([lp.logprob for lp in a.prompt_logprobs])
        y = torch.tensor([lp.logprob for lp in b.prompt_logprobs])
        assert float((x - y).abs().max()) < 0.02


def test_triton_prefill_runs_dequantized(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 150-token prompt prefilled in one step (row bucket 256): the linears run the weights
    dequantized plus torch's matmul; the same greedy tokens and prompt logprobs within fp16
    rounding as the CPU backend."""
    from runtime.kernels.triton import gemm

    calls = []
    real = gemm.w4a16_dequantize
    monkeypatch.setattr(gemm, "w4a16_dequantize", lambda *a: calls.append(a[2:4]) or real(*a))
    prompt = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, prompt_logprobs=0)
    got = {}
    for backend in ("cpu", "triton"):
        engine = Engine(rtn_artifact, engine_config(backend, max_prefill_token_num=160))
        calls.clear()  # on a GPU the start-up's warm-up prefills 256 rows too
        got[backend] = engine.generate([prompt], params)[0]
    assert len(calls) == 4 * engine.arch.num_layers, calls  # qkv, o, gate/up, down
    assert got["cpu"].output_ids == got["triton"].output_ids
    x = torch.tensor([lp.logprob for lp in got["cpu"].prompt_logprobs])
    y = torch.tensor([lp.logprob for lp in got["triton"].prompt_logprobs])
    assert float((x - y).abs().max()) < 0.02


Outputs = list[tuple[list[int], list[TokenLogprobs]]]


def staggered_run(engine: Engine) -> Outputs:
    """Greedy tokens and logprobs (top 2) of mixed_prompts(), asking for 10, 7 and 4 tokens:
    the 40-token prompt prefills while the others decode, then all three decode (a bucket of
    4, one row padded) until they finish one by one (batches of 2, then 1)."""
    seqs = [
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, logprobs=2)
        )
        for prompt, n in zip(mixed_prompts(), (10, 7, 4), strict=True)
    ]
    while engine.has_work():
        engine.step()
    return [(seq.output_ids, seq.logprobs) for seq in seqs]


def test_int32_tensor_of_step_metadata() -> None:
    """The step buffers' list-to-tensor conversion: exact int32 values, slot -1 included, and
    an empty list."""
    from runtime.kernels.gpu import int32_tensor

    values = [0, -1, 5, 2**31 - 1, -(2**31), 123456]
    got = int32_tensor(values)
    assert got.dtype == torch.int32 and got.tolist() == values
    assert int32_tensor([]).shape == (0,)
    with pytest.raises(OverflowError):
        int32_tensor([2**31])


def test_decode_from_static_buffers_matches_eager(rtn_artifact: Path) -> None:
    """Decode steps from cuda_graph.py's static padded buffers (replayed as CUDA graphs on a
    GPU, run eagerly from the same buffers here) against eager steps (the reference): the same
    tokens and logprobs, bit for bit, so bucketing and padding change nothing."""
    eager = Engine(rtn_artifact, engine_config("triton", kv_quant="int8", enforce_eager=True))
    assert eager.runner.graphs is None
    buffered = Engine(rtn_artifact, engine_config("triton", kv_quant="int8"))
    graphs = buffered.runner.graphs
    batches: list[int] = []
    run = graphs.run

    def counted(step: StepInputs, fed: FeedRows | None = None) -> torch.Tensor:
        batches.append(len(step.input_ids))
        return run(step, fed)

    graphs.run = counted
    assert staggered_run(buffered) == staggered_run(eager)
    assert set(batches) == {3, 2, 1}, batches  # 3 runs in the bucket of 4


def test_backend_errors(monkeypatch: pytest.MonkeyPatch, rtn_artifact: Path) -> None:
    with pytest.raises(BackendError, match="unknown backend"):
        select_backend("tpu", {})
    with pytest.raises(ValueError, match="float16, bfloat16 activations"):
        Engine(rtn_artifact, engine_config("triton", dtype="float32"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a serving host
    if GPU:  # cuda where the csrc library builds here, else triton
        assert select_backend("auto", {}).name in ("cuda", "triton")
    else:
        with pytest.raises(BackendError, match="needs a CUDA GPU"):
            select_backend("triton", {})
        assert select_backend("auto", {}).name == "cpu"


def test_lite_tune_pins_configs_the_backend_uses(
    rtn_artifact: Path, tmp_path: Path, device: torch.device
) -> None:
    from runtime.kernels.triton.gemm import config_from_dict, tune_space

    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    args = ["tune", str(art), "--backend", "triton", "--buckets", "1,16", "--max-configs", "2"]
    args += ["--dtype", "float16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    kernels = json.loads((art / "manifest.json").read_text())["launch"]["kernels"]
    pinned = kernels[arch_key(device)]
    # tiny llama: qkv 96+32+32 padded to 128+64+64, o 96x96, gate/up 2x160 -> 2x192, down K=160
    shapes = {(256, 96), (96, 96), (384, 96), (96, 160)}
    assert set(pinned) == {f"w4a16/N{n}xK{k}/m{m}" for n, k in shapes for m in (1, 16)}
    gs = Artifact(art).manifest.quantization.group_size
    for key, cfg in pinned.items():
        n, k = (int(v) for v in key.split("/")[1][1:].split("xK"))
        m = int(key.split("/m")[1])
        assert config_from_dict(cfg) in tune_space(m, n, k, gs, 2)  # one-row kernel's too
    Artifact(art, checksums=True)  # weights untouched
    engine = Engine(art, engine_config("triton"))
    qkv = engine.model.layers[0].qkv.weight
    assert qkv.config(1) == config_from_dict(pinned["w4a16/N256xK96/m1"])
    bad = CliRunner().invoke(main, ["tune", str(art), "--buckets", "3"])
    assert bad.exit_code != 0 and "row buckets" in bad.output


def test_lite_tune_keeps_the_pins_another_tune_wrote_meanwhile(
    rtn_artifact: Path, tmp_path: Path, device: torch.device
) -> None:
    """A tune of another backend that finished while this one timed: the manifest read before
    the timing was written back, and its pins were lost."""
    from lite.tune import tune

    art = Path(shutil.copytree(rtn_artifact, tmp_path / "art"))
    theirs = {"w4a16/N96xK96/m1": {"dequant": 1}}

    def other_tune_finishes(line: str) -> None:
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["launch"]["kernels"]["cuda/sm_90"] = theirs
        (art / "manifest.json").write_text(json.dumps(manifest))

    ours = tune(art, (1,), 1, torch.float16, 1, other_tune_finishes, backend="triton")
    kernels = Artifact(art).manifest.launch.kernels
    assert kernels == {"cuda/sm_90": theirs, arch_key(device): ours}


def test_runtime_cli_reports_the_triton_backend(
    rtn_artifact: Path,
    caplog: pytest.LogCaptureFixture,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtime.cli import main as runtime_main

    args = ["-v", "generate", str(rtn_artifact), "--backend", "triton", "--dtype", "float16"]
    args += ["--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "3", "--num-blocks", "8"]
    with caplog.at_level("INFO"):
        r = CliRunner().invoke(runtime_main, args)
    assert r.exit_code == 0, r.output
    detail = f"{arch_key(device)}: heuristics"
    assert f"backend triton ({detail}), float16 activations" in caplog.text
    if device.type == "cpu":  # on a GPU host the cuda backend may well run
        monkeypatch.delenv("TRITON_INTERPRET")  # as on a serving host (else: emulated kernels)
        bad = CliRunner().invoke(runtime_main, [a if a != "triton" else "cuda" for a in args[1:]])
        assert bad.exit_code != 0 and "backend 'cuda' needs a CUDA GPU" in bad.output


def test_gemm_reads_the_artifact_as_written(rtn_artifact: Path, device: torch.device) -> None:
    """Every linear of a real artifact, straight from its safetensors file into the kernel:
    no conversion between `lite auto_awq`'s writer and the GEMM (fp16, 2e-3 relative)."""
    from runtime.artifact.layout import dequantize
    from runtime.kernels.triton.gemm import w4a16_gemm

    art = Artifact(rtn_artifact)
    gs = art.manifest.quantization.group_size
    names = [n for n, e in art.manifest.tensors.items() if e.kind == "qweight"]
    assert len(names) == 7 * art.manifest.architecture.num_layers
    for name in names:
        n, k = art.manifest.tensors[name].logical_shape
        qweight = art.tensor(name).to(device)
        qparams = art.tensor(name.replace(".qweight", ".qparams")).to(device)
        x = torch.randn(3, k, dtype=torch.float16, device=device)
        got = w4a16_gemm(x, qweight, qparams, n, k, gs).double()
        want = x.double() @ dequantize(qweight, qparams, n, k, gs).double().T
        assert float((got - want).norm() / want.norm()) < 2e-3, name
