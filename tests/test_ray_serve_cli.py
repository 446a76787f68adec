"""`runtime serve --replicas` end to end, as a user runs it: the command in its own process starts
a local Ray cluster, deploys, answers the official openai client with the engine's own greedy
text, and on SIGTERM drains, shuts Ray down and exits 0, releasing the port.

In a module of its own so that it runs after test_ray_serve.py's cluster is torn down (two
local Ray clusters at once do not fit a 2-core CI machine).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
import pytest

from runtime import EngineConfig, GenerationConfig, pipeline
from runtime.server import cluster

ENGINE_FLAGS = {
    "--kv-quant": "int8",
    "--dtype": "float32",
    "--backend": "cpu",
    "--session-len": "256",
    "--cache-block-seq-len": "16",
    "--num-blocks": "64",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.skipif(
    not cluster.ray_available(), reason="Ray Serve is not installed: pip install liteserve[cluster]"
)
def test_runtime_serve_replicas_deploys_answers_and_stops(rtn_artifact: Path, tmp_path: Path):
    prompts = ["def f(x):", "The quick brown fox"]
    gen = GenerationConfig(max_new_tokens=10, temperature=0, ignore_eos=True)
    config = EngineConfig(
        kv_quant="int8",
        dtype="float32",
        backend="cpu",
        session_len=256,
        cache_block_seq_len=16,
        num_blocks=64,
    )
    want = [r.text for r in pipeline(rtn_artifact, config)(prompts, gen)]

    port = _free_port()
    cmd = [sys.executable, "-m", "runtime", "serve", str(rtn_artifact), "--replicas", "1"]
    cmd += ["--server-port", str(port), "--model-name", "tiny"]
    cmd += [x for flag in ENGINE_FLAGS.items() for x in flag]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not serving after 240 s:\n{log.read_text()}"
            # the line comes once every replica runs; the proxy may answer a moment before
            if "1 engine replicas on Ray Serve, prefix routing" in log.read_text():
                break
            time.sleep(1)
        assert httpx2.get(url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        for prompt, text in zip(prompts, want, strict=True):
            r = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].text == text
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()
        assert "stopping: the replicas drain" in log.read_text()
        assert _port_is_free(port)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_runtime_serve_replicas_refuses_a_port_in_use_before_ray_starts(rtn_artifact: Path):
    """Serve's proxy could not bind and the command ended 25 s later in a hundred lines of its
    actors' tracebacks: the port is tried first, and Ray is never imported (here it cannot be,
    so this runs without the cluster extra too)."""
    no_ray = "import sys; sys.modules['ray'] = None; from runtime.cli import main; main()"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", no_ray, "serve", str(rtn_artifact), "--replicas", "2"]
            + ["--server-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert f"Error: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "liteserve[cluster]" not in done.stderr


def test_runtime_serve_replicas_refuses_a_damaged_artifact_before_ray_starts(
    rtn_artifact: Path, tmp_path: Path
) -> None:
    """A flipped byte in a shard was found by every replica in turn: a minute of failing
    replicas and 360 lines of Ray's tracebacks. The checksums are read first, without Ray
    (which cannot be imported here)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(rtn_artifact, bad)
    shard = next(bad.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    no_ray = "import sys; sys.modules['ray'] = None; from runtime.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", no_ray, "serve", str(bad), "--replicas", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "sha256 does not match" in done.stderr and "Traceback" not in done.stderr, done.stderr
