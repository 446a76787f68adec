"""`lite convert`, `lite export` and `runtime serve SRC` against other tools' int4 formats.

The judges are independent of runtime/artifact/formats.py: AutoAWQ GEMM and GPTQ checkpoints
are packed here by loops written from each format's documentation, compressed-tensors ones by
the `compressed-tensors` package itself, which also decompresses what `lite export` writes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from lite.cli import main as lite_main
from runtime.artifact.layout import dequantize
from runtime.artifact.reader import Artifact, ArtifactError
from runtime.artifact.writer import EXPORT_MARKER
from runtime.cli import main as runtime_main
from tests.conftest import wait_healthy

FLOAT_ACTIVATIONS = True  # exact math against the reference (conftest.py)

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's nibble order within a word
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the same bits as int32."""
    return ((x + 2**31) % 2**32 - 2**31).to(torch.int32)


def rtn(w: torch.Tensor, gs: int | None, sym: bool) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest int4 of w [N, K]: codes q [N, K], fp16 scales and zeros [N, G]."""
    n, k = w.shape
    size = k if gs is None else gs
    groups = -(-k // size)
    q = torch.empty(n, k, dtype=torch.int64)
    s = torch.empty(n, groups, dtype=torch.float16)
    z = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        part = w[:, g * size : (g + 1) * size].float()
        if sym:
            scale = (part.abs().amax(1) / 7).clamp(min=1e-6).half()
            zero = torch.full((n,), 8)
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-6).half()
            zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
        codes = torch.round(part / scale.float()[:, None]) + zero[:, None]
        q[:, g * size : (g + 1) * size] = codes.clamp(0, 15).long()
        s[:, g], z[:, g] = scale, zero
    return q, s, z


def dequant(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int | None) -> torch.Tensor:
    """The formats' common definition, w = (q - z) * s, in fp32."""
    k = q.shape[1]
    g = torch.zeros(k, dtype=torch.long) if gs is None else torch.arange(k) // gs
    return (q - z[:, g]).float() * s.float()[:, g]


def pack_awq(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ WQLinear_GEMM.from_linear: intweight [K, N]; column 8c + AWQ_ORDER[i] goes to
    bits 4i..4i+3 of word c; qzeros the same over [G, N]; scales [G, N] fp16."""

    def pack(t: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
        out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
        for c in range(out.shape[1]):
            for i in range(8):
                out[:, c] |= t[:, 8 * c + AWQ_ORDER[i]] << (4 * i)
        return _int32(out)

    return {"qweight": pack(q.t()), "qzeros": pack(z.t()), "scales": s.t().contiguous()}


def pack_gptq(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int | None):
    """GPTQ (AutoGPTQ/GPTQModel `checkpoint_format: gptq`): qweight [K/8, N], row r holds
    k = 8r + j in bits 4j..; qzeros [G, N/8] little-endian along N, storing z - 1; g_idx."""
    qt = q.t()
    k, n = qt.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= qt[j::8] << (4 * j)
    stored = (z.t() - 1) & 0xF
    qzeros = torch.zeros(stored.shape[0], n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= stored[:, j::8] << (4 * j)
    g_idx = torch.arange(k, dtype=torch.int32) // (k if gs is None else gs)
    return {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": s.t().contiguous(),
        "g_idx": g_idx,
    }


def ct_scheme(gs: int | None, sym: bool) -> dict:
    return {
        "targets": ["Linear"],
        "weights": {
            "num_bits": 4,
            "type": "int",
            "symmetric": sym,
            "strategy": "channel" if gs is None else "group",
            "group_size": gs,
            "dynamic": False,
        },
    }


def pack_ct(q, s, z, gs: int | None, sym: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors' own compressor packs its format (signed codes q - 8, zero z - 8)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(ct_scheme(gs, sym))
    state = {"weight": dequant(q, s, z, gs).half(), "weight_scale": s}
    if not sym:
        state["weight_zero_point"] = (z - 8).to(torch.int8)
    out = PackedQuantizationCompressor.compress(state, scheme)
    assert out["weight_shape"].tolist() == list(q.shape)
    return dict(out)


def quantization_config(fmt: str, gs: int | None, sym: bool) -> dict:
    if fmt == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": gs,
            "zero_point": True,
            "version": "gemm",
        }
    if fmt == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": -1 if gs is None else gs,
            "desc_act": False,
            "sym": sym,
            "checkpoint_format": "gptq",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": ct_scheme(gs, sym)},
        "ignore": ["lm_head"],
    }


def make_checkpoint(
    model: Path, out: Path, fmt: str, gs: int | None, sym: bool
) -> dict[str, torch.Tensor]:
    """A quantized copy of a tiny HF model in `fmt`; returns each linear's dequantized weight."""
    out.mkdir(parents=True)
    state = load_file(str(model / "model.safetensors"))
    tensors, reference = {}, {}
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not any(prefix.endswith(lin) for lin in LINEARS):
            tensors[name] = w
            continue
        q, s, z = rtn(w, gs, sym)
        reference[prefix] = dequant(q, s, z, gs)
        if fmt == "awq":
            packed = pack_awq(q, s, z)
        elif fmt == "gptq":
            packed = pack_gptq(q, s, z, gs)
        else:
            packed = pack_ct(q, s, z, gs, sym)
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, gs, sym)
    (out / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER:
        if (model / name).is_file():
            shutil.copyfile(model / name, out / name)
    return reference


def artifact_weights(path: Path) -> dict[str, torch.Tensor]:
    art = Artifact(path)
    gs = art.manifest.quantization.group_size
    out = {}
    for name, entry in art.manifest.tensors.items():
        if entry.kind == "qweight":
            prefix = name.removesuffix(".qweight")
            n, k = entry.logical_shape
            qp = art.tensor(prefix + ".qparams")
            out[prefix] = dequantize(art.tensor(name), qp, n, k, gs)
    return out


def convert(src: Path, out: Path) -> None:
    result = CliRunner().invoke(lite_main, ["convert", str(src), "--work-dir", str(out)])
    assert result.exit_code == 0, result.output


def assert_same_weights(got: dict, want: dict, exact: bool) -> None:
    """Symmetric: equal. Asymmetric: the artifact's (s, -z*s) rounds -z*s to fp16 once, so
    they differ by at most 2^-11 |z s| per weight (docs/artifact-layout.md section 7)."""
    assert got.keys() == want.keys()
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), name
        else:
            diff = (got[name] - want[name]).abs().max().item()
            assert diff <= 2**-11 * want[name].abs().max().item() * 4, (name, diff)


