"""The tensor-parallel ranks above 0: one process each, started and watched by rank 0.

Rank 0 (the engine's process) keeps the scheduler, the block manager and the sampler; each
worker holds only its slice of the model and its KV heads' pool, and runs the same forward as
rank 0 on every step rank 0 sends, meeting it in the collectives. A worker that dies is seen
two ways, so nothing hangs: a monitor thread on rank 0 waits on the workers' process sentinels
(the health check: it knows at once, and says which rank and how it ended), and every
collective has a timeout (for a rank that is alive but stuck).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.artifact.reader import Artifact
from runtime.config import EngineConfig
from runtime.device import resolve_device
from runtime.distributed.group import START_SECONDS, RankFailure, TPGroup
from runtime.distributed.shard import Shard, plan_shards

log = logging.getLogger("liteserve")
STOP_SECONDS = 10.0  # a worker asked to stop that has not exited by then is killed


def rank_device(config: EngineConfig, backend: str, rank: int) -> str:
    """Rank r's device: the CPU for the cpu backend, --device cpu, or --device auto where there
    is no GPU; else the r-th GPU from the one asked for (cuda:N, or the first), which
    Workers.start checks exists (a --device cuda without a GPU is refused, not run on the
    CPU)."""
    no_gpu = config.device == "auto" and not torch.cuda.is_available()
    if backend == "cpu" or config.device == "cpu" or no_gpu:
        return "cpu"
    base = int(config.device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def _shard(artifact: Artifact, config: EngineConfig, rank: int) -> Shard:
    m = artifact.manifest
    return plan_shards(m.architecture, m.quantization.group_size, config.tp)[rank]


class Workers:
    """Rank 0's handle on the other ranks: it sends them each step, watches them, stops them."""

    def __init__(
        self,
        procs: list[mp.Process],
        group: TPGroup,
        shard: Shard,
        device: str,
        timeout: float,
    ) -> None:
        self.procs, self.group, self.shard, self.device = procs, group, shard, device
        self.timeout = timeout  # seconds a step send may take: the collective timeout
        self.failure: str | None = None  # set once, by the monitor or a failed collective
        self.on_failure: list[Callable[[str], None]] = []  # e.g. the server stopping itself
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="liteserve-tp", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, artifact: Artifact, config: EngineConfig) -> Workers:
        """Plan the shards (refusing a model the ranks cannot split before anything starts),
        start ranks 1..tp-1 and join the group as rank 0. `config` has the artifact's launch
        defaults filled in."""
        shard = _shard(artifact, config, 0)
        backend = config.backend_from(artifact.manifest.launch)
        devices = [rank_device(config, backend, r) for r in range(config.tp)]
        for d in devices:  # every rank's GPU exists, before any process starts
            try:
                resolve_device(d)
            except ValueError as e:
                raise ValueError(
                    f"--tp {config.tp} runs one rank per GPU, {devices[0]} to {devices[-1]}: {e}; "
                    "use a --tp no larger than the GPUs from --device on, or --backend cpu"
                ) from e
        device = devices[0]
        store = TPGroup.store(config.tp)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked threads or GPU state
        procs = [
            ctx.Process(
                target=main,
                args=(rank, artifact.path, config, store.port),
                name=f"liteserve-tp{rank}",
                daemon=True,
            )
            for rank in range(1, config.tp)
        ]
        for p in procs:
            p.start()
        try:
            _await_joins(store, procs)
            group = TPGroup(0, config.tp, store, torch.device(device), config.tp_timeout)
        except Exception:
            for p in procs:
                p.kill()
            raise
        log.info("tensor parallel: %d ranks, workers %s", config.tp, [p.pid for p in procs])
        workers = cls(procs, group, shard, device, config.tp_timeout)
        atexit.register(workers.stop)  # a clean stop before multiprocessing kills its children
        return workers

    def _watch(self) -> None:
        """The health check: wake when a worker process ends; unless we asked it to, that is
        a failure, reported at once to whoever listens (the server stops itself)."""
        pending = {p.sentinel: p for p in self.procs}
        while pending and not self._stopping.is_set():
            for sentinel in wait(list(pending), timeout=1.0):
                proc = pending.pop(sentinel)
                if self._stopping.is_set():
                    return
                self._fail(f"{_describe(proc)}; the engine cannot go on without every rank")

    def _fail(self, message: str) -> None:
        if self.failure is not None:
            return
        self.failure = message
        log.error("tensor parallel: %s", message)
        for callback in self.on_failure:
            callback(message)

    def send(self, step: object) -> None:
        """Send the step to every worker, after checking they are all alive."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        self.group.broadcast(step, self.timeout)

    def failed(self, error: RankFailure) -> RankFailure:
        """The error to raise for a failed collective: which rank died, if one did (its exit
        shows up within moments of the broken connection), else the collective's own error.
        Final: every later step raises it too."""
        ended = wait([p.sentinel for p in self.procs], timeout=2.0)
        dead = [p for p in self.procs if p.sentinel in ended]
        self._fail(_describe(dead[0]) if dead else str(error))
        return RankFailure(self.failure)

    def left_mid_step(self) -> None:
        """Rank 0 left a step (Ctrl-C) while the others wait in its collectives: no step can
        run any more, and stop() kills them rather than waiting out the collective timeout
        (60 s) for a stop message they cannot read."""
        if self.failure is None:
            self.failure = "rank 0 left a step unfinished (interrupted)"

    def abort(self, error: Exception) -> Exception:
        """Start-up failed on rank 0: kill the workers; the error to raise (a failed
        collective becomes the rank that died)."""
        if isinstance(error, RankFailure):
            error = self.failed(error)
        else:
            self._fail(f"rank 0 failed to start: {error}")
        self.stop()
        return error

    def stop(self) -> None:
        """Ask every worker to leave its loop and end the group; after a failure (a rank dead
        or stuck) kill them instead: none of them can finish a step any more."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.stop)
        if self.failure is None:
            try:
                self.group.broadcast(None, self.timeout)
            except RankFailure:
                log.warning("tensor parallel: a worker was gone before the stop")
        for p in self.procs:
            p.join(STOP_SECONDS if self.failure is None else 0)
            if p.exitcode is None:
                p.kill()
                p.join()
        self.group.close()


