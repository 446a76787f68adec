"""The artifact reader refuses every kind of bad directory, saying which kind it is."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from lite.cli import main as lite_main
from runtime.artifact.manifest import SCHEMA_VERSION
from runtime.artifact.reader import Artifact, ArtifactError
from runtime.artifact.writer import write_json_atomic
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
        # verified and exported without a head (transformers loaded a random one)
        ("tie_word_embeddings", False, "tie_word_embeddings is false and its tensors hold no"),
        ("schema_version", 0, "schema_version 0 is no schema"),
        ("schema_version", "5", "schema_version '5' is no schema"),
    ):
        edited = json.loads(json.dumps(m))
        if field in ("num_layers", "tie_word_embeddings"):
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
    # a file was "no such artifact directory", a GGUF among them, and a run cut short had
    # no word on resuming it
    gguf = tmp_path / "Model.Q4_1.GGUF"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ArtifactError, match=r"is a file, not .*`lite auto_awq FILE --work-dir"):
        Artifact(gguf)
    with pytest.raises(ArtifactError, match=r"is a file, not an artifact directory$"):
        Artifact(tmp_path / "manifest.json")
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "state.json").write_text("{}")
    with pytest.raises(ArtifactError, match="unfinished `lite auto_awq` run: rerun the same"):
        Artifact(partial)


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


def _edit(root: Path, edit: Callable[[dict], object]) -> None:
    m = _manifest(root)
    edit(m)
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("group_size", "message"),
    [
        (64, r"is stored as .* the layout makes it .*quantization.group_size 64\)"),
        (32, r"is stored as .* the layout makes it .*quantization.group_size 32\)"),
        (48, r"group_size must be one of \(32, 64, 128\), got 48"),
    ],
)
def test_manifest_whose_group_size_disagrees_with_the_stored_tensors(
    copy: Path, group_size: int, message: str
) -> None:
    """A group size edited by hand (the artifact's is 128) verified, then every group was
    scaled by another's parameters: `runtime generate` printed garbage."""
    _edit(copy, lambda m: m["quantization"].update(group_size=group_size))
    with pytest.raises(ArtifactError, match=f"corrupted: .*{message}"):
        Artifact(copy)
    for main, args in ((lite_main, ["inspect", "--verify"]), (runtime_main, ["verify"])):
        result = CliRunner().invoke(main, [*args, str(copy)])
        assert result.exit_code != 0 and re.search(message, result.output), result.output


def test_manifest_whose_stored_shape_is_not_the_layouts(copy: Path) -> None:
    """Any quantized tensor, picked at random: its stored shape is the layout's for its
    logical shape, or the artifact is refused before a kernel reads past it."""
    original = _manifest(copy)
    names = [n for n, t in original["tensors"].items() if t["kind"] != "dense"]
    rng = random.Random(0)
    for name in rng.sample(names, 4):
        edited = json.loads(json.dumps(original))
        shape = edited["tensors"][name]["shape"]
        shape[rng.randrange(len(shape))] += rng.choice((-1, 1))
        (copy / "manifest.json").write_text(json.dumps(edited))
        with pytest.raises(ArtifactError, match=f"{name} is stored as .* layout makes it"):
            Artifact(copy, checksums=False)


@pytest.mark.parametrize(("field", "value"), [("version", 99), ("name", "lsq4-mma16x16-v2")])
def test_layout_the_reader_does_not_implement(copy: Path, field: str, value: object) -> None:
    """It loaded silently, and the kernels read another layout's words as this one's."""
    _edit(copy, lambda m: m["layout"].update({field: value}))
    theirs = {"name": "lsq4-mma16x16-v1", "version": 1, field: value}
    with pytest.raises(
        ArtifactError,
        match=f"layout {theirs['name']} version {theirs['version']}; this liteserve implements "
        r"only lsq4-mma16x16-v1 version 1 \(.*upgrade liteserve\)",
    ):
        Artifact(copy)


@pytest.mark.parametrize("bits", [8, 3, 2])
def test_weight_widths_the_runtime_does_not_implement(copy: Path, bits: int) -> None:
    """8 was reported as int8 by `lite inspect` while the runtime read int4 codes."""
    _edit(copy, lambda m: m["quantization"].update(bits=bits))
    with pytest.raises(
        ArtifactError, match=rf"quantization.bits: Input should be 4 \(got {bits}\)"
    ):
        Artifact(copy)


@pytest.mark.parametrize("prefix", ["../outside/", "{outside}/", "outside/../../outside/"])
def test_manifest_naming_files_outside_the_artifact(
    copy: Path, tmp_path: Path, prefix: str
) -> None:
    """The shard moved out and the manifest pointed at it: it verified and served from a
    directory that no longer held its weights."""
    shard = _shard(copy)
    (tmp_path / "outside").mkdir()
    moved = shard.rename(tmp_path / "outside" / shard.name)
    name = prefix.format(outside=moved.parent) + shard.name

    def point_outside(m: dict) -> None:
        m["files"][name] = m["files"].pop(shard.name)
        for entry in m["tensors"].values():
            entry["file"] = name

    _edit(copy, point_outside)
    with pytest.raises(ArtifactError, match="is not the name of a file in the artifact directory"):
        Artifact(copy)


def test_tensor_in_a_file_that_is_not_safetensors(copy: Path) -> None:
    """A tensor pointed at another listed file raised safetensors' own error, a traceback;
    now the artifact is refused when opened, as `runtime verify` does."""
    name = "model.layers.0.self_attn.q_proj.qweight"
    _edit(copy, lambda m: m["tensors"][name].update(file="tokenizer.json"))
    with pytest.raises(ArtifactError, match="tokenizer.json is not a readable safetensors file"):
        Artifact(copy)


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("model.norm.weight", {"dtype": "BF16"}, "is stored as F16 .*, the manifest says BF16"),
        ("model.norm.weight", {"file": "model-00002.safetensors"}, "unlisted file"),
    ],
)
def test_manifest_tensors_are_checked_against_the_file_headers(
    copy: Path, name: str, edit: dict, message: str
) -> None:
    """An edited dtype passed `runtime verify` (and sized `runtime plan` wrongly)."""
    _edit(copy, lambda m: m["tensors"][name].update(edit))
    with pytest.raises(ArtifactError, match=message):
        Artifact(copy)