CASES = [  # format, source group size (None: per channel), symmetric
    ("awq", 32, False),
    ("gptq", 32, True),
    ("gptq", None, True),
    ("ct", 32, True),
    ("gptq", 64, True),  # K = 96: a partial last group
    ("ct", 32, False),
    ("ct", None, False),
]


@pytest.mark.parametrize(("fmt", "gs", "sym"), CASES)
def test_convert_gives_the_same_weights(fmt, gs, sym, tiny_models, tmp_path: Path) -> None:
    ref = make_checkpoint(tiny_models["llama"], tmp_path / "src", fmt, gs, sym)
    convert(tmp_path / "src", tmp_path / "art")
    assert_same_weights(artifact_weights(tmp_path / "art"), ref, exact=sym)
    m = Artifact(tmp_path / "art").manifest
    assert m.source.quantization_config == quantization_config(fmt, gs, sym)
    shown = CliRunner().invoke(lite_main, ["inspect", str(tmp_path / "art")]).output
    assert f"converted from {m.source.format}" in shown
    assert (tmp_path / "art" / "chat_template.jinja").read_text() == (
        tiny_models["llama"] / "chat_template.jinja"
    ).read_text()


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_engine_on_converted_matches_transformers(family, tiny_models, tmp_path: Path) -> None:
    """Logits of the engine on a converted AWQ checkpoint against transformers running the
    source's own dequantized weights (fp32; 1e-3 covers the fp16 rounding of -z*s)."""
    from transformers import AutoModelForCausalLM

    from runtime import EngineConfig
    from runtime.engine.engine import Engine
    from runtime.engine.sampler import SamplingParams

    ref = make_checkpoint(tiny_models[family], tmp_path / "src", "awq", 32, False)
    convert(tmp_path / "src", tmp_path / "art")
    model = AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for prefix, w in ref.items():
            params[prefix + ".weight"].copy_(w)
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    config = EngineConfig(kv_quant="none", num_blocks=16, cache_block_seq_len=16, dtype="float32")
    engine = Engine(tmp_path / "art", config)
    seq = engine.add_request(
        ids, SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=0)
    )
    while not seq.finished:
        engine.step()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in seq.prompt_logprobs])
    assert torch.allclose(got, want, atol=1e-3), float((got - want).abs().max())


