"""Prometheus metrics, prefixed `liteserve:`, in a registry of their own (one per server, so
tests can run several servers in one process)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from runtime.engine.engine import Engine

# Buckets for GPU and CPU alike: a GPU decodes a token in 1-3 ms (all of it fell in one 5 ms
# bucket), a CPU generation of thousands of tokens takes minutes (it fell past 120 s).
_WAIT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640)
_TOKEN = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075)
_TOKEN += (0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_REQUEST = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 240, 480, 960, 1920, 7680)


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
        # read at scrape time: the engine's queue as of its last step, plus the sequences
        # submitted since, which the engine thread has not taken in yet (it is in a step)
        self._engine_waiting = 0
        self._submitted = 0
        self._lock = threading.Lock()
        self.waiting.set_function(lambda: self._engine_waiting + self._submitted)
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
            p + "request_success", "Finished requests", ["finished_reason"], registry=r
        )
        self.responses = Counter(
            p + "http_responses",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_WAIT,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Between output tokens", buckets=_TOKEN, registry=r
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Arrival to finish", buckets=_REQUEST, registry=r
        )
        self.queue = Histogram(
            p + "request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=_WAIT,
            registry=r,
        )
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}

    def submitted(self, sequences: int) -> None:
        """Sequences handed to the engine thread (negative: taken in, or refused)."""
        with self._lock:
            self._submitted += sequences

    def sync_engine(self, engine: Engine) -> None:
        """Copy the engine's state after a step (called on the engine thread)."""
        pool = engine.pool_stats()
        self.running.set(pool.running)
        self._engine_waiting = pool.waiting
        self.kv_usage.set(pool.usage)
        self.free_blocks.set(pool.free_blocks)
        for key, counter, value in (
            ("queries", self.prefix_queries, pool.prefix_queries),
            ("hits", self.prefix_hits, pool.prefix_hits),
            ("preemptions", self.preemptions, pool.preemptions),
        ):
            counter.inc(value - self._seen[key])
            self._seen[key] = value
