"""Prefix-cache hit rate of two replicas on Ray Serve: prefix-affinity routing against
round-robin, in one run (issue 17's CPU target: affinity at least 2x round-robin).

A local Ray cluster, two engine replicas of ARTIFACT behind the liteserve ingress
(runtime/server/cluster.py). The same seeded traffic is sent twice, once with the engine
deployment routed round-robin and once with prefix affinity (a fresh deployment each time, so
both start with empty caches), by --clients concurrent clients.

The traffic is sessions, the shape of chat and RAG services: --active sessions are open at a
time; each request picks an open session at random and asks its next question; a session ends
after --turns requests and a new one, on a new document (a --prefix-chars window of Python's
pydoc text), takes its place. --shape documents (the default) sends the session's document and
the new question each turn (the shared prefix is the document); --shape conversations resends
the whole conversation so far, the document, each earlier question and an answer to it, as a
chat client does (the shared prefix grows by a turn each time). The hit rate is the replicas'
own `liteserve:prefix_cache_hits_total / prefix_cache_queries_total` (KV blocks of the prompts
found cached), summed over the replicas, scraped through the ingress.

Where the gain comes from, and where it does not: round-robin sends a session's turns to both
replicas, so each document is computed twice before it is reused, and both replicas must cache
every open session's document; affinity computes each once and lets each replica cache half.
--num-blocks sets each replica's KV pool; the default holds --pool-share (0.65) of the open
sessions' longest prompts plus the running requests' own blocks: more than the half each replica
needs under affinity, less than all under round-robin, the regime of a busy service. With a pool
that holds everything and many turns per prefix, the two policies differ only by the second
cold miss per prefix (--num-blocks 200 --turns 12 --active 8: about 1.1x).

    python evals/bench/prefix_routing.py out/smollm2-awq --out prefix-routing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import re
import socket
import sys
import time
from pathlib import Path

import httpx2 as httpx

APP = "prefixbench"
MODEL = "bench"


def documents(count: int, chars: int) -> list[str]:
    """`count` distinct windows of `chars` characters of pydoc text (real prose)."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(t.split()) for _, t in sorted(topics.items()))
    if count * chars > len(text):
        raise SystemExit(f"pydoc has {len(text)} characters, not {count} x {chars}")
    return [text[i * chars : (i + 1) * chars] for i in range(count)]