@pytest.fixture(scope="module")
def gs32_artifact(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An RTN artifact (asymmetric, as `lite auto_awq` makes them) whose group size divides
    every K of the tiny model, so both formats can hold it."""
    out = tmp_path_factory.mktemp("gs32") / "art"
    args = ["auto_awq", str(tiny_models["llama"]), "--work-dir", str(out), "--quiet"]
    args += ["--calib-samples", "0", "--w-group-size", "32"]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0, result.output
    return out


def export(art: Path, fmt: str, out: Path) -> None:
    args = ["export", str(art), "--format", fmt, "--output", str(out)]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fmt", ["compressed-tensors", "autoawq"])
def test_export_then_convert_round_trips(fmt, gs32_artifact: Path, tmp_path: Path) -> None:
    export(gs32_artifact, fmt, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    convert(tmp_path / "hf", tmp_path / "back")
    want = artifact_weights(gs32_artifact)
    assert_same_weights(artifact_weights(tmp_path / "back"), want, exact=False)
    umask = os.umask(0)
    os.umask(umask)
    for made in (tmp_path / "hf", tmp_path / "back"):  # readable by a server of another user
        assert stat.S_IMODE(made.stat().st_mode) == 0o777 & ~umask, made
    # --overwrite replaces an export; it never deletes a directory that is not one
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    # a quantized checkpoint a user downloaded has an export's config.json and files of its
    # own (it was replaced whole, README, LICENSE and original/ with it)
    shutil.copytree(tmp_path / "hf", tmp_path / "download")
    (tmp_path / "download" / EXPORT_MARKER).unlink()
    (tmp_path / "download" / "LICENSE").write_text("theirs")
    extended = tmp_path / "extended"  # an export the user added a file to
    shutil.copytree(tmp_path / "hf", extended)
    (extended / "notes.txt").write_text("mine")
    outputs = []
    for out in (tmp_path / "hf", tmp_path / "mine", tmp_path / "download", extended):
        args = ["export", str(gs32_artifact), "--format", fmt, "--output", str(out), "--overwrite"]
        result = CliRunner().invoke(lite_main, args)
        assert (result.exit_code == 0) == (out.name == "hf"), result.output
        outputs.append(result.output)
    assert f"holds files but no {EXPORT_MARKER}" in outputs[1]
    assert f"holds files but no {EXPORT_MARKER}" in outputs[2]
    assert f"holds files its {EXPORT_MARKER} does not list (notes.txt)" in outputs[3]
    assert (tmp_path / "download" / "LICENSE").read_text() == "theirs"
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    assert (extended / "notes.txt").is_file()


def test_the_export_says_when_offsets_move_and_a_symmetric_one_is_exact(
    gs32_artifact: Path, tiny_models, tmp_path: Path
) -> None:
    """docs/interop.md said an fp16 artifact exports exactly: an asymmetric one's offsets -z*s,
    rounded once from the fp32 scale, come back from the integer z one fp16 step away in some
    groups (18.6% on SmolLM2 AWQ), in silence. The export counts them; --w-sym is exact."""
    from runtime.artifact.layout import unpack_qparams

    art, moved, total = Artifact(gs32_artifact), 0, 0
    for name, entry in art.manifest.tensors.items():
        if entry.kind == "qparams":
            s, b = unpack_qparams(art.tensor(name), entry.logical_shape[0])
            moved += int(((torch.round(-b.float() / s.float()) * -s.float()).half() != b).sum())
            total += b.numel()
    args = ["export", str(gs32_artifact), "--format", "autoawq", "--output", str(tmp_path / "a")]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0 and moved > 0, (moved, result.output)
    assert f"warning: {moved} of {total} groups" in result.output, result.output
    sym = tmp_path / "sym"
    args = ["auto_awq", str(tiny_models["llama"]), "--work-dir", str(sym), "--quiet"]
    args += ["--calib-samples", "0", "--w-group-size", "32", "--w-sym"]
    assert CliRunner().invoke(lite_main, args).exit_code == 0
    for fmt in ("compressed-tensors", "autoawq"):
        args = ["export", str(sym), "--format", fmt, "--output", str(tmp_path / fmt)]
        result = CliRunner().invoke(lite_main, args)
        assert result.exit_code == 0 and "warning" not in result.output, result.output
        convert(tmp_path / fmt, tmp_path / f"{fmt}-back")
        back, want = Artifact(tmp_path / f"{fmt}-back"), Artifact(sym)
        assert back.manifest.tensors.keys() == want.manifest.tensors.keys()
        assert all(torch.equal(back.tensor(k), want.tensor(k)) for k in want.manifest.tensors)


def test_a_killed_runs_staging_directory_is_named_on_the_next_run(
    gs32_artifact: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL runs no cleanup: the hidden staging directory (the output's size) stayed, and
    each rerun said nothing of it."""
    left = tmp_path / ".out.export-k1ll3d"
    left.mkdir()
    (left / "model-00001.safetensors").write_bytes(bytes(2**20))
    export(gs32_artifact, "autoawq", tmp_path / "out")
    assert f"{left} (1.0 MiB) is left from an interrupted export of {tmp_path / 'out'}" in (
        caplog.text
    )
    assert left.is_dir()  # another export may own it: named, never deleted


def test_a_bf16_export_warns_that_its_loaders_round_the_scales(tiny_models, tmp_path) -> None:
    """vLLM and transformers hold a bf16 model's scales in bf16: the fp16 scales round once,
    so the export is no longer the artifact's exact weights (an fp16 one is: no warning)."""
    art = tmp_path / "art"
    args = ["auto_awq", str(tiny_models["llama"]), "--work-dir", str(art), "--quiet"]
    args += ["--calib-samples", "0", "--w-group-size", "32", "--dtype", "bfloat16"]
    assert CliRunner().invoke(lite_main, args).exit_code == 0
    scales = load_file(str(art / "model-00001.safetensors"))
    qp = next(v for k, v in scales.items() if k.endswith(".qparams"))
    assert (qp[..., 0].to(torch.bfloat16).to(qp.dtype) != qp[..., 0]).any()  # they do move
    args = ["export", str(art), "--format", "compressed-tensors", "--output", str(tmp_path / "o")]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0 and "warning: this artifact runs in bfloat16" in result.output


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_awq's loop, from the same documentation: [R, C/8] -> [R, C]."""
    wide = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for c in range(words.shape[1]):
        for i in range(8):
            out[:, 8 * c + AWQ_ORDER[i]] = (wide[:, c] >> (4 * i)) & 0xF
    return out


def test_autoawq_export_reads_as_the_format_says(gs32_artifact: Path, tmp_path: Path) -> None:
    """The AutoAWQ export read by the test's own unpacker (not runtime/artifact/formats.py):
    (q - z) * s per group of 32 gives the artifact's weights, with the config AutoAWQ and
    transformers read (transformers' AWQ loader itself needs gptqmodel, a CUDA build)."""
    export(gs32_artifact, "autoawq", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    promised = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    assert {key: config.get(key) for key in promised} == promised
    assert config.get("version", "gemm") == "gemm"
    tensors = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    want = artifact_weights(gs32_artifact)
    for prefix, w in want.items():
        q = unpack_awq(tensors[prefix + ".qweight"]).t()  # [N, K]
        z = unpack_awq(tensors[prefix + ".qzeros"]).t()  # [N, G]
        scales = tensors[prefix + ".scales"].t()
        assert scales.dtype == torch.float16
        got = dequant(q, scales, z, 32)
        diff = (got - w).abs().max().item()
        assert diff <= 2**-11 * w.abs().max().item() * 4, (prefix, diff)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "autoawq"])
