"""The tensor-parallel process group: its setup, the collectives the model calls, and the
timeouts that turn a dead or stuck rank into an error instead of a hang.

Two groups over the same ranks. The compute group (NCCL on GPUs, gloo on the CPU) carries the
model's all-reduces and the logits gather, under the collective timeout: inside a step every
rank is a layer away from the next collective, so a rank that has not arrived by then is dead
or stuck. The control group (always gloo, host objects) carries each step's batch from rank 0;
an idle worker waits there for as long as the server is idle, so its timeout is long, and it
learns of rank 0's end from the closed connection, not from a clock.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.kernels.ops import StepInputs

HOST = "127.0.0.1"  # one machine: every rank is a local process
CONTROL_TIMEOUT = timedelta(days=365)
START_SECONDS = 600.0  # for a worker to start and connect: an interpreter, torch, the store


class RankFailure(RuntimeError):
    """A rank died or a collective timed out: a tensor-parallel engine cannot go on without
    every rank, so this is final."""


class TPGroup:
    """This process's membership of the group, as rank `rank` of `size`."""

    def __init__(
        self, rank: int, size: int, store: dist.Store, device: torch.device, timeout: float
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process; close it first"
            )
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
            device_id=device if device.type == "cuda" else None,
        )
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if device.type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))

    @staticmethod
    def store(size: int, port: int = 0) -> dist.TCPStore:
        """Rank 0 serves the rendezvous store (port 0: a free one, read back from .port); the
        other ranks connect to its port."""
        return dist.TCPStore(
            HOST,
            port,
            size,
            is_master=port == 0,
            timeout=timedelta(seconds=START_SECONDS),
            wait_for_workers=False,
        )

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise RankFailure(f"rank {self.rank}: the {what} failed: {e}") from e

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self._run("all-reduce", dist.all_reduce, x)
        return x

    def gather_vocab(self, logits: torch.Tensor, width: int, vocab: int) -> torch.Tensor | None:
        """Every rank's logits over its vocabulary slice (rank r: ids from r * width), joined
        into [M, vocab] on rank 0 (None elsewhere). Slices are padded to `width`, as a gather
        needs equal shapes."""
        part = torch.nn.functional.pad(logits, (0, width - logits.shape[1])).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.size)] if self.rank == 0 else None
        self._run("logits gather", dist.gather, part, parts, dst=0)
        return None if parts is None else torch.cat(parts, dim=1)[:, :vocab]

    def broadcast(self, step: StepInputs | None, timeout: float | None = None) -> StepInputs | None:
        """Rank 0's step (None: stop) on every rank: rank 0 sends it as JSON (a size, then the
        bytes; never pickle, which would let whoever reaches the group's port run code in the
        ranks) and gives up after `timeout` seconds, as a rank that does not take a step
        within the collective timeout is stuck; the others wait as long as the group's timeout
        allows (an idle server sends nothing)."""
        size = torch.tensor([0], dtype=torch.int64)
        if self.rank == 0:
            fields = None if step is None else dataclasses.asdict(step)
            data = bytearray(json.dumps(fields).encode())
            size[0] = len(data)
        self._wait("step broadcast", size, timeout)
        payload = torch.frombuffer(data, dtype=torch.uint8) if self.rank == 0 else None
        if payload is None:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._wait("step broadcast", payload, timeout)
        if self.rank == 0:
            return step
        fields = json.loads(payload.numpy().tobytes())
        return None if fields is None else StepInputs(**fields)

    def _wait(self, what: str, t: torch.Tensor, timeout: float | None) -> None:
        work = self._run(what, dist.broadcast, t, 0, group=self.control, async_op=True)
        limit = None if timeout is None else timedelta(seconds=timeout)
        self._run(what, work.wait, *(() if limit is None else (limit,)))

    def min(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks: each pool must hold them).
        Waits for every rank to get here: after loading, so under the start-up limit."""
        t = torch.tensor([value], dtype=torch.int64)
        work = self._run(
            "agreement", dist.all_reduce, t, op=dist.ReduceOp.MIN, group=self.control, async_op=True
        )
        self._run("agreement", work.wait, timedelta(seconds=START_SECONDS))
        return int(t)

    def close(self) -> None:
        dist.destroy_process_group()
