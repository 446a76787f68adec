"""`runtime serve` under concurrent streams, for the GPU check.

Starts `python -m runtime serve ARTIFACT` on 127.0.0.1 (a free port), waits for /health, then
sends N concurrent streaming /v1/completions requests (random-token prompts, greedy, EOS
ignored, so every stream produces exactly --new-tokens tokens) for each N in --streams, and
prints aggregate tokens/s and time to first token. /health must answer 200 before and after:
a server that answers every request with an error while /health says ok is the failure this
catches (issue 11). The server runs in this process's group, so the GPU check's timeout ends
it with this script.

    python evals/bench/serving_gpu.py ART [--streams 1,8,32] [--new-tokens 128] [--backend triton]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:  # the GPU machine has httpx; current openai-python environments have its successor
    import httpx
except ImportError:
    import httpx2 as httpx


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def out(msg: str = "") -> None:
    print(msg, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Stream:
    tokens: int
    ttft_s: float | None
    total_s: float
    error: str | None = None


async def stream_one(
    client: httpx.AsyncClient, base: str, model: str, prompt: list[int], new: int
) -> Stream:
    """One streaming completion; the token count comes from the final usage chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Stream(0, None, time.perf_counter() - start, f"{r.status_code} {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Stream(tokens, first, time.perf_counter() - start, str(chunk)[:200])
                if chunk.get("choices") and first is None:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Stream(tokens, first, time.perf_counter() - start, f"{type(e).__name__}: {e}")
    return Stream(tokens, first, time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_healthy(client: httpx.AsyncClient, base: str, proc, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting")
        try:
            if (await client.get(base + "/health", timeout=2)).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"/health did not answer 200 within {timeout:.0f} s")


async def bench(a: argparse.Namespace, base: str, proc) -> int:
    """Returns the number of problems (failed streams, short streams, unhealthy server)."""
    problems = 0
    limits = httpx.Limits(max_connections=max(a.streams_list) + 4)
    async with httpx.AsyncClient(timeout=a.request_timeout, limits=limits) as client:
        startup = await wait_healthy(client, base, proc, a.startup_timeout)
        health = await client.get(base + "/health")
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        out(f"Server up in {startup:.1f} s; /health {health.status_code}: `{health.text}`.\n")
        vocab = a.vocab
        rng = random.Random(0)

        def prompt() -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(a.prompt_len)]

        warm = await stream_one(client, base, model, prompt(), 8)
        if warm.error:
            out(f"Warm-up request failed: {warm.error}\n")
            problems += 1
        out(
            f"{a.prompt_len}-token random prompts, {a.new_tokens} tokens per stream, greedy, "
            "EOS ignored, /v1/completions streaming.\n"
        )
        out(
            "| streams | aggregate tok/s | per-stream tok/s (mean) | TTFT p50 s | TTFT p99 s "
            "| wall s | failed streams |"
        )
        out("|---:|---:|---:|---:|---:|---:|---:|")
        for n in a.streams_list:
            start = time.perf_counter()
            results = await asyncio.gather(
                *(stream_one(client, base, model, prompt(), a.new_tokens) for _ in range(n))
            )
            wall = time.perf_counter() - start
            ok = [r for r in results if r.error is None and r.tokens == a.new_tokens]
            bad = [r for r in results if r not in ok]
            problems += len(bad)
            for r in bad[:3]:
                log(f"stream failed: {r.error or f'{r.tokens} of {a.new_tokens} tokens'}")
            tokens = sum(r.tokens for r in results)
            ttft = [r.ttft_s for r in ok if r.ttft_s is not None] or [float("nan")]
            per = statistics.mean(r.tokens / r.total_s for r in ok) if ok else float("nan")
            out(
                f"| {n} | {tokens / wall:.1f} | {per:.1f} | {percentile(ttft, 0.5):.3f} | "
                f"{percentile(ttft, 0.99):.3f} | {wall:.2f} | {len(bad)} |"
            )
            if bad:
                out(f"\nFirst failure at {n} streams: {bad[0].error or 'short stream'}\n")
        after = await client.get(base + "/health")
        out(f"\n/health after the load: {after.status_code}.")
        if after.status_code != 200:
            problems += 1
        metrics = (await client.get(base + "/metrics")).text
        lines = [
            m
            for m in metrics.splitlines()
            if m.startswith("liteserve") and not re.search(r"_(bucket|created)\b", m)
        ]
        if lines:
            out("\n<details><summary>/metrics after the load</summary>\n\n```")
            out("\n".join(lines[:40]))
            out("```\n</details>")
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--backend", default="triton")
    p.add_argument("--kv-quant", default="int8")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--port", type=int, default=0, help="0: a free one")
    p.add_argument("--startup-timeout", type=float, default=180)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--log", type=Path, help="the server's output (default: stderr)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for serve")
    a = p.parse_args()
    a.streams_list = [int(n) for n in a.streams.split(",")]
    manifest = json.loads((a.artifact / "manifest.json").read_text())
    a.vocab = manifest["architecture"]["vocab_size"]
    port = a.port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "runtime",
        "serve",
        str(a.artifact),
        "--server-port",
        str(port),
        "--backend",
        a.backend,
        "--kv-quant",
        a.kv_quant,
        "--max-batch-size",
        str(a.max_batch_size),
        "--session-len",
        str(a.prompt_len + a.new_tokens + 64),
        *a.serve_arg,
    ]
    out(f"`{shlex.join(['python3', *cmd[1:]])}`\n")
    log("$ " + " ".join(cmd))
    sink = open(a.log, "w") if a.log else sys.stderr  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    try:
        problems = asyncio.run(bench(a, f"http://127.0.0.1:{port}", proc))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if a.log:
        sink.close()
    if problems:
        raise SystemExit(f"{problems} problem(s): failed or short streams, or /health not 200")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