def test_export_refuses_partial_groups(fmt, rtn_artifact: Path, tmp_path: Path) -> None:
    """The tiny model's K = 96 with group size 128: neither format has partial groups."""
    args = ["export", str(rtn_artifact), "--format", fmt, "--output", str(tmp_path / "hf")]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code != 0 and "in_features % group_size == 0" in result.output
    assert list(tmp_path.iterdir()) == []


def test_compressed_tensors_reads_the_export(gs32_artifact: Path, tmp_path: Path) -> None:
    """compressed-tensors' own decompressor on what `lite export` wrote gives the artifact's
    weights: it computes (q - z) * s in fp16, the artifact q * s + (-z*s) in fp32 with -z*s
    rounded to fp16 once, so they agree to fp16 rounding (2^-10 relative)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = tmp_path / "ct"
    export(gs32_artifact, "compressed-tensors", out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    for prefix, w in artifact_weights(gs32_artifact).items():
        local = {
            k.removeprefix(prefix + "."): v for k, v in tensors.items() if k.startswith(prefix)
        }
        got = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert got.shape == w.shape
        assert (got.float() - w).abs().max() <= 2**-10 * w.abs().max(), prefix


def _fail(src: Path, tmp_path: Path, message: str) -> None:
    out = tmp_path / "art"
    result = CliRunner().invoke(lite_main, ["convert", str(src), "--work-dir", str(out)])
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert not out.exists() and not list(tmp_path.glob(".art.*")), list(tmp_path.iterdir())


def _edit_config(src: Path, **quant) -> None:
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"].update(quant)
    (src / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (dict(bits=8), "8-bit weights; only 4-bit"),
        (dict(group_size=48), "group_size 48 is not supported"),
        (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    ],
)
def test_bad_quantization_configs_are_refused(edit, message, tiny_models, tmp_path) -> None:
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    _edit_config(src, **edit)
    _fail(src, tmp_path, message)


@pytest.mark.parametrize(
    ("key", "scale"),
    [
        ("num_attention_heads", 2),
        ("num_key_value_heads", 2),
        ("head_dim", 0.5),
        ("hidden_size", 2),
        ("intermediate_size", 2),
        ("vocab_size", 2),
        ("num_hidden_layers", None),
    ],
)
def test_a_config_unlike_the_weights_is_refused(key, scale, tiny_models, tmp_path) -> None:
    """It converted and served: with more heads than the tensors hold, the C kernels read
    past them and generated other text; transformers refuses such a config."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    config = json.loads((src / "config.json").read_text())
    if scale is None:
        del config[key]
    else:
        heads = config["num_attention_heads"]
        current = config.get(key) or config["hidden_size"] // heads
        config[key] = int(current * scale)
    (src / "config.json").write_text(json.dumps(config))
    message = "the config does not describe these weights" if scale else "has no " + key
    _fail(src, tmp_path, message)


def test_an_artifact_whose_architecture_disagrees_with_its_tensors_is_refused(
    rtn_artifact: Path, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["architecture"]["num_heads"] *= 2
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"self_attn.o_proj.qparams is \[\d+, \d+\] where"):
        Artifact(art)