def workload(
    seed: int, count: int, turns: int, active: int, chars: int, shape: str
) -> tuple[list[list[dict]], list[int]]:
    """`count` chat requests from sessions: (requests, the session each belongs to).

    "documents": every turn is the session's document and one new question. "conversations":
    every turn resends the whole conversation so far (the document, each earlier question
    and an answer to it) and asks the next question, as a chat client does.
    """
    rng = random.Random(seed)
    docs = documents(count // turns + active + 1, chars)
    answers = documents(count // turns + active + 1, chars // 4)[::-1]
    open_sessions = [[d, []] for d in range(active)]  # [document, turns so far]
    next_doc = active
    out, sessions = [], []
    for _ in range(count):
        session = rng.choice(open_sessions)
        doc, history = session
        question = {
            "role": "user",
            "content": f"Question {len(history) + 1}: what does part {rng.randrange(9)} say?",
        }
        earlier = [m for turn in history for m in turn] if shape == "conversations" else []
        system = {"role": "system", "content": f"Answer from this document.\n{docs[doc]}"}
        out.append([system, *earlier, question])
        sessions.append(doc)
        answer = {"role": "assistant", "content": answers[(doc + len(history)) % len(answers)]}
        history.append((question, answer))
        if len(history) == turns:
            session[:] = [next_doc, []]
            next_doc += 1
    return out, sessions


def scrape(url: str) -> dict[str, float]:
    """Replica-summed prefix-cache counters and the router's counts from /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^liteserve:(\w+)\{(.*)\} (\S+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
            out[name] = out.get(name, 0.0) + value
            replica = re.search(r'replica="([^"]*)"', labels).group(1)
            out[f"{name}[{replica}]"] = value
        elif name == "router_requests_total":
            reason = re.search(r'reason="([^"]*)"', labels).group(1)
            out[f"routed[{reason}]"] = value
    return out


async def drive(url: str, requests: list[list[dict]], clients: int, max_tokens: int) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    per_replica: dict[str, int] = {}
    failures: list[str] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            messages = queue.get_nowait()
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            r = await http.post(url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:200]}")
                continue
            replica = r.headers.get("x-liteserve-replica", "?")
            per_replica[replica] = per_replica.get(replica, 0) + 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return {
        "wall_s": round(time.perf_counter() - t0, 2),
        "requests_per_replica": per_replica,
        "failures": failures,
    }


def run_policy(args, policy: str, port: int, requests: list[list[dict]]) -> dict:
    from ray import serve

    from runtime.server import cluster

    engine_kw = dict(
        enable_prefix_caching=True,
        num_blocks=args.num_blocks,
        session_len=args.session_len,
        backend=args.backend,
    )
    app = cluster.build_application(
        args.artifact,
        engine_kw,
        MODEL,
        replicas=2,
        routing=policy,
        replica_cpus=1,
        max_ongoing_requests=max(16, args.clients),
    )
    cluster.start(app, "127.0.0.1", port, name=APP)
    url = f"http://127.0.0.1:{port}"
    try:
        before = scrape(url)
        traffic = asyncio.run(drive(url, requests, args.clients, args.max_tokens))
        after = scrape(url)
    finally:
        serve.delete(APP)
    hits = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    queries = after.get("prefix_cache_queries_total", 0) - before.get(
        "prefix_cache_queries_total", 0
    )
    return {
        "policy": policy,
        "hit_rate": hits / queries if queries else math.nan,
        "hit_blocks": hits,
        "queried_blocks": queries,
        "routed": {k[7:-1]: v for k, v in after.items() if k.startswith("routed[")},
        **traffic,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument(
        "--shape",
        choices=("documents", "conversations"),
        default="documents",
        help="each turn resends the document only, or the conversation so far",
    )
    ap.add_argument("--turns", type=int, default=3, help="requests per session (document)")
    ap.add_argument("--active", type=int, default=16, help="sessions open at a time")
    ap.add_argument("--prefix-chars", type=int, default=2000, help="characters per document")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--session-len", type=int, default=2048)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks per replica (default: --pool-share of the open sessions' longest prompts "
        "plus two blocks per client)",
    )
    ap.add_argument(
        "--pool-share",
        type=float,
        default=0.65,
        help="the default pool's share of the open sessions' longest prompts",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import ray
    from tokenizers import Tokenizer

    from runtime.artifact.reader import read_manifest

    requests, sessions = workload(
        args.seed, args.requests, args.turns, args.active, args.prefix_chars, args.shape
    )
    block = read_manifest(args.artifact).launch.cache_block_seq_len
    tok = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    longest: dict[int, int] = {}  # session -> blocks of its longest prompt
    for messages, session in zip(requests, sessions, strict=True):
        text = "".join(m["content"] for m in messages)
        longest[session] = max(longest.get(session, 0), len(tok.encode(text).ids) // block)
    doc_blocks = sum(longest.values()) / len(longest)
    if args.num_blocks is None:
        args.num_blocks = math.ceil(args.pool_share * args.active * doc_blocks) + 2 * args.clients

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        results = [run_policy(args, p, port, requests) for p in ("round-robin", "prefix")]
    finally:
        serve.shutdown()
        ray.shutdown()

    rr, affinity = results
    ratio = affinity["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
    report = {
        "artifact": str(args.artifact),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": " ".join(sys.argv),
        "shape": args.shape,
        "documents": len(longest),
        "turns_per_session": args.turns,
        "open_sessions": args.active,
        "blocks_per_session": round(doc_blocks, 2),
        "kv_block_tokens": block,
        "num_blocks_per_replica": args.num_blocks,
        "requests": args.requests,
        "clients": args.clients,
        "results": results,
        "affinity_over_round_robin": ratio,
        "target_met": ratio >= 2,
    }
    for r in results:
        print(
            f"{r['policy']:>12}: hit rate {r['hit_rate']:.3f} ({r['hit_blocks']:.0f} of "
            f"{r['queried_blocks']:.0f} blocks), {r['wall_s']} s, per replica "
            f"{r['requests_per_replica']}, routed {r['routed']}, failures {len(r['failures'])}"
        )
    print(f"affinity / round-robin hit rate: {ratio:.2f}x (target >= 2x)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
