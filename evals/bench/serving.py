"""The serving benchmark (issue 16): `runtime serve` against a baseline server, in one run.

Seeded synthetic chat traffic (prompt and output lengths drawn from log-normal distributions,
as chat is: mostly short, a long tail; text from Python's own pydoc topics) is sent as
streaming /v1/chat/completions from a closed-loop client at each concurrency level (1, 2, 4,
8, 16, 32 by default). Per level and server: TTFT, inter-token latency and end-to-end latency
at p50 and p99, request and output-token throughput; per server, the knee (the first level
past which a doubling adds less than 10% output throughput; null if none). Writes a JSON file
and a PNG.

Each server is either started by this script from a command (``{port}`` is replaced by a free
port; it is stopped afterwards) or reached at a URL. The baseline is any OpenAI-compatible
server, llama.cpp's for instance:

    python evals/bench/serving.py --artifact ART \\
        --baseline-cmd "/path/venv/bin/python -m llama_cpp.server --model M.gguf \\
            --n_threads 2 --interrupt_requests False --port {port}" --out serving-results

(llama-cpp-python's server otherwise cuts a running stream off when the next request arrives,
so every concurrent level but the first would fail there.)

Output tokens are counted as the server reports them (usage in the final chunk) when it does,
else as content chunks; both servers are asked to ignore EOS, and a server that does not honour
it ends early, which the JSON shows as fewer output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

LEVELS = (1, 2, 4, 8, 16, 32)
KNEE_GAIN = 1.10  # a doubling of concurrency that adds less output throughput than this: knee


@dataclass(frozen=True)
class Request:
    messages: list[dict]
    max_tokens: int


@dataclass
class Result:
    ok: bool
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    error: str | None = None


def chat_workload(
    seed: int, count: int, prompt_words: float, output_tokens: float
) -> list[Request]:
    """`count` chat requests: log-normal prompt and output lengths around the given medians,
    the prompt a passage of pydoc text (real words, so both tokenizers see ordinary prose)."""
    from pydoc_data.topics import topics

    words = " ".join(topics.values()).split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n_words = max(4, min(int(rng.lognormvariate(math.log(prompt_words), 0.6)), 1500))
        start = rng.randrange(len(words) - n_words)
        text = " ".join(words[start : start + n_words])
        n_out = max(4, min(int(rng.lognormvariate(math.log(output_tokens), 0.5)), 512))
        messages = [{"role": "user", "content": f"Summarize this:\n{text}"}]
        out.append(Request(messages, n_out))
    return out


async def send(client: httpx.AsyncClient, url: str, model: str, req: Request) -> Result:
    """One streaming chat completion, timed chunk by chunk."""
    body = {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Result(False, error=f"{r.status_code} {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=str(chunk)[:200])
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not stamps:
        return Result(False, e2e_s=end - start, error="no content")
    tokens = usage["completion_tokens"] if usage else len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return Result(True, stamps[0] - start, end - start, tokens, gaps)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values (a level where everything failed)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def run_level(url: str, model: str, work: list[Request], concurrency: int) -> dict:
    """Every request of `work` through `concurrency` closed-loop clients."""
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in work:
        queue.put_nowait(r)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 2)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            results.append(await send(client, url, model, queue.get_nowait()))

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "wall_s": wall,
        "output_tokens": tokens,
        "requested_tokens": sum(r.max_tokens for r in work),
        "request_per_s": len(ok) / wall,
        "output_tok_per_s": tokens / wall,
        **{
            f"{name}_{label}_s": pct(values, q)
            for name, values in (
                ("ttft", [r.ttft_s for r in ok]),
                ("itl", gaps),
                ("e2e", [r.e2e_s for r in ok]),
            )
            for label, q in (("p50", 0.5), ("p99", 0.99))
        },
    }


def knee(levels: list[dict]) -> int | None:
    """The first concurrency past which doubling adds less than KNEE_GAIN of output
    throughput; None when throughput still rises at the last level measured."""
    for here, there in zip(levels, levels[1:], strict=False):
        if there["output_tok_per_s"] < KNEE_GAIN * here["output_tok_per_s"]:
            return here["concurrency"]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server to measure: started from a command (and stopped after) or reached at a URL."""

    def __init__(self, name: str, url: str | None, cmd: str | None, log: Path) -> None:
        self.name, self.cmd, self.proc = name, cmd, None
        if cmd:
            port = free_port()
            self.cmd = cmd.replace("{port}", str(port))
            url = f"http://127.0.0.1:{port}"
            print(f"[{name}] $ {self.cmd}", file=sys.stderr, flush=True)
            sink = open(log, "w")  # noqa: SIM115 (lives as long as the server)
            self.proc = subprocess.Popen(
                shlex.split(self.cmd), stdout=sink, stderr=subprocess.STDOUT
            )
        self.url = url or ""

    def wait_ready(self, timeout: float) -> str:
        """The served model's id, once /v1/models answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5)
                if r.status_code == 200:
                    return r.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not answer /v1/models within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def machine() -> dict:
    """What the figures were measured on: CPU model, ISA extensions that matter, cores."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        lscpu = ""
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")
    return {
        "cpu": fields.get("Model name", platform.processor()).strip(),
        "cpus": fields.get("CPU(s)", "").strip(),
        "isa": [f for f in wanted if f in flags],
        "python": platform.python_version(),
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, server in report["servers"].items():
        xs = [lv["concurrency"] for lv in server["levels"]]
        axes[0].plot(xs, [lv["output_tok_per_s"] for lv in server["levels"]], "o-", label=name)
        axes[1].plot(xs, [lv["e2e_p99_s"] for lv in server["levels"]], "o-", label=name)
        axes[2].plot(xs, [lv["ttft_p50_s"] for lv in server["levels"]], "o-", label=name)
        if server["knee"]:
            axes[0].axvline(server["knee"], ls=":", color=axes[0].lines[-1].get_color())
    titles = ("output tokens/s (dotted: knee)", "end-to-end p99 (s)", "TTFT p50 (s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"serving, {report['machine']['cpu']} (seed {report['settings']['seed']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(server: Server, a: argparse.Namespace) -> dict:
    model = server.wait_ready(a.startup_timeout)
    asyncio.run(run_level(server.url, model, chat_workload(a.seed + 1, 2, 8, 8), 1))  # warm-up
    levels = []
    for c in a.levels:
        work = chat_workload(a.seed, max(a.min_requests, a.requests_per_client * c), *a.lengths)
        level = asyncio.run(run_level(server.url, model, work, c))
        print(
            f"[{server.name}] c={c}: {level['output_tok_per_s']:.1f} tok/s, "
            f"e2e p99 {level['e2e_p99_s']:.2f} s, ttft p50 {level['ttft_p50_s']:.3f} s, "
            f"failed {level['failed']}",
            file=sys.stderr,
            flush=True,
        )
        levels.append(level)
    return {"url": server.url, "cmd": server.cmd, "model": model, "levels": levels,
            "knee": knee(levels)}  # fmt: skip


def print_ratios(servers: dict, baseline: str) -> None:
    """liteserve over the baseline at each level, measured in this run, with what each made
    of the tokens asked for: a server that stops at its end token early (llama.cpp) makes
    fewer, and its rate is then for less work."""
    print(f"| concurrent | liteserve / {baseline} output tok/s | output tokens made / asked |")
    print("|---|---|---|")
    pairs = zip(servers["liteserve"]["levels"], servers[baseline]["levels"], strict=True)
    for ours, theirs in pairs:
        ratio = ours["output_tok_per_s"] / max(theirs["output_tok_per_s"], 1e-9)
        made = " / ".join(
            f"{lv['output_tokens']}/{lv['requested_tokens']} ({lv['failed']} failed)"
            for lv in (ours, theirs)
        )
        print(f"| {ours['concurrency']} | {ratio:.2f}x | {made} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, help="start `runtime serve ARTIFACT` to measure")
    p.add_argument("--url", help="a liteserve server already running (instead of --artifact)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra flag for serve")
    p.add_argument("--baseline-url", help="a baseline server already running")
    p.add_argument("--baseline-cmd", help="command that starts the baseline; {port} is filled")
    p.add_argument("--baseline-name", default="llama.cpp")
    p.add_argument("--levels", default=",".join(map(str, LEVELS)))
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--prompt-words", type=float, default=60, help="median prompt length")
    p.add_argument("--output-tokens", type=float, default=64, help="median output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=Path("serving-results"))
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. a shared machine)")
    a = p.parse_args()
    a.levels = [int(x) for x in a.levels.split(",")]
    a.lengths = (a.prompt_words, a.output_tokens)
    a.out.mkdir(parents=True, exist_ok=True)
    if not (a.artifact or a.url):
        p.error("give --artifact or --url")
    serve = None
    if a.artifact:
        serve = f"{shlex.quote(sys.executable)} -m runtime serve {shlex.quote(str(a.artifact))} "
        serve += "--server-port {port} " + " ".join(map(shlex.quote, a.serve_arg))
    targets = [("liteserve", a.url, serve)]
    if a.baseline_url or a.baseline_cmd:
        targets.append((a.baseline_name, a.baseline_url, a.baseline_cmd))
    report = {
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "artifact")},
        "artifact": str(a.artifact) if a.artifact else None,
        "machine": machine(),
        "servers": {},
    }
    for name, url, cmd in targets:  # one at a time: they would share the CPU cores
        server = Server(name, url, cmd, a.out / f"{name}.log")
        try:
            report["servers"][name] = measure(server, a)
        finally:
            server.stop()
    (a.out / "serving.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot(report, a.out / "serving.png")
    if len(report["servers"]) == 2:
        print_ratios(report["servers"], a.baseline_name)
    print(json.dumps({n: s["knee"] for n, s in report["servers"].items()}), flush=True)
    print(f"wrote {a.out / 'serving.json'} and {a.out / 'serving.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