def test_a_list_of_named_chat_templates_gives_the_default(tiny_models, tmp_path) -> None:
    """Some Hub models keep their templates as [{name, template}, ...] in tokenizer_config:
    the artifact had no chat template at all, and chat requests were refused."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    default = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ tools }}"},
        {"name": "default", "template": default},
    ]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "ok")
    assert (tmp_path / "ok" / "chat_template.jinja").read_text() == default
    config["chat_template"] = config["chat_template"][:1]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    _fail(src, tmp_path, "has chat templates named ['tool_use'] but none named 'default'")


@pytest.mark.parametrize(
    ("file", "message"),
    [
        ("tokenizer.json", "tokenizer.json cannot be read as a tokenizer"),
        ("generation_config.json", "generation_config.json is not valid JSON"),
        ("tokenizer_config.json", "tokenizer_config.json is not valid JSON"),
    ],
)
def test_a_damaged_side_file_is_named(file, message, tiny_models, tmp_path) -> None:
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    (src / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    (src / file).write_text('{"broken": ')
    _fail(src, tmp_path, message)


def test_dense_and_truncated_checkpoints_are_refused(tiny_models, tmp_path: Path) -> None:
    _fail(tiny_models["llama"], tmp_path, "dense (unquantized) checkpoint")
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "awq", 32, False)
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    _fail(src, tmp_path, "is truncated")


@pytest.mark.parametrize(
    ("code", "why"),
    [(errno.ENOSPC, "no space left on the device"), (errno.EROFS, "it is on a read-only file")],
)
def test_a_full_or_read_only_disk_is_one_line_naming_the_output(
    code: int, why: str, rtn_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ended in a traceback naming the hidden staging directory (a read-only file system
    is no PermissionError), where auto_awq already said it in one line."""
    from types import SimpleNamespace

    from lite import export as export_module
    from lite import sources
    from runtime.artifact import convert as convert_module

    def fails(*_args, **_kw):
        raise OSError(code, os.strerror(code), str(tmp_path / ".out.export-x1"))

    monkeypatch.setattr(export_module, "export", fails)
    monkeypatch.setattr(convert_module, "convert", fails)
    monkeypatch.setattr(
        sources, "resolve", lambda *_a, **_k: SimpleNamespace(path=tmp_path, revision=None)
    )
    out = tmp_path / "out"
    for args in (
        ["export", str(rtn_artifact), "--format", "autoawq", "--output", str(out)],
        ["convert", str(rtn_artifact), "--work-dir", str(out)],
    ):
        result = CliRunner().invoke(lite_main, args)
        assert result.exit_code == 1, result.output
        assert f"Error: cannot write {out}: {why}" in result.output, result.output
        assert ".out.export-x1" not in result.output


@pytest.mark.parametrize(
    ("src", "message"),
    [
        # the alias's 0.5 GB GGUF was dequantized first, then refused as a dense checkpoint
        # named by its cache path
        ("smollm2-135m-instruct", "is a GGUF model, not one of the int4 checkpoints"),
        ("model.GGUF", "quantize it with lite auto_awq model.GGUF"),
        # the advice offered a .gguf file or an alias, which convert never takes
        ("no-such-dir", "is neither a directory nor a hub id (org/name)"),
    ],
)
def test_what_convert_cannot_read_is_named_at_once(src: str, message: str, tmp_path) -> None:
    result = CliRunner().invoke(lite_main, ["convert", src, "--work-dir", str(tmp_path / "a")])
    assert result.exit_code == 1 and message in result.output, result.output
    assert "alias" not in result.output and not (tmp_path / "a").exists()


@pytest.mark.parametrize(
    ("fmt", "legacy"), [("gptq", "quantize_config.json"), ("awq", "quant_config.json")]
)
def test_a_legacy_quantization_file_is_read(fmt, legacy, tiny_models, tmp_path: Path) -> None:
    """Older AutoGPTQ/AutoAWQ checkpoints keep their quantization beside config.json: they
    were called dense, and the advice to quantize them failed."""
    src = tmp_path / "src"
    want = make_checkpoint(tiny_models["llama"], src, fmt, 32, fmt == "gptq")
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config")
    qc.pop("quant_method")
    if fmt == "awq":  # AutoAWQ's own names in quant_config.json
        qc = {"w_bit": qc["bits"], "q_group_size": qc["group_size"], "zero_point": True,
              "version": "GEMM"}  # fmt: skip
    (src / "config.json").write_text(json.dumps(config))
    (src / legacy).write_text(json.dumps(qc))
    convert(src, tmp_path / "art")
    assert_same_weights(artifact_weights(tmp_path / "art"), want, exact=fmt == "gptq")


@pytest.mark.parametrize("desc_act", [False, True])
def test_act_order_g_idx_is_refused(desc_act, tiny_models, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    _edit_config(src, desc_act=desc_act)
    tensors = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(src / "model.safetensors"))
    _fail(src, tmp_path, "act-order")


@pytest.mark.parametrize("gs", [32, None])
def test_desc_act_with_contiguous_groups_converts(gs, tiny_models, tmp_path: Path) -> None:
    """Act-order with static groups, or one group per channel (g_idx all zeros), keeps each
    group a contiguous run of channels: the weights are exact, as without desc_act. A
    desc_act checkpoint without g_idx cannot be read."""
    src = tmp_path / "src"
    want = make_checkpoint(tiny_models["llama"], src, "gptq", gs, True)
    _edit_config(src, desc_act=True, static_groups=gs is not None)
    convert(src, tmp_path / "ok")
    assert_same_weights(artifact_weights(tmp_path / "ok"), want, exact=True)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.g_idx"]
    save_file(tensors, str(src / "model.safetensors"))
    _fail(src, tmp_path, "g_idx is missing from a desc_act (act-order) checkpoint")


