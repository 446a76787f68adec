"""The fused decode layer (runtime/kernels/cpu_layer.c) against the same layer op by op.

Both run the same int4 x int8 kernels in the same order; the fused layer computes rotary,
SiLU, the q/k norms and the residual adds in C, so they agree to fp32 rounding, not bit for
bit. Checked per family (Llama; Mistral; Qwen2's q/k/v biases; Qwen3's q/k norms) and KV
format, on greedy generation of a small batch whose steps are prefills, decodes and a step
mixing both: the same tokens with logprobs within 1e-4, except where the two best tokens are
within that of each other (a tie fp32 rounding may break either way), and except that an
activation one ulp apart may land on the other side of an int8 rounding boundary in the
linears: one code moves by one step, which moved a logprob by 1.1e-3 once (Qwen3, fp32 KV,
where the pool keeps every ulp), so a sequence may have one position within FLIP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main
from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels import cpu_dispatch, native
from runtime.kernels.cpu_dispatch import ROW_POINTS, Choice

pytestmark = pytest.mark.skipif(
    not native.load()[0], reason="the C kernels do not build on this machine"
)

TOL = 1e-4
FLIP = 5e-3


@pytest.fixture(scope="module")
def artifacts(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """RTN artifacts at group 64 (hidden 96 and intermediate 160: K padded in every linear)."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        art = root / family
        args = ["auto_awq", str(tiny_models[family]), "--work-dir", str(art)]
        args += ["--calib-samples", "0", "--w-group-size", "64", "--quiet"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        out[family] = art
    return out


def _generate(art: Path, kv_quant: str, fuse: bool, monkeypatch: pytest.MonkeyPatch):
    """(tokens, logprob lists, whether each layer call ran fused) of greedy generation on four
    prompts, the last arriving while the others decode."""
    monkeypatch.setenv("LITESERVE_CPU_FUSE", "1" if fuse else "0")
    _pinned_dispatch(monkeypatch)
    cfg = EngineConfig(kv_quant=kv_quant, session_len=256, max_batch_size=4, dtype="float32")
    engine = Engine(art, cfg)
    calls = []

    def counted(inner):
        def run(*args):
            out = inner(*args)
            calls.append(out is not None)
            return out

        return run

    # the whole stack in one call where it runs, else the model asks layer by layer
    for op in ("decoder_layers", "decoder_layer"):
        monkeypatch.setattr(engine.ops, op, counted(getattr(engine.ops, op)))
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 30, 3, 20)]
    seqs = [engine.add_request(p, params) for p in prompts[:3]]
    for _ in range(2):
        engine.step()
    seqs.append(engine.add_request(prompts[3], params))  # its prefill joins the decodes
    while any(not s.finished for s in seqs):
        engine.step()
    engine.close()
    return [s.output_ids for s in seqs], [s.logprobs for s in seqs], calls


def _pinned_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs on the same paths whatever the dispatch table measured: the linears on the
    int8 path the fused layer runs, the logits in torch's fp32. A table measured on a busy host
    is not cached, so each engine measures its own, and a disturbed one may put one run's
    linears or logits on another path (other numerics: logprobs 5e-4 apart), or leave the fused
    run without its path (CI, 2026-12-05, with other tests beside it)."""
    measured = cpu_dispatch.cached_choices
    always = {"int4": "int8", "logits": "torch"}

    def pinned(*args, **kwargs):
        table = measured(*args, **kwargs)
        return {**table, **{op: Choice(((ROW_POINTS[-1], p),)) for op, p in always.items()}}

    monkeypatch.setattr(cpu_dispatch, "cached_choices", pinned)


@pytest.mark.parametrize("kv_quant", ["int8", "int4", "none"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_layer_matches_the_layer_op_by_op(
    family: str, kv_quant: str, artifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LITESERVE_CPU_INT8", raising=False)  # the int8 path the fusion needs
    fused_ids, fused_lp, fused_calls = _generate(artifacts[family], kv_quant, True, monkeypatch)
    ids, lp, calls = _generate(artifacts[family], kv_quant, False, monkeypatch)
    assert not any(calls)
    assert fused_calls and all(fused_calls), "a prefill, decode or mixed step ran op by op"
    for got, want, got_lp, want_lp in zip(fused_ids, ids, fused_lp, lp, strict=True):
        flips = 0
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:  # only a near-tie may flip; everything after it differs legitimately
                top = want_lp[i].top
                assert abs(top[0][1] - top[1][1]) < FLIP, (i, a, b, top)
                break
            diff = abs(got_lp[i].logprob - want_lp[i].logprob)
            flips += diff >= TOL
            assert diff < FLIP and flips <= 1, (i, got_lp[i], want_lp[i])


def test_fused_layer_is_not_built_where_it_cannot_run(
    artifacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 activations (the per-op path's torch kernels) and LITESERVE_CPU_FUSE=0 build
    no fused layer; the engine still runs."""
    for dtype, fuse in (("bfloat16", "1"), ("float32", "0")):
        monkeypatch.setenv("LITESERVE_CPU_FUSE", fuse)
        engine = Engine(artifacts["llama"], EngineConfig(session_len=128, dtype=dtype))
        assert all(layer.fused is None for layer in engine.model.layers)
        params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
        seq = engine.add_request([5, 6, 7], params)
        while not seq.finished:
            engine.step()
        assert len(seq.output_ids) == 3
        engine.close()


def test_a_layer_with_output_biases_runs_op_by_op(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu_layer.c adds the q/k/v biases alone: Llama's attention_bias (o_proj) and mlp_bias
    were dropped by the fused layer, and its output was garbage (top-1 0/34 against the layer
    op by op). Such layers run op by op, with the same tokens and logprobs."""
    from tests.conftest import make_tiny_model

    monkeypatch.delenv("LITESERVE_CPU_INT8", raising=False)
    src = make_tiny_model(
        "llama", tmp_path / "m", tokenizer_dir, attention_bias=True, mlp_bias=True
    )
    art = tmp_path / "art"
    args = ["auto_awq", str(src), "--work-dir", str(art), "--calib-samples", "0", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    fused_ids, fused_lp, fused_calls = _generate(art, "int8", True, monkeypatch)
    ids, lp, calls = _generate(art, "int8", False, monkeypatch)
    assert not any(fused_calls) and not any(calls)
    assert fused_ids == ids
    for got, want in zip(fused_lp, lp, strict=True):
        assert [x.logprob for x in got] == [x.logprob for x in want]
