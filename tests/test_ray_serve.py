"""Replicas on Ray Serve (runtime/server/cluster.py): a real local Ray cluster, two engine
replicas of the tiny artifact on the CPU behind the ingress on Ray Serve's HTTP proxy, and the
official openai client.

- two families of prompts, each sharing a different long system prompt, sent in turn: each
  family lands on one replica, the two families on different replicas, and the replicas'
  own metrics (scraped through the ingress, labelled by replica) count prefix-cache hits;
- killing one replica's actor: the service keeps answering (the ingress retries on the other
  replica), Ray Serve starts a replacement, and the replacement serves requests.

The Ray tests are skipped where Ray Serve is not installed (`pip install liteserve[cluster]`);
CI installs it. The relay and the metrics merge are tested without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from pathlib import Path

import httpx2
import openai
import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from runtime.cli import main as runtime_main
from runtime.server import cluster
from tests.conftest import SseStream

needs_ray = pytest.mark.skipif(
    not cluster.ray_available(), reason="Ray Serve is not installed: pip install liteserve[cluster]"
)

APP = "lstest"
MODEL = "tiny"
ENGINE_KW = dict(
    kv_quant="none",
    num_blocks=160,
    cache_block_seq_len=16,
    session_len=1024,
    dtype="float32",
    backend="cpu",
    enable_prefix_caching=True,
    max_batch_size=8,
)
# two long shared prefixes (3 routing blocks of 256 characters each, many KV blocks)
FAMILY = {
    "alpha": "You answer questions about rivers. " * 24,
    "beta": "Reply only with numbers, never words. " * 22,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the pieces that need no Ray ----


def test_asgi_call_relays_messages_and_reports_a_disconnect() -> None:
    app = FastAPI()
    closed = asyncio.Event()

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"got": body}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def events():
            try:
                for i in range(10_000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                closed.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def run() -> None:
        req = cluster.ProxiedRequest(
            "POST", "/echo", b"", [(b"content-type", b"application/json")], b'{"a": 1}'
        )
        start, body = [m async for m in cluster.asgi_call(app, req)]
        assert start["status"] == 200 and body["body"] == b'{"got":{"a":1}}'
        (start, _) = [m async for m in cluster.asgi_call(app, cluster.ProxiedRequest("GET", "/x"))]
        assert start["status"] == 404
        # the consumer leaves after three events: the app's stream is closed
        calls = cluster.asgi_call(app, cluster.ProxiedRequest("GET", "/stream"))
        async with contextlib.aclosing(calls) as messages:
            async for m in messages:
                if m.get("body") == b"data: 2\n\n":
                    break
        await asyncio.wait_for(closed.wait(), 5)

    asyncio.run(run())


def test_merged_metrics_carry_a_replica_label() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    texts = {}
    for replica, n in (("r1", 3), ("r0", 5)):
        registry = CollectorRegistry()
        Counter("liteserve:prefix_cache_hits", "Hits", registry=registry).inc(n)
        texts[replica] = generate_latest(registry).decode()
    out = cluster.merge_metrics(texts, "prefix", {"affinity": 7, "new": 2}).decode()
    assert out.count("# TYPE liteserve:prefix_cache_hits_total") == 1  # one family, 2 samples
    assert 'liteserve:prefix_cache_hits_total{replica="r0"} 5.0' in out
    assert 'liteserve:prefix_cache_hits_total{replica="r1"} 3.0' in out
    assert 'liteserve:router_requests_total{policy="prefix",reason="affinity"} 7.0' in out


def test_deployment_options_fixed_and_autoscaled() -> None:
    cpu = {"backend": "cpu", "device": "cpu", "num_blocks": None, "kv_quant": "int8"}
    options, kw = cluster.engine_deployment(cpu, replicas=3, routing="round-robin")
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["request_router"] == (
        "runtime.server.cluster.PrefixRouter",
        {"policy": "round-robin", "max_imbalance": 4},
    )
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0.0}
    # three CPU replicas on one host share its free memory for their KV pools
    assert kw == {
        "backend": "cpu",
        "device": "cpu",
        "kv_quant": "int8",
        "cache_max_entry_count": 0.8 / 3,
    }

    options, kw = cluster.engine_deployment(
        {**cpu, "num_blocks": 64, "tp": 2},
        min_replicas=1,
        max_replicas=4,
        target_ongoing_requests=6,
        replica_cpus=0.5,
    )
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 6,
    }
    assert options["ray_actor_options"]["num_cpus"] == 1.0  # per TP rank
    assert "cache_max_entry_count" not in kw  # an explicit pool is left alone
    gpu = cluster.engine_deployment({"backend": "cuda", "tp": 2}, replicas=2)[0]
    assert gpu["ray_actor_options"]["num_gpus"] == 2.0
    for bad in ({"replicas": 0}, {"min_replicas": 3, "max_replicas": 2}, {"routing": "random"}):
        with pytest.raises(ValueError):
            cluster.engine_deployment(cpu, **bad)


def test_replica_flags_without_replicas_are_refused(rtn_artifact: Path) -> None:
    """A one-process serve would ignore them: a usage error naming them and the fix."""
    r = CliRunner().invoke(
        runtime_main,
        ["serve", str(rtn_artifact), "--routing", "round-robin", "--replica-cpus", "2"],
    )
    assert r.exit_code == 2, r.output
    assert "--routing, --replica-cpus only apply to replicas on Ray Serve" in r.output
    assert "add --replicas N" in r.output


@needs_ray
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min-replicas", "3", "--max-replicas", "2"], "replica bounds 3..2"),
        (["--replicas", "2", "--routing-imbalance", "1"], "no such artifact directory"),
    ],
)
def test_bad_replica_input_is_refused_before_ray_starts(
    rtn_artifact: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    """Once a traceback, or a Ray cluster started and a minute of replica failures."""
    import ray

    artifact = rtn_artifact if "bounds" in message else tmp_path / "missing"
    r = CliRunner().invoke(runtime_main, ["serve", str(artifact), *args])
    assert r.exit_code == 1 and message in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not ray.is_initialized()


# ---- on a local Ray cluster ----


@pytest.fixture(scope="module")
def service(rtn_artifact: Path):
    """(base url, openai client) of a two-replica deployment on a local Ray cluster."""
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    try:
        app = cluster.build_application(
            rtn_artifact, ENGINE_KW, MODEL, replicas=2, replica_cpus=1, max_ongoing_requests=16
        )
        cluster.start(app, "127.0.0.1", port, name=APP)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield url, client
    finally:
        serve.shutdown()
        ray.shutdown()


def chat(client: openai.OpenAI, family: str | None, question: str) -> tuple[str, str]:
    """(replica that served it, answer text); a family's long system prompt first, if any."""
    system = [{"role": "system", "content": FAMILY[family]}] if family else []
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[*system, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
    )
    completion = raw.parse()
    assert completion.choices[0].message.content is not None
    return raw.headers[cluster.REPLICA_HEADER], completion.choices[0].message.content


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric sample name, replica or reason) -> value from the ingress's /metrics."""
    text = httpx2.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(liteserve:\w+)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = labels.get("replica") or labels.get("reason", "")
            out[(m.group(1), key)] = float(m.group(3))
    return out