def test_runtime_serves_a_checkpoint_through_the_cache(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """`runtime verify SRC` (the resolution serve and check use) converts once into
    LITESERVE_CACHE/converted/<hash>, says so, and reuses the conversion after."""
    from runtime import EngineConfig, GenerationConfig, pipeline
    from runtime.artifact.convert import served_artifact

    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    make_checkpoint(tiny_models["qwen3"], src, "ct", 32, True)
    with caplog.at_level(logging.WARNING, logger="liteserve"):
        result = CliRunner().invoke(runtime_main, ["verify", str(src)])
    assert result.exit_code == 0, result.output
    assert "converting" in caplog.text
    # one entry beside its lock (iterdir's order is the file system's, so filter, not index)
    entries = sorted(p for p in (tmp_path / "cache" / "converted").iterdir() if p.name[0] != ".")
    assert len(entries) == 1
    assert served_artifact(src) == entries[0]
    pipe = pipeline(served_artifact(src), EngineConfig(kv_quant="none", num_blocks=16))
    assert pipe(["def f(x):"], GenerationConfig(max_new_tokens=4, temperature=0))[0].token_ids


def test_transformers_loads_a_symmetric_compressed_tensors_export(tiny_models, tmp_path) -> None:
    """transformers (through compressed-tensors) runs the exported directory as it runs
    llm-compressor's output, with the artifact's logits. Symmetric: with compressed-tensors
    0.20 and transformers 5.24, transformers allocates asymmetric zero points unpacked [N, G]
    while the package's own compressor (and vLLM) write them packed [N/8, G] (docs/interop.md)."""
    from transformers import AutoModelForCausalLM

    from lite.hf import load_dequantized

    make_checkpoint(tiny_models["llama"], tmp_path / "src", "gptq", 32, True)
    convert(tmp_path / "src", tmp_path / "art")
    export(tmp_path / "art", "compressed-tensors", tmp_path / "ct")
    ids = torch.tensor([[5, 17, 99, 200, 3, 42]])
    with torch.no_grad():
        want = load_dequantized(Artifact(tmp_path / "art"))(input_ids=ids).logits
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["compressed-tensors", "autoawq"])
def test_smollm2_export_then_convert(fmt, smollm2: Path, tmp_path: Path) -> None:
    """The real model (round-to-nearest at the recipe's group size 64, as calibration does not
    change the format): exported, converted back, the same weights."""
    art = tmp_path / "art"
    args = ["auto_awq", str(smollm2), "--work-dir", str(art), "--quiet"]
    result = CliRunner().invoke(lite_main, [*args, "--calib-samples", "0", "--w-group-size", "64"])
    assert result.exit_code == 0, result.output
    export(art, fmt, tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "back")
    assert_same_weights(artifact_weights(tmp_path / "back"), artifact_weights(art), exact=False)


