"""`runtime serve --replicas` end to end, as a user runs it: the command in its own process starts
a local Ray cluster, deploys, answers the official openai client with the engine's own greedy
text, and on SIGTERM drains (streams in flight finish, or end with an error event when --grace
runs out, never cut mid-stream), shuts Ray down and exits 0, releasing the port.

In a module of its own so that it runs after test_ray_serve.py's cluster is torn down (two
local Ray clusters at once do not fit a 2-core CI machine).
"""

from __future__ import annotations

import contextlib
import json
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
from tests.conftest import SseStream

ENGINE_FLAGS = {
    "--kv-quant": "int8",
    "--dtype": "float32",
    "--backend": "cpu",
    "--session-len": "1024",
    "--cache-block-seq-len": "16",
    "--num-blocks": "160",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _completion(url: str, max_tokens: int, n: int) -> SseStream:
    body = dict(
        model="tiny", prompt="Once upon", max_tokens=max_tokens, n=n, stream=True,
        temperature=0, ignore_eos=True,
    )  # fmt: skip
    return SseStream(url, "/v1/completions", body)


def _finish_reasons(stream: SseStream) -> list[str]:
    chunks = [json.loads(e) for e in stream.events[:-1]]
    return [c["finish_reason"] for x in chunks for c in x.get("choices", []) if c["finish_reason"]]


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
        session_len=1024,
        cache_block_seq_len=16,
        num_blocks=160,
    )
    want = [r.text for r in pipeline(rtn_artifact, config)(prompts, gen)]

    port = _free_port()
    cmd = [sys.executable, "-m", "runtime", "serve", str(rtn_artifact), "--replicas", "1"]
    cmd += ["--server-port", str(port), "--model-name", "tiny", "--grace", "2"]
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
        # in flight at SIGTERM: a short stream that finishes within --grace, and a long one
        # that may not (n=8 sequences of 900 tokens, more than the pool holds): it ends with an
        # error event then
        short, long_ = _completion(url, max_tokens=16, n=1), _completion(url, max_tokens=900, n=8)
        assert short.first.wait(60) and long_.first.wait(60), (short.events, long_.events)
        proc.send_signal(signal.SIGTERM)  # to the command, as `kill PID` or docker stop send it
        probes = []  # /health while the streams drain
        while long_.is_alive():
            with contextlib.suppress(httpx2.HTTPError):
                probe = httpx2.get(url + "/health", timeout=5)
                probes.append((probe.status_code, probe.json().get("error", {}).get("message")))
            time.sleep(0.1)
        for stream in (short, long_):
            stream.join(60)
            assert stream.error is None, f"{stream.error!r}: cut mid-stream\n{log.read_text()}"
            assert stream.events[-1] == "[DONE]", stream.events[-3:]
        assert _finish_reasons(short) == ["length"], short.events[-3:]
        ended = json.loads(long_.events[-2])
        if "error" in ended:  # its sequences were still running when --grace ran out
            assert "not finished within --grace 2 s" in ended["error"]["message"], ended
            # the drain held for 2 s: the ingress said so to probes
            assert (503, "not serving: shutting down") in probes, probes
        else:
            assert sorted(_finish_reasons(long_)) == ["length"] * 8, long_.events[-6:]
        assert proc.wait(120) == 0, log.read_text()
        assert "stopping: requests in flight get up to --grace 2 s" in log.read_text()
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
