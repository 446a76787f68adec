"""The engine on its own thread, fed by asyncio request handlers.

The engine is synchronous and owns its state; only its thread touches it. Handlers send
commands (add, abort) through a thread-safe queue and receive per-step updates on an asyncio
queue per request. A step that raises fails only the requests it was running, and the loop
goes on: one bad request never takes the server down. The failure is kept until a step
succeeds, so /health can say the engine is failing instead of answering ok while every request
errors (as it did on a GPU whose every step raised).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams, TokenLogprobs
from runtime.engine.sequence import Sequence
from runtime.server.metrics import Metrics

log = logging.getLogger("liteserve")


@dataclass
class Update:
    """What one request gained in one step."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None
    error_status: int = 500  # 503: shutting down, the client may retry; 400: its own grammar failed


def merge(updates: list[Update]) -> Update:
    """Consecutive updates of one request as one (the last one's finish reason)."""
    last = updates[-1] if updates else Update("", [], [], None, 0, 0)
    first = updates[0] if updates else last
    return replace(
        last,
        text="".join(u.text for u in updates),
        token_ids=[t for u in updates for t in u.token_ids],
        logprobs=[x for u in updates for x in u.logprobs],
        prompt_tokens=max(u.prompt_tokens for u in updates) if updates else 0,
        prompt_logprobs=first.prompt_logprobs,
        cached_tokens=max(u.cached_tokens for u in updates) if updates else 0,
    )


def _deliver(items: list[tuple[asyncio.Queue, Update]]) -> None:
    for out, update in items:
        out.put_nowait(update)


@dataclass(frozen=True)
class StepFailure:
    """The engine's steps are failing: the last one raised and none has succeeded since."""

    message: str  # the last failure, "ExceptionType: text"
    at: float  # time.time() of the last failure
    count: int  # steps failed since the last success


@dataclass
class _Stream:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    arrival: float
    hold: int  # characters held back while a stop string may be forming
    scored_only: bool = False  # echo with max_tokens 0: its one token is run, never returned
    sent_tokens: int = 0
    sent_logprobs: int = 0
    first_token: float | None = None
    last_token: float | None = None


class ServerClosing(Exception):
    """The server is shutting down and admits nothing more: a 503 its client may retry."""


class Updates:
    """One admitted request's updates until it finishes. aclose() aborts it if it has not
    finished, read or not (an async generator closed before it started would skip its
    cleanup, and the request would run to its end)."""

    def __init__(self, owner: AsyncEngine, seq_id: int, out: asyncio.Queue) -> None:
        self._owner = owner
        self.seq_id = seq_id
        self._out = out
        self._pending: deque[Update] = deque()
        self._done = False
        owner._open.add(self)

    def fail(self, message: str) -> None:
        """End the reader with a 503 now, on the event loop: the engine thread may be in a
        step longer than the time left before uvicorn cancels the handler."""
        self._out.put_nowait(Update("", [], [], None, 0, 0, error=message, error_status=503))

    def _finish(self) -> None:
        self._done = True
        self._owner._open.discard(self)

    def __aiter__(self) -> Updates:
        return self

    async def __anext__(self) -> Update:
        if self._done:
            raise StopAsyncIteration
        if not self._pending:
            self._pending.append(await self._out.get())
        while not self._out.empty():
            self._pending.append(self._out.get_nowait())
        update = AsyncEngine._next(self._pending)
        if update.finish_reason is not None or update.error is not None:
            self._finish()
        return update

    async def aclose(self) -> None:
        self._finish()
        self._owner.abort(self.seq_id)


