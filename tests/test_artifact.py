"""The artifact reader refuses every kind of bad directory, saying which kind it is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from lite.cli import main as lite_main
from runtime.artifact.manifest import SCHEMA_VERSION
from runtime.artifact.reader import Artifact, ArtifactError
from runtime.cli import main as runtime_main


@pytest.fixture
def artifact(rtn_artifact: Path) -> Path:
    return rtn_artifact


@pytest.fixture
def copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


def _shard(root: Path) -> Path:
    return next(root.glob("model-*.safetensors"))


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def test_valid_artifact_opens_and_reads(artifact: Path) -> None:
    art = Artifact(artifact)
    q = art.tensor("model.layers.0.self_attn.q_proj.qweight")
    assert q.dtype.is_floating_point is False and list(q.shape) == [128 // 16, 2 * 128]
    assert art.chat_template and "im_start" in art.chat_template


def test_truncated_file(copy: Path) -> None:
    shard = _shard(copy)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="truncated"):
        Artifact(copy)


def test_corrupted_bytes(copy: Path) -> None:
    shard = _shard(copy)
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF
    shard.write_bytes(bytes(data))
    Artifact(copy, checksums=False)  # same size: only the checksum can tell
    with pytest.raises(ArtifactError, match="corrupted: its sha256"):
        Artifact(copy)
    result = CliRunner().invoke(lite_main, ["inspect", str(copy), "--verify"])
    assert result.exit_code != 0 and "corrupted" in result.output
    result = CliRunner().invoke(runtime_main, ["verify", str(copy)])
    assert result.exit_code != 0 and "corrupted" in result.output


def test_missing_file(copy: Path) -> None:
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="incomplete: tokenizer.json is missing"):
        Artifact(copy)


def test_newer_schema(copy: Path) -> None:
    m = _manifest(copy)
    m["schema_version"] = SCHEMA_VERSION + 1
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="newer than this liteserve reads.*upgrade"):
        Artifact(copy)


def test_manifest_not_json(copy: Path) -> None:
    (copy / "manifest.json").write_text('{"format": "liteserve-artifact", ')
    with pytest.raises(ArtifactError, match="corrupted: not valid JSON"):
        Artifact(copy)


def test_manifest_schema_violation(copy: Path) -> None:
    m = _manifest(copy)
    del m["architecture"]["hidden_size"]
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        ArtifactError, match=r"does not match schema \d+: architecture.hidden_size: Field required$"
    ):
        Artifact(copy)


def test_manifest_that_disagrees_with_its_tensors(copy: Path) -> None:
    """Edited by hand: it verified, then the engine failed with a KeyError on a layer."""
    m = _manifest(copy)
    for field, value, message in (
        ("num_layers", m["architecture"]["num_layers"] + 1, r"num_layers is \d+ and its tensors"),
        ("schema_version", 0, "schema_version 0 is no schema"),
        ("schema_version", "5", "schema_version '5' is no schema"),
    ):
        edited = json.loads(json.dumps(m))
        if field == "num_layers":
            edited["architecture"][field] = value
        else:
            edited[field] = value
        (copy / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(ArtifactError, match=message):
            Artifact(copy)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rms_norm_eps", float("nan")),
        ("rms_norm_eps", -1e-6),
        ("rms_norm_eps", float("inf")),
        ("rope_theta", float("nan")),
        ("rope_theta", 0.0),
        ("rope_theta", float("-inf")),
    ],
)
def test_manifest_with_a_meaningless_norm_or_rotary_base(
    copy: Path, field: str, value: float
) -> None:
    """A NaN or negative eps, or a rotary base that is not a positive number, loaded and
    generated garbage."""
    m = _manifest(copy)
    m["architecture"][field] = value
    (copy / "manifest.json").write_text(json.dumps(m))  # NaN and Infinity, as Python writes them
    with pytest.raises(ArtifactError, match=f"does not match schema .*architecture.{field}: "):
        Artifact(copy)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -1.0, "generation.temperature"),
        ("top_p", 0.0, "generation.top_p"),
        ("repetition_penalty", float("nan"), "generation.repetition_penalty"),
        ("stop_token_ids", [2, 10**9], r"stop_token_ids \[1000000000\] are outside the vocab"),
    ],
)
def test_manifest_with_generation_defaults_the_sampler_refuses(
    copy: Path, field: str, value: object, message: str
) -> None:
    """It verified, then every request that left the field to the default got a 400 for a
    value its client never sent."""
    m = _manifest(copy)
    m["generation"][field] = value
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=message):
        Artifact(copy)


def test_foreign_directories(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="Hugging Face model directory.*lite auto_awq"):
        Artifact(tiny_models["llama"])
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ArtifactError, match="not a liteserve artifact"):
        Artifact(tmp_path)
    with pytest.raises(ArtifactError, match="no such artifact directory"):
        Artifact(tmp_path / "missing")


def test_inspect_reports_facts(artifact: Path) -> None:
    result = CliRunner().invoke(lite_main, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    for fact in ("llama", "rtn int4 g128 asym", "lsq4-mma16x16-v1", "smaller", "chat template"):
        assert fact in result.output
    facts = json.loads(CliRunner().invoke(lite_main, ["inspect", str(artifact), "--json"]).output)
    assert facts["size_bytes"] < facts["fp16_bytes"]


def test_runtime_never_imports_lite_or_transformers() -> None:
    code = (
        "import sys, runtime.cli, runtime.artifact.reader, runtime.artifact.layout\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('lite', 'transformers')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
