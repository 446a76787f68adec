"""The server's own host time per streamed token: `runtime serve` against its engine alone.

On a GPU the engine thread's host work runs beside the device's step (overlapped scheduling),
and whatever the server adds per token (publishing each sequence's update to its request's
event loop, the SSE chunk, the socket write) competes with it for the interpreter. With a
model whose step costs almost nothing (the tiny random Llama, backend cpu) that cost is what
is left: N streams of T tokens through a real server (a subprocess on 127.0.0.1, read by a
raw asyncio client that only counts chunks, so the client's parsing stays out of it) against
the same N x T tokens from the same engine in this process. Per token:

    server us/token = (server wall - engine wall) / (N x T)

With --against REV the server of that git revision (a temporary worktree) runs too, alternated
with this checkout's, and the ratio of their server us/token is printed.

    python evals/bench/server_host.py ART [--streams 16,64] [--new-tokens 128] [--rounds 3]
        [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_wall(artifact: Path, streams: int, new: int, prompt_len: int) -> float:
    """Seconds for the engine alone to produce streams x new tokens (prefill included)."""
    from runtime.engine.engine import Engine

    engine = Engine(artifact, config(streams))
    params = engine.sampling_params(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    for i in range(streams):
        engine.add_request(prompt(i, prompt_len), params)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def config(streams: int):
    from runtime.config import EngineConfig

    return EngineConfig(backend="cpu", max_batch_size=streams, session_len=512, kv_quant="int8")


def prompt(i: int, n: int) -> list[int]:
    return [100 + (i * 31 + j * 7) % 300 for j in range(n)]


async def stream(port: int, body: bytes) -> int:
    """One streaming completion over a raw connection; returns the content chunks read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}: {(await reader.read())[:300]!r}")
    chunks = 0
    while line := await reader.readline():
        if line.startswith(b"data: {"):
            chunks += 1
        elif line.startswith(b"data: [DONE]"):
            break
    writer.close()
    return chunks


async def drive(port: int, streams: int, new: int, prompt_len: int) -> float:
    bodies = [
        json.dumps(
            {
                "model": "m",
                "prompt": prompt(i, prompt_len),
                "max_tokens": new,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for i in range(streams)
    ]
    start = time.perf_counter()
    chunks = await asyncio.gather(*(stream(port, b) for b in bodies))
    wall = time.perf_counter() - start
    if min(chunks) < 1:
        raise RuntimeError(f"a stream produced no chunk: {chunks}")
    return wall


def serve(root: Path, artifact: Path, streams: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "runtime", "serve", str(artifact), "--backend", "cpu",
        "--kv-quant", "int8", "--max-batch-size", str(streams), "--session-len", "512",
        "--server-port", str(port), "--model-name", "m",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("the server did not become healthy within 120 s")


def server_wall(root: Path, artifact: Path, streams: int, new: int, prompt_len: int) -> float:
    proc, port = serve(root, artifact, streams)
    try:
        asyncio.run(drive(port, streams, 4, prompt_len))  # warm-up
        return asyncio.run(drive(port, streams, new, prompt_len))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path, help="a small artifact (the tiny random Llama)")
    p.add_argument("--streams", default="16,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", help="git revision whose server runs too, alternated")
    a = p.parse_args()
    artifact = a.artifact.resolve()
    roots = {"this checkout": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if a.against:
            base = Path(tmp) / "base"
            git = ["git", "-C", str(ROOT), "worktree"]
            subprocess.run([*git, "add", "--detach", "-q", str(base), a.against], check=True)
            roots = {a.against: base, **roots}
        try:
            report(a, artifact, roots)
        finally:
            if a.against:
                subprocess.run([*git, "remove", "--force", str(base)], check=False)


def report(a: argparse.Namespace, artifact: Path, roots: dict[str, Path]) -> None:
    print("| streams | code | engine alone tok/s | server tok/s | server us/token |")
    print("|---:|---|---:|---:|---:|")
    for n in map(int, a.streams.split(",")):
        tokens = n * a.new_tokens
        engine, per = [], {name: [] for name in roots}
        for _ in range(a.rounds):  # alternated, as this machine's speed drifts
            engine.append(engine_wall(artifact, n, a.new_tokens, a.prompt_len))
            for name, root in roots.items():
                per[name].append(server_wall(root, artifact, n, a.new_tokens, a.prompt_len))
        e = statistics.median(engine)
        us = {}
        for name, walls in per.items():
            s = statistics.median(walls)
            us[name] = 1e6 * (s - e) / tokens
            print(f"| {n} | {name} | {tokens / e:.0f} | {tokens / s:.0f} | {us[name]:.1f} |")
        if len(us) == 2:
            old, new = us.values()
            print(f"| {n} | ratio | | | {old / new:.2f}x less |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