def engine_replicas() -> list[str]:
    """Ids of the engine replicas whose actors are alive (named actors, from Ray's GCS)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{cluster.ENGINE}#"
    return sorted(
        a["name"].removeprefix(prefix)
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    )


@needs_ray
def test_families_land_on_one_replica_each(service) -> None:
    url, client = service
    assert [m.id for m in client.models.list().data] == [MODEL]
    before = scrape(url)
    served = {"alpha": set(), "beta": set()}
    # not alternating, so that a policy blind to the prompt (round-robin) splits a family
    for i, family in enumerate(
        ["alpha", "alpha", "beta", "beta", "alpha", "beta", "alpha", "beta"]
    ):
        replica, _ = chat(client, family, f"Question {i}?")
        served[family].add(replica)
    assert all(len(s) == 1 for s in served.values()), served
    (a,), (b,) = served.values()
    assert a != b, "the two families should spread over the two replicas"

    after = scrape(url)
    for replica in (a, b):
        hits = after[("liteserve:prefix_cache_hits_total", replica)]
        assert hits - before.get(("liteserve:prefix_cache_hits_total", replica), 0) >= 3 * 10
    # the first request of each family had no known prefix; the other six followed it
    assert after[("liteserve:router_requests_total", "affinity")] >= 6
    assert after[("liteserve:router_requests_total", "new")] >= 2

    # a stream relays through the ingress as OpenAI's SSE
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    # errors keep OpenAI's shape through the ingress
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )


@needs_ray
def test_killed_replica_is_replaced_and_service_keeps_answering(service) -> None:
    import ray

    url, client = service
    victim, _ = chat(client, "alpha", "Before?")
    survivors = set(engine_replicas()) - {victim}
    assert len(survivors) == 1, (victim, engine_replicas())

    # streaming from the victim when it dies: the stream ends with an error event and
    # [DONE] (it had begun, nothing can be replayed), not cut mid-stream
    messages = [{"role": "system", "content": FAMILY["alpha"]}, {"role": "user", "content": "Go"}]
    body = dict(
        model=MODEL, messages=messages, max_tokens=300, n=2, stream=True, temperature=0,
        ignore_eos=True,
    )  # fmt: skip
    stream = SseStream(url, "/v1/chat/completions", body)
    assert stream.first.wait(60) and stream.error is None, stream.error
    assert stream.status == 200 and stream.headers[cluster.REPLICA_HEADER] == victim

    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{cluster.ENGINE}#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    for i in range(3):  # at once: the other replica answers
        replica, _ = chat(client, "alpha", f"During {i}?")
        assert replica in survivors
    stream.join(60)
    events = stream.events
    assert stream.error is None and events[-1] == "[DONE]", (stream.error, events[-3:])
    last = json.loads(events[-2])
    if "error" in last:  # the victim died mid-stream
        assert "the replica serving this request failed" in last["error"]["message"], last
    else:  # it finished first
        assert last["choices"][0]["finish_reason"] == "length", last

    deadline = time.monotonic() + 90
    while True:
        running = engine_replicas()
        if len(running) == 2 and victim not in running:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {running}"
        time.sleep(1)
    (replacement,) = set(running) - survivors
    seen = set()
    deadline = time.monotonic() + 60
    while replacement not in seen:
        # a prompt with no known prefix goes to the least loaded replica, ties to the one
        # owning the fewest prefixes: the replacement
        assert time.monotonic() < deadline, f"the replacement {replacement} got nothing: {seen}"
        replica, _ = chat(client, None, f"After {len(seen)}?")
        seen.add(replica)
    assert set(scrape(url)) >= {("liteserve:prefix_cache_queries_total", replacement)}
