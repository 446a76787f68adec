"""Prometheus metrics, prefixed `liteserve:`, in a registry of their own (one per server, so
tests can run several servers in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "liteserve:"
        self.running = Gauge(
            p + "num_requests_running", "Sequences in the running batch", registry=r
        )
        self.waiting = Gauge(
            p + "num_requests_waiting", "Sequences waiting for admission", registry=r
        )
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use", registry=r)
        self.free_blocks = Gauge(p + "kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt blocks looked up", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt blocks found cached", registry=r
        )
        self.preemptions = Counter(p + "num_preemptions", "Sequences preempted", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            p + "request_success", "Finished requests", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Between output tokens", buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_LATENCY,
            registry=r,
        )
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}

    def sync_engine(self, engine: Engine) -> None:
        """Copy the engine's state after a step (called on the engine thread)."""
        pool = engine.pool_stats()
        self.running.set(pool.running)
        self.waiting.set(pool.waiting)
        self.kv_usage.set(pool.usage)
        self.free_blocks.set(pool.free_blocks)
        for key, counter, value in (
            ("queries", self.prefix_queries, pool.prefix_queries),
            ("hits", self.prefix_hits, pool.prefix_hits),
            ("preemptions", self.preemptions, pool.preemptions),
        ):
            counter.inc(value - self._seen[key])
            self._seen[key] = value
