"""The engine on the triton backend (kernels interpreted on the CPU) against the CPU backend,
and `lite tune` pinning GEMM configs that the backend then uses."""

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
from runtime.engine.sampler import SamplingParams
from runtime.kernels.ops import BackendError, select_backend


def _config(backend: str, **kw) -> EngineConfig:
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


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 21, 40)]


@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_triton_backend_matches_cpu(rtn_artifact: Path, kv_quant: str) -> None:
    """Same greedy tokens, and prompt log-probabilities within fp16 rounding (0.02 absolute),
    for chunked prefill, batched decode and every KV policy."""
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, prompt_logprobs=0)
    got = {}
    for backend in ("cpu", "triton"):
        engine = Engine(rtn_artifact, _config(backend, kv_quant=kv_quant))
        assert engine.backend == backend
        got[backend] = engine.generate(_prompts(), params)
    for a, b in zip(got["cpu"], got["triton"], strict=True):
        assert a.output_ids == b.output_ids
        x = torch.tensor([lp.logprob for lp in a.prompt_logprobs])
        y = torch.tensor([lp.logprob for lp in b.prompt_logprobs])
        assert float((x - y).abs().max()) < 0.02


def test_backend_errors(monkeypatch: pytest.MonkeyPatch, rtn_artifact: Path) -> None:
    with pytest.raises(BackendError, match="not built"):
        select_backend("cuda", {})
    with pytest.raises(BackendError, match="unknown backend"):
        select_backend("tpu", {})
    monkeypatch.delenv("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="needs a CUDA GPU"):
            select_backend("triton", {})
        assert select_backend("auto", {}).name == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="float16, bfloat16 activations"):
        Engine(rtn_artifact, _config("triton", dtype="float32"))


def test_lite_tune_pins_configs_the_backend_uses(rtn_artifact: Path, tmp_path: Path) -> None:
    from runtime.kernels.triton.gemm import GemmConfig, config_space

    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    args = ["tune", str(art), "--buckets", "1,16", "--max-configs", "2", "--dtype", "float16"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    kernels = json.loads((art / "manifest.json").read_text())["launch"]["kernels"]
    pinned = kernels["interpreter"]
    # tiny llama: qkv 96+32+32 padded to 128+64+64, o 96x96, gate/up 2x160 -> 2x192, down K=160
    shapes = {(256, 96), (96, 96), (384, 96), (96, 160)}
    assert set(pinned) == {f"w4a16/N{n}xK{k}/m{m}" for n, k in shapes for m in (1, 16)}
    gs = Artifact(art).manifest.quantization.group_size
    for key, cfg in pinned.items():
        n, k = (int(v) for v in key.split("/")[1][1:].split("xK"))
        m = int(key.split("/m")[1])
        assert GemmConfig.from_dict(cfg) in config_space(m, n, k, gs)[:2]
    Artifact(art, checksums=True)  # weights untouched
    engine = Engine(art, _config("triton"))
    qkv = engine.model.layers[0].qkv.weight
    assert qkv.config(1) == GemmConfig.from_dict(pinned["w4a16/N256xK96/m1"])
    bad = CliRunner().invoke(main, ["tune", str(art), "--buckets", "3"])
    assert bad.exit_code != 0 and "row buckets" in bad.output


def test_runtime_cli_reports_the_triton_backend(rtn_artifact: Path, caplog) -> None:
    from runtime.cli import main as runtime_main

    args = ["-v", "generate", str(rtn_artifact), "--backend", "triton", "--dtype", "float16"]
    args += ["--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "3", "--num-blocks", "8"]
    with caplog.at_level("INFO"):
        r = CliRunner().invoke(runtime_main, args)
    assert r.exit_code == 0, r.output
    assert "backend triton (interpreter: heuristics), float16 activations" in caplog.text
    bad = CliRunner().invoke(runtime_main, [a if a != "triton" else "cuda" for a in args[1:]])
    assert bad.exit_code != 0 and "not built" in bad.output


def test_gemm_reads_the_artifact_as_written(rtn_artifact: Path) -> None:
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
        qweight, qparams = art.tensor(name), art.tensor(name.replace(".qweight", ".qparams"))
        x = torch.randn(3, k, dtype=torch.float16)
        got = w4a16_gemm(x, qweight, qparams, n, k, gs).double()
        want = x.double() @ dequantize(qweight, qparams, n, k, gs).double().T
        assert float((got - want).norm() / want.norm()) < 2e-3, name