class AsyncEngine:
    probe_interval = 5.0  # seconds between probe requests while the steps are failing

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liteserve-engine", daemon=True)
        self.alive = False
        self.failure: StepFailure | None = None  # written by the engine thread only
        self._last_probe = float("-inf")
        # the event loop's side, touched on the loop only: what fail_in_flight must end
        self.closing: str | None = None
        self._open: set[Updates] = set()
        self._admitting: set[asyncio.Future] = set()

    def start(self) -> None:
        self.metrics.sync_engine(self.engine)  # an idle pool's gauges before any step: all free
        self.alive = True
        self._thread.start()

    def down(self) -> str | None:
        """Why this engine can never serve again, or None: its thread ended, or a
        tensor-parallel rank died (until a request's step found it, /health said ok and Ray
        Serve kept the replica, every request a 500)."""
        if not self.alive or not self._thread.is_alive():
            return "the engine thread is not running"
        workers = self.engine.workers
        return None if workers is None else workers.failure

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        self.alive = False

    async def submit(
        self, requests: list[tuple[list[int], SamplingParams]], scored_only: bool = False
    ) -> list[Updates]:
        """Admit requests (prompt ids, params) together, in one command: the engine adds them
        between two steps, so the n choices or prompts of one API request start in the same
        step. Raises ValueError (nothing admitted) if the engine refuses any of them. Returns
        once they are admitted, not when they have a token: a client that leaves while they
        wait for a slot can then be seen leaving, and they are aborted. `scored_only`: the
        requests score their prompts (echo, max_tokens 0), so the token each runs is not
        counted as generated, as the usage does not count it."""
        if self.closing is not None:
            raise ServerClosing(self.closing)
        loop = asyncio.get_running_loop()
        outs: list[asyncio.Queue] = [asyncio.Queue() for _ in requests]
        added: Future = Future()
        self.metrics.submitted(len(requests))
        self._inbox.put(("add", requests, loop, outs, added, scored_only, time.perf_counter()))
        admitted, closing = asyncio.wrap_future(added), loop.create_future()
        self._admitting.add(closing)
        try:
            await asyncio.wait({admitted, closing}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller left while the engine thread was busy
            admitted.cancel()  # in the engine thread's queue still: it is skipped
            added.add_done_callback(self._abort_admitted)  # else aborted once admitted
            raise
        finally:
            self._admitting.discard(closing)
        if not admitted.done():  # the server's grace ran out before a step admitted them
            admitted.cancel()
            added.add_done_callback(self._abort_admitted)
            raise ServerClosing(closing.result())
        seqs = admitted.result()
        updates = [Updates(self, seq.seq_id, out) for seq, out in zip(seqs, outs, strict=True)]
        if self.closing is not None:  # admitted in the same turn of the loop as the failing
            for u in updates:
                u.fail(self.closing)
        return updates

    def _abort_admitted(self, added: Future) -> None:
        """Requests admitted for a caller that was cancelled meanwhile: nobody reads them."""
        if not added.cancelled() and added.exception() is None:
            for seq in added.result():
                self._inbox.put(("abort", seq.seq_id))

    def fail_in_flight(self, message: str) -> None:
        """End every request with an error now (the server's grace period is running out):
        their clients get a 503 or a stream's error event instead of a cut connection. Called
        on the event loop, which answers them at once; the engine thread aborts them when
        its step ends."""
        self.closing = message
        for closing in self._admitting:
            if not closing.done():
                closing.set_result(message)
        for updates in list(self._open):
            updates.fail(message)
        self._inbox.put(("fail", message))

    def abort(self, seq_id: int) -> None:
        """Stop a request that has not finished (a finished one is left alone)."""
        if seq_id in self._streams:
            self._inbox.put(("abort", seq_id))

    @staticmethod
    def _next(pending: deque[Update]) -> Update:
        """The updates that arrived while the request's reader was busy, as one: a server
        that falls behind the engine sends fewer, longer chunks instead of a growing backlog
        (each chunk costs the event loop about the same whatever its length). An error is
        never merged into text: the text before it goes first."""
        run: list[Update] = []
        while pending and pending[0].error is None:
            run.append(pending.popleft())
            if run[-1].finish_reason is not None:
                break
        return merge(run) if len(run) > 1 else run[0] if run else pending.popleft()

    def probe(self) -> None:
        """While the steps are failing, ask for a one-token request at most every
        probe_interval seconds. A server that a load balancer took out of rotation for failing
        gets no traffic, so without a probe no step would ever run to show it recovered."""
        now = time.monotonic()
        if self.failure is not None and now - self._last_probe >= self.probe_interval:
            self._last_probe = now
            self._inbox.put(("probe",))

    # ---- engine thread ----

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                ready = self.engine.step()
            except Exception as e:  # fail the running requests, keep serving the rest
                log.exception("engine step failed")
                self._record_failure(f"{type(e).__name__}: {e}")
                continue
            self.failure = None
            now = time.perf_counter()
            outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]] = {}
            for seq in ready:
                self._publish(seq, now, outbox)
            # one wake-up of each request loop per step, not one per sequence
            for loop, items in outbox.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # that loop has closed: its readers are gone
                    log.debug("updates for a closed event loop dropped")
            self.metrics.sync_engine(self.engine)
        self._fail_all("the server is shutting down")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            self._add(*cmd[1:])
        elif cmd[0] == "fail":
            self._fail_all(cmd[1])
        elif cmd[0] == "probe":
            self._add_probe()
        elif cmd[0] == "abort" and (st := self._streams.pop(cmd[1], None)) is not None:
            self.engine.abort(cmd[1])
            # ended, as a finished one is: both series count it (the docs' "per sequence")
            self.metrics.requests.labels("abort").inc()
            self.metrics.e2e.observe(time.perf_counter() - st.arrival)
            self.metrics.sync_engine(self.engine)

    def _add(
        self,
        requests: list[tuple[list[int], SamplingParams]],
        loop: asyncio.AbstractEventLoop,
        outs: list[asyncio.Queue],
        added: Future,
        scored_only: bool,
        arrival: float,
    ) -> None:
        """All of a submission's requests, or none: one refused (ValueError) or failing takes
        out the ones added before it, which have not run a step yet."""
        self.metrics.submitted(-len(requests))
        if not added.set_running_or_notify_cancel():  # its caller was cancelled meanwhile
            return
        seqs: list[Sequence] = []
        try:
            for prompt_ids, params in requests:
                seqs.append(self.engine.add_request(prompt_ids, params, scored_only))
        except Exception as e:  # that submission fails, never the engine thread
            if not isinstance(e, ValueError):  # a refusal is the client's; anything else ours
                log.exception("admitting a request failed")
            for seq in seqs:
                self.engine.abort(seq.seq_id)
            added.set_exception(e)
            return
        # the latencies count from the submission, not from this admission: the engine thread
        # reads its inbox between steps, and a CPU prefill step takes seconds
        for seq, out, (_, params) in zip(seqs, outs, requests, strict=True):
            hold = max((len(s) for s in params.stop), default=1) - 1
            self._streams[seq.seq_id] = _Stream(seq, loop, out, arrival, hold, scored_only)
        # a prompt once, as the usage counts it: the n choices of one share its list
        shared = {id(ids): len(ids) for ids, _ in requests}
        self.metrics.prompt_tokens.inc(sum(shared.values()))
        self.metrics.sync_engine(self.engine)  # running and waiting now, not after the step
        added.set_result(seqs)

    def _add_probe(self) -> None:
        """One greedy token from a one-token prompt, with no stream: its step clears or renews
        the failure. Only while the engine is idle: otherwise real steps answer already."""
        if self.failure is None or self.engine.has_work():
            return
        params = self.engine.sampling_params(max_new_tokens=1, temperature=0, ignore_eos=True)
        try:
            self.engine.add_request([0], params)
        except Exception:
            log.exception("admitting the health probe failed")

    def _publish(
        self,
        seq: Sequence,
        now: float,
        outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]],
    ) -> None:
        st = self._streams.get(seq.seq_id)
        if st is None:
            return
        new_tokens = seq.output_ids[st.sent_tokens :]
        if not st.scored_only:
            self.metrics.generation_tokens.inc(len(new_tokens))
        if st.first_token is None:
            st.first_token = now
            self.metrics.ttft.observe(now - st.arrival)
            self.metrics.queue.observe((seq.first_scheduled or now) - st.arrival)
        else:
            self.metrics.itl.observe(now - st.last_token)
        st.last_token = now
        if seq.error is not None:  # the request's own failure: a 400, not a success
            del self._streams[seq.seq_id]
            update = Update("", [], [], None, seq.num_prompt, 0, error=seq.error, error_status=400)
            outbox.setdefault(st.loop, []).append((st.out, update))
            return
        done = seq.finish_reason is not None
        end = len(seq.text) if done else max(seq.emitted, len(seq.text) - st.hold)
        update = Update(
            text=seq.text[seq.emitted : end],
            token_ids=new_tokens,
            logprobs=seq.logprobs[st.sent_logprobs :],
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt,
            cached_tokens=seq.num_cached,
            prompt_logprobs=seq.prompt_logprobs if st.sent_tokens == 0 else [],
        )
        seq.emitted = end
        st.sent_tokens += len(new_tokens)
        st.sent_logprobs = len(seq.logprobs)
        if done:
            del self._streams[seq.seq_id]
            self.metrics.requests.labels(seq.finish_reason).inc()
            self.metrics.e2e.observe(now - st.arrival)
        outbox.setdefault(st.loop, []).append((st.out, update))

    def _record_failure(self, message: str) -> None:
        """Fail the requests the step was running, and keep the failure for /health."""
        count = 1 if self.failure is None else self.failure.count + 1
        self.failure = StepFailure(message, time.time(), count)
        # A step that raised before it ran anything (in scheduling) would raise again on the
        # same queue forever: then the requests it was admitting fail instead.
        failed = self.engine.running_ids() or list(self.engine.sequences)
        for seq_id in failed:
            self._fail(seq_id, f"internal error: {message}")
        self.metrics.sync_engine(self.engine)

    def _fail_all(self, message: str) -> None:
        """The server is stopping: every request ends, with a status its client may retry."""
        for seq_id in list(self._streams):
            self._fail(seq_id, message, 503)

    def _fail(self, seq_id: int, message: str, status: int = 500) -> None:
        st = self._streams.pop(seq_id, None)
        self.engine.abort(seq_id)
        if st is not None:
            update = Update(
                "", [], [], None, st.seq.num_prompt, 0, error=message, error_status=status
            )
            st.loop.call_soon_threadsafe(st.out.put_nowait, update)
