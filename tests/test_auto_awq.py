"""`lite auto_awq` end to end on tiny random models of every family, resume, and bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from lite.cli import main
from runtime.artifact.reader import Artifact

FAST = ["--calib-samples", "8", "--calib-seqlen", "64", "--w-group-size", "64", "--quiet"]


def lite(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_family_end_to_end(family: str, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from lite.hf import load_dequantized, load_source_model

    art = tmp_path / "art"
    code, out = lite("auto_awq", str(tiny_models[family]), "--work-dir", str(art), *FAST)
    assert code == 0, out
    code, out = lite("inspect", str(art), "--verify", "--json")
    assert code == 0, out
    facts = json.loads(out)
    assert (facts["family"], facts["method"], facts["group_size"]) == (family, "awq", 64)
    assert not (tmp_path / "art.partial").exists()

    artifact = Artifact(art)
    m = artifact.manifest
    assert m.architecture.qk_norm == (family == "qwen3")
    assert m.architecture.attention_bias == (family == "qwen2")
    assert m.quantization.calib_samples == 8 and len(m.quantization.calib_tokens_sha256) == 64
    q = m.tensors["model.layers.0.mlp.down_proj.qweight"]
    assert q.logical_shape == [96, 160] and q.padded_shape == [128, 192]
    assert (art / "chat_template.jinja").read_text().startswith("{% for m in messages %}")

    ids = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = load_source_model(tiny_models[family])(input_ids=ids).logits
        got = load_dequantized(artifact)(input_ids=ids).logits
    # Tolerance: int4 g64 on Gaussian-initialized weights is ~9% RMS error per weight, which
    # measures 11-14% on these logits; a wrong nibble order, scale fold or missing tensor
    # measures 50% or more.
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 0.2, rel
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos > 0.98


def test_rtn_and_symmetric(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    art = tmp_path / "rtn"
    code, out = lite(
        "auto_awq",
        str(tiny_models["llama"]),
        "--work-dir",
        str(art),
        "--calib-samples",
        "0",
        "--w-sym",
        "--w-group-size",
        "32",
        "--quiet",
    )
    assert code == 0, out
    q = Artifact(art).manifest.quantization
    assert (q.method, q.symmetric, q.zero_point, q.group_size) == ("rtn", True, False, 32)
    assert q.calib_tokens_sha256 is None


def test_recipe_with_flag_override(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "calib_samples: 4\ncalib_seqlen: 32\nw_group_size: 128\n"
        "launch:\n  session_len: 2048\n  kv_quant: int4\n"
    )
    art = tmp_path / "art"
    code, out = lite(
        "auto_awq",
        str(tiny_models["llama"]),
        "--work-dir",
        str(art),
        "--recipe",
        str(recipe),
        "--w-group-size",
        "32",
        "--quiet",
    )
    assert code == 0, out
    m = Artifact(art).manifest
    assert m.quantization.group_size == 32  # the flag wins
    assert (m.quantization.calib_samples, m.quantization.calib_seqlen) == (4, 32)
    assert (m.launch.session_len, m.launch.kv_quant) == (2048, "int4")


def test_existing_work_dir_needs_overwrite(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    art = tmp_path / "art"
    args = [
        "auto_awq",
        str(tiny_models["llama"]),
        "--work-dir",
        str(art),
        "--calib-samples",
        "0",
        "--quiet",
    ]
    assert lite(*args)[0] == 0
    code, out = lite(*args)
    assert code != 0 and "--overwrite" in out
    assert lite(*args, "--overwrite")[0] == 0
    Artifact(art)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lite", *args]


def test_resume_after_kill_is_byte_identical(tmp_path: Path, tokenizer_dir: Path) -> None:
    from tests.conftest import make_tiny_model

    model = make_tiny_model("llama", tmp_path / "m", tokenizer_dir, layers=6, hidden=192)
    args = [
        "auto_awq",
        str(model),
        "--calib-samples",
        "16",
        "--calib-seqlen",
        "128",
        "--w-group-size",
        "64",
        "--quiet",
    ]
    # Same thread count and clock in both runs; the same relative --work-dir in two folders,
    # so even the command line recorded in the manifest is the same.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SOURCE_DATE_EPOCH": "1700000000"}
    args += ["--work-dir", "art"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    subprocess.run(_cli(*args), check=True, env=env, cwd=tmp_path / "a")
    ref, art = tmp_path / "a" / "art", tmp_path / "b" / "art"

    state = tmp_path / "b" / "art.partial" / "state.json"
    proc = subprocess.Popen(_cli(*args), env=env, cwd=tmp_path / "b")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if state.is_file() and json.loads(state.read_text())["done"] >= 1:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not art.exists()  # nothing half-written where the artifact goes
    done = json.loads(state.read_text())["done"]
    assert 1 <= done < 5

    subprocess.run(_cli(*args), check=True, env=env, cwd=tmp_path / "b")
    files = sorted(p.name for p in ref.iterdir())
    assert files == sorted(p.name for p in art.iterdir())
    for name in files:
        assert (ref / name).read_bytes() == (art / name).read_bytes(), name


def test_mismatched_partial_run_is_refused(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    art = tmp_path / "art"
    partial = tmp_path / "art.partial"
    partial.mkdir()
    (partial / "state.json").write_text(
        json.dumps({"fingerprint": "other", "created": "x", "done": 0, "fallbacks": []})
    )
    code, out = lite("auto_awq", str(tiny_models["llama"]), "--work-dir", str(art), *FAST)
    assert code != 0 and "unfinished run with other settings" in out
    assert not art.exists()


def _bad_inputs(tmp_path: Path, tiny: Path) -> list[tuple[list[str], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    no_field = tmp_path / "bad.jsonl"
    no_field.write_text('{"text": "fine"}\n{"prompt": "no text here"}\n')
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return [
        ([str(tmp_path / "nope")], "not found"),
        ([str(gpt2)], "supported families: llama, mistral, qwen2, qwen3"),
        ([str(tiny), "--w-bits", "3"], "--w-bits 3 is not supported"),
        ([str(tiny), "--w-group-size", "48"], "--w-group-size 48 is not supported"),
        ([str(tiny), "--calib-dataset", str(empty)], "is empty"),
        ([str(tiny), "--calib-dataset", str(no_field)], "line 2"),
        ([str(tiny), "--calib-dataset", "pileval-typo"], "unknown calibration dataset"),
    ] + [([str(tiny), "--work-dir", str(blocker / "sub")], "choose a writable --work-dir")]


def test_bad_input_clear_error_and_no_artifact(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    for i, (args, message) in enumerate(_bad_inputs(tmp_path, tiny_models["llama"])):
        work = tmp_path / f"out{i}"
        if "--work-dir" in args:
            work = Path(args[args.index("--work-dir") + 1])
            args = args[: args.index("--work-dir")]
        code, out = lite("auto_awq", *args, "--work-dir", str(work), "--quiet")
        assert code != 0, (args, out)
        assert message in out, (args, out)
        assert "Traceback" not in out
        assert not work.exists(), args