def _await_joins(store: dist.Store, procs: list[mp.Process]) -> None:
    """Wait until every worker has started and is about to join the group, watching them:
    one that dies on the way (a bad install, no memory) is an error now, not a rendezvous
    that waits out its timeout."""
    keys = [f"joining/{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + START_SECONDS
    while not store.check(keys):
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            why = (  # a signal is from outside (the OOM killer, a kill); an exit, its own error
                ""
                if dead[0].exitcode < 0
                else " (its error is above, on stderr; a script that makes a tp > 1 engine "
                "needs its code under `if __name__ == '__main__':`, since each worker is a new "
                "process that imports the script)"
            )
            raise RankFailure(f"{_describe(dead[0])} while starting{why}")
        if time.monotonic() > deadline:
            raise RankFailure(f"the tensor-parallel workers did not start in {START_SECONDS} s")
        time.sleep(0.05)


def _describe(proc: mp.Process) -> str:
    # Its sentinel fires when the kernel closes its files, a moment before the exit status can
    # be read, and join() returns at once on a ready sentinel: poll for the status instead.
    deadline = time.monotonic() + 2.0
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
    code = proc.exitcode
    if code is None:
        how = "closed its connection"
    else:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    return f"tensor-parallel rank {proc.name.removeprefix('liteserve-tp')} (pid {proc.pid}) {how}"


def main(rank: int, path: Path, config: EngineConfig, port: int) -> None:
    """A worker process: join the group, load this rank's slice, then run every step rank 0
    sends until it sends None (or its connection breaks: rank 0 is gone)."""
    from runtime.engine.engine import load_rank
    from runtime.model.context import step_context

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    artifact = Artifact(path, checksums=False)  # rank 0 verified it
    device = rank_device(config, config.backend_from(artifact.manifest.launch), rank)
    store = TPGroup.store(config.tp, port)
    store.set(f"joining/{rank}", "1")
    group = TPGroup(rank, config.tp, store, torch.device(device), config.tp_timeout)
    r = load_rank(artifact, config, device, _shard(artifact, config, rank), group)
    try:
        while (step := group.broadcast(None)) is not None:
            with step_context(r.ops.prepare_step(step), r.cache):
                r.model()
    except RankFailure as e:
        log.error("%s", e)
        raise SystemExit(1) from e
    group.close()