def test_streamed_tensor_file_reads_back(tmp_path: Path) -> None:
    """The chunked writer the embedding goes through makes a file safetensors reads as the
    tensor; chunks that do not cover the shape are an error and leave no file."""
    from runtime.artifact.writer import write_streamed

    t = torch.randn(37, 24, dtype=torch.float32)
    path = tmp_path / "x.safetensors"
    write_streamed(path, "w", [37, 24], torch.bfloat16, (t[i : i + 10] for i in range(0, 37, 10)))
    assert torch.equal(load_file(str(path))["w"], t.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bytes of data"):
        write_streamed(tmp_path / "y.safetensors", "w", [37, 24], torch.float16, [t[:30]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


def test_tensor_files_carry_their_checksums(tmp_path: Path, monkeypatch) -> None:
    """The hand-written shard writer: safetensors reads every dtype back (and transformers'
    `format` metadata is there), the checksum it returns is the file's, and a failure half
    way leaves no file behind."""
    from safetensors import safe_open

    from runtime.artifact import writer
    from runtime.artifact.writer import sha256_file, write_tensors

    g = torch.Generator().manual_seed(3)
    tensors = {
        "a.qweight": torch.randint(-(2**31), 2**31 - 1, (5, 8), dtype=torch.int32, generator=g),
        "a.qparams": torch.randn(2, 8, 2, generator=g).half(),
        "b.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randn(3, 3, generator=g),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "x.safetensors"
    entry = write_tensors(path, tensors)
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    assert (entry.sha256, entry.size) == (sha256_file(path), path.stat().st_size)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    data = writer._data
    calls = []

    def fails_third(t: torch.Tensor) -> memoryview:
        calls.append(t)
        if len(calls) == 3:
            raise OSError("the disk went away")
        return data(t)

    monkeypatch.setattr(writer, "_data", fails_third)
    with pytest.raises(OSError, match="went away"):
        write_tensors(tmp_path / "y.safetensors", tensors)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]


@pytest.mark.parametrize("command", ["convert", "export", "runtime verify"])
def test_sigterm_leaves_no_staging_directory(command, gs32_artifact, tiny_models, tmp_path) -> None:
    """A terminated conversion left `.art.convert-*` (the output's size) for good; `runtime`
    converting a checkpoint into the cache left its `.<key>.tmp-*` there."""
    src = tmp_path / "src"
    if command != "export":
        make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    if command == "convert":
        args = ["lite", "convert", str(src), "--work-dir", str(tmp_path / "art")]
    elif command == "export":
        args = ["lite", "export", str(gs32_artifact), "--format", "autoawq"]
        args += ["--output", str(tmp_path / "art")]
    else:
        args = ["runtime", "verify", str(src)]
    env = {**os.environ, "LITESERVE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", *args], env=env, stderr=subprocess.PIPE)

    def staged() -> list[Path]:
        return [*tmp_path.glob(".art.*"), *tmp_path.glob("cache/converted/.*.tmp-*")]

    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if staged():
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.001)
    proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read().decode()[-2000:]
    assert not staged() and not (tmp_path / "art").exists()


def test_an_unwritable_cache_is_an_error_not_a_traceback(tiny_models, tmp_path, monkeypatch):
    """Converting a checkpoint needs the cache: one that cannot be written (here a path under
    a file) is a one-line error naming LITESERVE_CACHE (`lite` lists it in _user_errors)."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "afile" / "cache"))
    result = CliRunner().invoke(runtime_main, ["verify", str(src)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert "set LITESERVE_CACHE to a writable directory" in result.output, result.output


def test_runtime_serve_src_answers_over_http(tiny_models, tmp_path: Path) -> None:
    """`runtime serve SRC` on a GPTQ checkpoint, as a real process: it logs the conversion,
    comes up, and completes a request with the converted model."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models["mistral"], src, "gptq", 32, True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "runtime", "serve", str(src), "--server-port", str(port)]
    cmd += ["--num-blocks", "16", "--session-len", "256", "--kv-quant", "none"]
    env = {**os.environ, "LITESERVE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
        body = {"model": "src", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        reply = httpx2.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = proc.stdout.read().decode()
    assert "converting" in log and str(tmp_path / "cache" / "converted") in log, log


WINDOW_CONFIGS = [  # family, config.json keys: how transformers reads a window, every case
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}),  # max_window_layers 28: none
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen3", {"sliding_window": 8, "max_window_layers": 0}),  # no use_sliding_window: none
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("mistral", {}),  # 4096, transformers' default
    ("mistral", {"sliding_window": None}),  # Mistral-7B v0.2/v0.3
    ("mistral", {"sliding_window": 8}),
    ("llama", {"sliding_window": 8}),  # Llama's attention has no window
]


@pytest.mark.parametrize(("family", "keys"), WINDOW_CONFIGS)
def test_the_sliding_window_is_read_as_transformers_reads_it(family: str, keys: dict) -> None:
    """A converted Qwen2 got a window on every layer when max_window_layers put it on some
    (logprobs 0.59 off) or when use_sliding_window was left out (transformers: False); the
    export wrote Mistral's null window as 4096 and dropped Qwen's."""
    from transformers import AutoConfig

    from lite.hf import architecture_from_config, config_from_architecture
    from runtime.artifact.hf_config import sliding_window

    config = AutoConfig.for_model(family, num_hidden_layers=2, **keys)
    types = set(getattr(config, "layer_types", None) or ())
    if len(types) > 1:
        for raw in ({"model_type": family, "num_hidden_layers": 2, **keys}, config.to_dict()):
            with pytest.raises(ValueError, match="layers of different attention types"):
                sliding_window(raw)
        return
    slides = family == "mistral" or types == {"sliding_attention"}
    want = config.sliding_window if slides else None
    assert sliding_window({"model_type": family, "num_hidden_layers": 2, **keys}) == want
    arch = architecture_from_config(config, None)
    assert arch.sliding_window == want
    exported = config_from_architecture(arch)  # what lite export writes and lite eval loads
    assert architecture_from_config(exported, None).sliding_window == want
    assert sliding_window(exported.to_dict()) == want


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
             "layer_types": None},
            "layers of different attention types (full_attention, sliding_attention",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                 "original_max_position_embeddings": 512}},
            "rope scaling 'yarn' is not supported by the runtime",
        ),
        ("llama", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported by the runtime"),
    ],
    ids=["window-on-some-layers", "yarn", "relu"],
)  # fmt: skip
def test_what_the_runtime_cannot_run_is_refused_before_converting(
    family: str, change: dict, message: str, tiny_models, tmp_path: Path
) -> None:
    """Converted, verified and written to the cache, then refused when loaded (YaRN), or run
    as another model (a window on some layers only)."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models[family], src, "gptq", 32, True)
    config = json.loads((src / "config.json").read_text())
    config.update(change)
    (src / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    _fail(src, tmp_path, message)


def _tiny_gguf(out: Path, rope: str) -> Path:
    """A 2-layer random Llama GGUF with SmolLM2's tokenizer, its RoPE scaled as llama.cpp
    writes it: `linear` in the metadata, or `freqs` as a rope_freqs tensor (Llama 3.1's)."""
    import gguf
    import numpy as np

    from lite.sources import ALIASES, _alias_file

    reader = gguf.GGUFReader(_alias_file(next(iter(ALIASES))))
    writer = gguf.GGUFWriter(str(out), "llama")
    hidden, inter, layers, heads, kv_heads, head_dim = 64, 128, 2, 4, 2, 16
    shape = {
        "llama.block_count": layers,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": inter,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.rope.dimension_count": head_dim,
    }
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in shape:
            writer.add_uint32(key, shape[key])
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    if rope == "linear":
        writer.add_string("llama.rope.scaling.type", "linear")
        writer.add_float32("llama.rope.scaling.factor", 4.0)
    rng = np.random.default_rng(0)
    vocab = reader.fields["tokenizer.ggml.tokens"].data.__len__()

    def rand(*s: int) -> np.ndarray:
        return (rng.standard_normal(s) * 0.05).astype(np.float32)

    writer.add_tensor("token_embd.weight", rand(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if rope == "freqs":
        writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, head_dim // 2, dtype=np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        for name, size in (("attn_norm", hidden), ("ffn_norm", hidden)):
            writer.add_tensor(b + name + ".weight", np.ones(size, np.float32))
        for name, rows, cols in (
            ("attn_q", heads * head_dim, hidden),
            ("attn_k", kv_heads * head_dim, hidden),
            ("attn_v", kv_heads * head_dim, hidden),
            ("attn_output", hidden, heads * head_dim),
            ("ffn_gate", inter, hidden),
            ("ffn_up", inter, hidden),
            ("ffn_down", hidden, inter),
        ):
            writer.add_tensor(b + name + ".weight", rand(rows, cols))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_gguf_keeps_its_rope_scaling_or_is_refused(tmp_path: Path, monkeypatch) -> None:
    """transformers' GGUF reader drops RoPE scaling for Llama: a linear-scaled GGUF became a
    model with plain RoPE, and every Llama 3.1/3.2 GGUF (per-frequency factors) one without
    its llama3 scaling, in silence."""
    from lite.hf import architecture_from_config, load_config
    from lite.sources import SourceError, resolve

    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    linear = resolve(str(_tiny_gguf(tmp_path / "linear.gguf", "linear")))
    arch = architecture_from_config(load_config(linear.path), None)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert arch.rope_theta == 100000.0  # SmolLM2's, kept beside the scaling
    with pytest.raises(SourceError, match="scales RoPE per frequency .* Hugging Face checkpoint"):
        resolve(str(_tiny_gguf(tmp_path / "freqs.gguf", "freqs")))
    entries = [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1  # the linear one only: nothing converted for the refused one


def test_the_export_carries_rope_for_transformers_4_too(tiny_models, tmp_path: Path) -> None:
    """Only transformers 5's rope_parameters were written: transformers 4 (pinned by many vLLM
    builds) read a Llama 3 export as plain RoPE at theta 10000 (checked with 4.57.1)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 500000.0}
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "art")
    out = tmp_path / "ct"
    args = ["export", str(tmp_path / "art"), "--format", "compressed-tensors", "--output", str(out)]
    result = CliRunner().invoke(lite_main, args)
    assert result.exit_code == 0, result.output
    exported = json.loads((out / "config.json").read_text())
    assert (exported["rope_theta"], exported["rope_scaling"]) == (500000.0, rope)
    assert exported["torch_dtype"] == exported["dtype"] == "float16"
    assert exported["rope_parameters"] == {**rope, "rope_theta": 500000.0}  # transformers 5's


def test_a_folder_holding_a_gguf_is_refused_at_once(tmp_path: Path) -> None:
    """It resolved as its GGUF: the whole model was dequantized, then refused as a dense
    checkpoint named by its cache path."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.gguf").write_bytes(b"GGUF")  # never read
    result = CliRunner().invoke(lite_main, ["convert", str(tmp_path / "m"), "--work-dir", "a"])
    assert result.exit_code == 1, result.output
    assert "is a GGUF model, not one of the int4 checkpoints" in result.output


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ('{"weight_map": ', "model.safetensors.index.json is not valid JSON"),
        ('{"metadata": {}}', "model.safetensors.index.json is not a safetensors index"),
    ],
)
def test_a_damaged_index_is_named(index: str, message: str, tiny_models, tmp_path) -> None:
    """`runtime serve SRC` converts without lite's reader: a KeyError traceback, or a JSON
    error that named no file."""
    from runtime.artifact.convert import ConvertError, Shards

    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "gptq", 32, True)
    (src / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ConvertError, match=message):
        Shards(src)


def test_a_compressed_tensors_group_without_its_own_format_takes_the_top_level_one(
    tiny_models, tmp_path: Path
) -> None:
    """compressed-tensors reads a group's null format as the config's: it was refused."""
    src = tmp_path / "src"
    want = make_checkpoint(tiny_models["llama"], src, "ct", 32, True)
    config = json.loads((src / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["format"] = None
    (src / "config.json").write_text(json.dumps(config))
    convert(src, tmp_path / "art")
    assert_same_weights(artifact_weights(tmp_path / "art"), want, exact=True)


def test_a_quantized_checkpoint_read_as_an_artifact_is_named_as_one(tiny_models, tmp_path) -> None:
    """`lite inspect` on an AutoAWQ export advised quantizing it with lite auto_awq."""
    src = tmp_path / "src"
    make_checkpoint(tiny_models["llama"], src, "awq", 32, False)
    with pytest.raises(ArtifactError, match="it is a quantized Hugging Face checkpoint") as e:
        Artifact(src)
    assert "lite auto_awq" not in str(e.value)
    with pytest.raises(ArtifactError, match="quantize it first with `lite auto_awq`"):
        Artifact(tiny_models["llama"])
