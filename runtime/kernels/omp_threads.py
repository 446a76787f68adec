"""The OpenMP threads a CPU engine's steps run with, when another thread loads the model.

`runtime serve` loads single-threaded and steps on a thread of its own (below). Whatever the
CPU backend measures at load for its steps (its dispatch table: cpu_dispatch.py) must be
measured with the steps' thread count, not the loader's one thread: the crossovers between
the C kernels and torch's move with the thread count, and a table measured with one thread
would be used with all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")
_engine_threads: int | None = None  # set while a single-threaded load is under way


@contextmanager
def openmp_left_to_the_engine_thread() -> Iterator[None]:
    """Load the model with torch single-threaded, so that the engine thread's OpenMP team is
    the process's only one.

    libgomp spins at its barriers only while a process has no more OpenMP threads than cores.
    Loading with the full thread count leaves the loading thread a team of its own for good;
    the engine thread's team then comes on top, its spinning is throttled to nothing, and its
    workers sleep and wake at each of a step's hundreds of parallel regions. Measured on
    SmolLM2 (2 cores, AVX-512): a batch-1 step ran at 56 tok/s on a thread of its own
    against 88-95 in the thread that had loaded the model. Not for a tensor-parallel rank 0,
    whose loading sets its own share of the cores."""
    global _engine_threads
    threads = torch.get_num_threads()
    _engine_threads = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _engine_threads = None


def engine_threads() -> int:
    """The thread count the engine's steps will run with."""
    return _engine_threads or torch.get_num_threads()


def with_threads(threads: int, fn: Callable[[], T]) -> T:
    """fn() run with `threads` OpenMP threads. Where the caller runs with another count, fn
    runs on a thread of its own: its team ends with that thread (libgomp frees a finished
    thread's pool), so the process keeps one team."""
    if threads == torch.get_num_threads():
        return fn()
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        before = torch.get_num_threads()  # the process-wide count new threads start from
        torch.set_num_threads(threads)
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the caller
            failure.append(e)
        finally:
            torch.set_num_threads(before)

    helper = threading.Thread(target=run, name="liteserve-measure")
    helper.start()
    helper.join()
    if failure:
        raise failure[0]
    return result[0]
