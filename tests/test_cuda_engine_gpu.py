"""Issue 12's engine checks on a GPU: backend cuda (the csrc library) against backend triton,
and the csrc launches' programmatic overlap and fused pointwise kernels against plain stream
order and torch's ops. Apart from test_gpu.py so that pytest-xdist's one-module-per-worker
runs them beside it: the GPU check gives its tests two minutes.

Marked ``gpu``: skipped without a CUDA GPU (conftest). Tolerances: test_gpu.py's docstring.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.cuda.backend import FUSED_ENV, PDL_ENV
from tests import cuda_lib
from tests.test_gpu import TOL, TOL_KV, assert_backends_agree, logprobs
from tests.test_triton_engine import engine_config, mixed_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("kv_quant", ["none", "int8", "int4"])
def test_cuda_backend_matches_triton(
    rtn_artifact: Path, rtn_artifact_d64: Path, head_dim: int, kv_quant: str
) -> None:
    """Issue 12's engine check: backend cuda (the csrc GEMM and KV write; its decode attention
    at head_dim 64, Triton's at 16) gives backend triton's greedy tokens, with CUDA graphs, and
    logprobs within TOL (both fp16, different summation orders)."""
    cuda_lib.gpu_library()
    artifact = rtn_artifact if head_dim == 16 else rtn_artifact_d64
    assert_backends_agree(artifact, kv_quant, ("cuda", "triton"), 8, TOL)


@pytest.mark.parametrize("kv_quant", ["none", "int4"])
def test_cuda_launch_overlap_changes_no_bit(
    rtn_artifact_d64: Path, kv_quant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Programmatic dependent launch only moves when a csrc kernel starts: with it (the default
    on sm_90) and without it (LITESERVE_CUDA_PDL=0) the engine's kernels are the same and
    deterministic, so every token and logprob must be equal bit for bit. A kernel that read its
    input before waiting for the kernel writing it would show here. The csrc pointwise kernels
    against torch's ops (LITESERVE_CUDA_FUSED=0) agree within TOL: the norms round differently."""
    cuda_lib.gpu_library()
    params = SamplingParams(
        temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    runs = {}
    for name, env in (("default", {}), ("serial", {PDL_ENV: "0"}),
                      ("torch ops", {FUSED_ENV: "0"})):  # fmt: skip
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            engine = Engine(rtn_artifact_d64, engine_config("cuda", kv_quant=kv_quant))
            seqs = engine.generate(mixed_prompts(), params)
            runs[name] = ([s.output_ids for s in seqs], logprobs(seqs))
            del engine
    default, serial, unfused = runs["default"], runs["serial"], runs["torch ops"]
    assert default[0] == serial[0]
    assert all(torch.equal(a, b) for a, b in zip(default[1], serial[1], strict=True))
    assert default[0] == unfused[0]
    for a, b in zip(default[1], unfused[1], strict=True):
        assert torch.allclose(a, b, atol=TOL_KV[kv_quant]), float((a - b).abs().max())