def test_concurrent_json_writes_each_land_whole(tmp_path: Path) -> None:
    """Two writers of the same manifest shared one temporary name, and one renamed the other's
    file away: FileNotFoundError in a few percent of writes."""
    target = tmp_path / "manifest.json"

    def write(writer: int) -> None:
        for i in range(200):
            write_json_atomic({"writer": writer, "i": i, "pad": "x" * 4096}, target)

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(write, w) for w in (0, 1)]:
            done.result()
    assert json.loads(target.read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_failed_json_write_leaves_nothing(tmp_path: Path) -> None:
    """A write that fails halfway removes its temporary file and keeps the old contents."""
    target = tmp_path / "manifest.json"
    write_json_atomic({"ok": True}, target)
    with pytest.raises(TypeError):
        write_json_atomic({"ok": False, "half": "x" * 100_000, "bad": object()}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    assert json.loads(target.read_text()) == {"ok": True}
    opened = tmp_path / "opened"
    opened.write_text("")  # the mode open() gives here: a server under another user reads it
    assert target.stat().st_mode == opened.stat().st_mode


def test_size_on_disk_is_the_artifacts_own_files(copy: Path) -> None:
    """A killed `lite tune` left its temporary manifest, which `lite inspect` counted."""
    size = Artifact(copy).size_on_disk()
    (copy / ".manifest.json.k1ll3d.tmp").write_bytes(b"x" * 10_000)
    assert Artifact(copy).size_on_disk() == size
    listed = sum((copy / n).stat().st_size for n in _manifest(copy)["files"])
    assert size == listed + sum((copy / n).stat().st_size for n in ("manifest.json", "README.md"))


@pytest.mark.parametrize(
    ("field", "value"), [("eos_token_ids", [2, 99999]), ("bos_token_id", 99999)]
)
def test_manifest_with_token_ids_outside_the_vocabulary(copy: Path, field: str, value) -> None:
    """`runtime verify` said ok; the engine then failed on its first step."""
    m = _manifest(copy)
    m["architecture"][field] = value
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=rf"architecture.{field} \[99999\] are outside the"):
        Artifact(copy)
