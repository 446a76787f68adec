"""Prefix-cache hit rate of two replicas on Ray Serve: prefix-affinity routing against
round-robin, in one run (issue 17's CPU target: affinity at least 2x round-robin).

A local Ray cluster, two engine replicas of ARTIFACT behind the liteserve ingress
(runtime/server/cluster.py). The same seeded traffic is sent twice, once with the engine
deployment routed round-robin and once with prefix affinity (a fresh deployment each time, so
both start with empty caches): --requests chat requests from --clients concurrent clients,
each request a random one of --families long system prompts (pydoc topics, --prefix-chars
characters each) and a short question of its own. The hit rate is the replicas' own
`liteserve:prefix_cache_hits_total / prefix_cache_queries_total` (KV blocks of the prompts
found cached), summed over the replicas, scraped through the ingress.

The gap between the two policies comes from cache capacity: round-robin makes every replica
cache every family's prefix, affinity lets each replica cache half of them. --num-blocks sets
each replica's KV pool; the default is sized so that one replica holds about 3/4 of the
families' prefixes, the regime where affinity matters (with a pool that holds every prefix,
round-robin only pays one extra miss per family and replica).

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


def families(count: int, chars: int) -> list[str]:
    """`count` distinct system prompts of `chars` characters (pydoc topics, real prose)."""
    from pydoc_data.topics import topics

    texts = [t for _, t in sorted(topics.items()) if len(t) >= chars]
    if len(texts) < count:
        raise SystemExit(f"only {len(texts)} pydoc topics have {chars} characters")
    rng = random.Random(0)
    return [t[:chars] for t in rng.sample(texts, count)]


def workload(seed: int, count: int, prefixes: list[str]) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        family = rng.randrange(len(prefixes))
        question = f"Question {i}: what does paragraph {rng.randrange(1, 9)} say?"
        out.append(
            [
                {"role": "system", "content": prefixes[family]},
                {"role": "user", "content": question},
            ]
        )
    return out


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
    ap.add_argument("--families", type=int, default=8)
    ap.add_argument("--prefix-chars", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--session-len", type=int, default=2048)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks per replica (default: 3/4 of the families' prefixes plus room for the "
        "clients' running requests)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import ray
    from tokenizers import Tokenizer

    from runtime.artifact.reader import read_manifest

    prefixes = families(args.families, args.prefix_chars)
    requests = workload(args.seed, args.requests, prefixes)
    block = read_manifest(args.artifact).launch.cache_block_seq_len
    tok = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    prefix_blocks = [len(tok.encode(p).ids) // block for p in prefixes]
    if args.num_blocks is None:
        per_request = math.ceil(len(tok.encode(prefixes[0]).ids) / block) + 2
        args.num_blocks = int(0.75 * sum(prefix_blocks)) + args.clients * per_request

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
        "families": args.families,
        "prefix_blocks_per_family": prefix_blocks,
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
