"""Soak `runtime serve` with mixed traffic, then check that nothing leaked (issue 16).

The server runs in this process (build_app on a real uvicorn on 127.0.0.1), so that afterwards
the engine itself can be asked: zero running or waiting sequences, every KV block back in the
free list and the block manager's invariants clean (``engine.blocks.check()``). A bounded pool
of clients sends, for --duration seconds, a seeded mix of: streamed chats, non-streamed
completions with n > 1, stop strings, clients that disconnect mid-stream, requests cancelled
by a client-side timeout, malformed JSON, oversize bodies, and prompts at (and one token over)
the session limit. Any 5xx fails the run, as does an unexpected status, leaked state, or RSS
that grew more than --max-rss-growth after the warm-up. p50/p99 latency per kind is reported.

    python evals/bench/soak.py ART --duration 600 --clients 8 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx2 as httpx
import psutil
import uvicorn

from runtime import EngineConfig, pipeline
from runtime.server.serve import build_app

MODEL = "soak"
BODY_LIMIT = 256 * 1024
RSS_SAMPLES = 20  # points in the RSS timeline over the run
# kind -> the statuses that are right for it (a cancelled request has none: "cancelled")
EXPECTED = {
    "stream_chat": {200},
    "completion_n": {200},
    "stop_strings": {200},
    "disconnect": {200},
    "cancel": {200, "cancelled"},
    "malformed": {400},
    "oversize": {413},
    "at_limit": {200},
    "over_limit": {400},
}


def start_server(artifact: Path, session_len: int, max_batch: int):
    """The app on a real uvicorn in a thread, on a port bound here; (url, app, server)."""
    config = EngineConfig(session_len=session_len, max_batch_size=max_batch)
    app = build_app(pipeline(artifact, config), MODEL, (), 256, BODY_LIMIT)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread


class Traffic:
    """One request of each kind, as a coroutine that returns its status."""

    def __init__(self, client: httpx.AsyncClient, url: str, session_len: int, vocab: int):
        self.client, self.url, self.session_len, self.vocab = client, url, session_len, vocab

    def chat(self, rng: random.Random, **extra) -> dict:
        words = " ".join(rng.choice(["the", "prime", "number", "list", "code"]) for _ in range(12))
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": rng.randint(4, 32),
            "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randrange(1 << 30),
            **extra,
        }

    async def post(self, path: str, body: dict) -> int:
        r = await self.client.post(self.url + path, json=body)
        return r.status_code

    async def stream(self, body: dict, stop_after: int | None = None) -> int:
        async with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                chunks += line.startswith("data: ")
                if stop_after is not None and chunks >= stop_after:
                    break  # leaving the block closes the connection: a client gone mid-stream
            return r.status_code

    async def run(self, kind: str, rng: random.Random) -> int | str:
        if kind == "stream_chat":
            return await self.stream(self.chat(rng, stream=True))
        if kind == "completion_n":
            body = {"model": MODEL, "prompt": "def f(x):", "n": rng.randint(2, 4), "max_tokens": 16}
            return await self.post("/v1/completions", {**body, "temperature": 0.8})
        if kind == "stop_strings":
            return await self.post("/v1/chat/completions", self.chat(rng, stop=["e", "\n", "."]))
        if kind == "disconnect":
            body = self.chat(rng, stream=True, max_tokens=32, ignore_eos=True)
            return await self.stream(body, stop_after=rng.randint(1, 4))
        if kind == "cancel":
            body = self.chat(rng, max_tokens=32, ignore_eos=True)
            try:
                return await asyncio.wait_for(self.post("/v1/chat/completions", body), 0.2)
            except asyncio.TimeoutError:
                return "cancelled"
        if kind == "malformed":
            r = await self.client.post(
                self.url + "/v1/chat/completions",
                content=b'{"model": "soak", "messages": [',
                headers={"Content-Type": "application/json"},
            )
            return r.status_code
        if kind == "oversize":
            return await self.post("/v1/completions", {"model": MODEL, "prompt": "x" * BODY_LIMIT})
        over = kind == "over_limit"
        ids = [rng.randrange(10, self.vocab) for _ in range(self.session_len - 4 + 5 * over)]
        return await self.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 4})


async def soak(url: str, a: argparse.Namespace, vocab: int) -> dict:
    statuses: dict[str, Counter] = defaultdict(Counter)
    latency: dict[str, list[float]] = defaultdict(list)
    unexpected: list[str] = []
    proc = psutil.Process()
    rss: dict[str, int] = {}
    timeline: list[tuple[float, float]] = []  # (seconds, RSS MiB)
    start = time.monotonic()
    kinds = list(EXPECTED)

    async def client_loop(k: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(a.seed * 1000 + k)
        traffic = Traffic(client, url, a.session_len, vocab)
        while time.monotonic() - start < a.duration:
            kind = rng.choice(kinds)
            t0 = time.perf_counter()
            try:
                status: int | str = await traffic.run(kind, rng)
            except httpx.HTTPError as e:
                status = f"{type(e).__name__}"
            statuses[kind][status] += 1
            latency[kind].append(time.perf_counter() - t0)
            if status not in EXPECTED[kind] and len(unexpected) < 20:
                unexpected.append(f"{kind}: {status}")
            elapsed = time.monotonic() - start
            if "warm" not in rss and elapsed > a.duration * a.warmup:
                rss["warm"] = proc.memory_info().rss
            if elapsed >= len(timeline) * a.duration / RSS_SAMPLES:  # plateau or steady climb?
                timeline.append((round(elapsed, 1), round(proc.memory_info().rss / 2**20, 1)))

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(*(client_loop(k, client) for k in range(a.clients)))
    rss["end"] = proc.memory_info().rss
    return {
        "statuses": statuses,
        "latency": latency,
        "unexpected": unexpected,
        "rss": rss,
        "rss_timeline": timeline,
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def wait_idle(app, timeout: float = 30) -> dict:
    """The engine once nothing is in flight (aborts are asynchronous), checked."""
    state = app.state.liteserve
    engine = state.engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = engine.pool_stats()
        if pool.free_blocks == pool.num_blocks and not engine.has_work() and not state.in_flight:
            break
        time.sleep(0.05)
    pool = engine.pool_stats()
    engine.blocks.check()  # raises on a broken invariant (ref counts, free list, prefix cache)
    return {
        "free_blocks": pool.free_blocks,
        "num_blocks": pool.num_blocks,
        "has_work": engine.has_work(),
        "in_flight": state.in_flight,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--session-len", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--warmup", type=float, default=0.2, help="fraction before the RSS baseline")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    vocab = json.loads((a.artifact / "manifest.json").read_text())["architecture"]["vocab_size"]
    url, app, server, thread = start_server(a.artifact, a.session_len, a.max_batch_size)
    try:
        result = asyncio.run(soak(url, a, vocab))
        after = wait_idle(app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    rss = result["rss"]
    growth = rss["end"] / rss.get("warm", rss["end"]) - 1
    fivexx = sum(n for c in result["statuses"].values() for s, n in c.items() if str(s)[0] == "5")
    leaked = after["free_blocks"] != after["num_blocks"] or after["has_work"] or after["in_flight"]
    summary = {
        "duration_s": a.duration,
        "clients": a.clients,
        "requests": sum(sum(c.values()) for c in result["statuses"].values()),
        "statuses": {k: {str(s): n for s, n in c.items()} for k, c in result["statuses"].items()},
        "latency_p50_p99_s": {
            k: [round(pct(v, 0.5), 4), round(pct(v, 0.99), 4)] for k, v in result["latency"].items()
        },
        "unexpected": result["unexpected"],
        "5xx": fivexx,
        "after": after,
        "rss_warm_mb": round(rss.get("warm", 0) / 2**20, 1),
        "rss_end_mb": round(rss["end"] / 2**20, 1),
        "rss_growth": round(growth, 4),
        "rss_timeline_s_mb": result["rss_timeline"],
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    problems = [
        *(["5xx responses"] if fivexx else []),
        *(["unexpected statuses"] if result["unexpected"] else []),
        *(["leaked sequences or KV blocks"] if leaked else []),
        *([f"RSS grew {growth:.1%}"] if growth > a.max_rss_growth else []),
    ]
    if problems:
        sys.exit("soak failed: " + ", ".join(problems))


if __name__ == "__main__":
    main()
