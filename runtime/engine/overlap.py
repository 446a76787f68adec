"""Overlapped scheduling: the host prepares step N+1 while the device still runs step N.

A decode step on a GPU is queued in well under a millisecond, but reading its sampled ids back
waits for the whole step, and after it come the host's scheduling, step inputs, detokenizing
and stop checks: without overlap the GPU idles through all of that every step. With overlap
the engine queues step N+1 first, its decoding rows' input ids taken on the device from step
N's sampled ids (a placeholder stands in the token list meanwhile), and only then reads step
N's ids and does its host work while step N+1 runs (as mini-sglang's overlap scheduler and
vLLM's async scheduling do). A sequence that step N finishes (EOS, a stop string) has one more
row computed in step N+1, which is dropped.

Rows whose next step needs step N's token on the host are not overlapped: a grammar's mask
needs the matcher to have consumed it, and repetition/presence/frequency penalties count it.
Nothing else reads the device back before that: the logprobs come back with the ids, and on a
GPU the sampler sorts top-k/top-p rows whole instead of widening a candidate set (whose check
would read back; runtime.engine.sampler.widens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.device import on_device
from runtime.engine.sampler import BatchLogprobs, TokenLogprobs
from runtime.engine.scheduler import Batch
from runtime.engine.sequence import Sequence

PLACEHOLDER = -1  # a sampled id still on the device, in a sequence's token list


@dataclass
class TokenFeed:
    """Input ids a step takes from the previous step's sampled ids, on the device."""

    tokens: torch.Tensor  # the previous step's sampled ids, on the device
    rows: dict[int, int]  # seq_id -> its row in ``tokens``


@dataclass
class FeedRows:
    """Where a step's input ids come from a TokenFeed: ``ids[dst] = feed.tokens[src]``."""

    feed: TokenFeed
    dst: list[int]
    src: list[int]

    def apply(self, ids: torch.Tensor) -> None:
        """Queued on the device, after the step's metadata copy (no host sync)."""
        k, tokens = len(self.dst), self.feed.tokens
        if k == 0:
            return
        if self.dst == self.src == list(range(k)):  # the same batch again: one copy
            ids[:k].copy_(tokens[:k])
            return
        dev = ids.device
        taken = tokens[on_device(self.src, dev)]
        ids[on_device(self.dst, dev)] = taken.to(ids.dtype)


@dataclass
class PendingStep:
    """A step queued on the device whose sampled ids the host has not read yet."""

    batch: Batch
    chunk_logits: list[torch.Tensor | None]  # per sequence: its prompt-logprob rows
    sampled: list[Sequence]  # the sequences whose last token was computed: one row each
    tokens: torch.Tensor  # their sampled ids, on the device
    logprobs: BatchLogprobs  # the ones they asked for, on the device
    _host: torch.Tensor | None = None
    _copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        """Start copying the ids and logprobs to the host now, behind this step's work, so
        that reading them waits for this step only and not for a step queued after it."""
        if self.tokens.device.type != "cuda":
            return
        self._host = _pinned(self.tokens)
        self.logprobs = self.logprobs.map(_pinned)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def feed(self) -> TokenFeed:
        return TokenFeed(self.tokens, {s.seq_id: j for j, s in enumerate(self.sampled)})

    def read(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled ids and their logprobs, once this step has run."""
        if self._copied is None:
            return self.tokens.tolist(), self.logprobs.lists()
        self._copied.synchronize()
        return self._host.tolist(), self.logprobs.lists()


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, queued on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def overlappable(step: PendingStep) -> bool:
    """Whether the next step may be queued before this one's ids are read: none of its
    sampled rows keeps host state that the next step's sampling reads."""
    return not any(
        s.matcher is not None
        or s.params.repetition_penalty != 1.0
        or s.params.presence_penalty
        or s.params.frequency_penalty
        for s in step.sampled
    )
