"""The step's batch metadata, set once per forward and read where it is needed (attention),
instead of threading it through every module's forward signature."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from runtime.kernels.ops import StepTensors
from runtime.kv.cache import KVCache


@dataclass
class StepContext:
    """A step runs the new tokens of several sequences, concatenated without padding: their
    device tensors (built by the backend) and the pool they read and write."""

    step: StepTensors
    cache: KVCache


_current: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _current
    _current = ctx


@contextmanager
def step_context(step: StepTensors, cache: KVCache) -> Iterator[None]:
    """The step a model forward inside the block reads."""
    set_context(StepContext(step, cache))
    try:
        yield
    finally:
        set_context(None)


def get_context() -> StepContext:
    if _current is None:
        raise RuntimeError("model forward called outside a step (no StepContext set)")
    return _current
