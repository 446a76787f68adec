"""A request as the engine sees it: tokens, progress through the KV cache, and its output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import llguidance
import torch

from runtime.engine.detokenizer import Detokenizer
from runtime.engine.sampler import SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LAST_TOKEN = "last_token"  # its last id is being read back: no further step (overlap)
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    generator: torch.Generator | None = None
    matcher: llguidance.LLMatcher | None = None  # the grammar's state (structured output)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # leading tokens whose KV is in the cache
    num_cached: int = 0  # of the prompt, taken from the prefix cache at admission
    status: Status = Status.WAITING
    text: str = ""
    emitted: int = 0  # characters of `text` already handed to a stream
    finish_reason: str | None = None
    error: str | None = None  # why it finished with finish_reason "error" (the grammar failed)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logits: list[torch.Tensor] | None = None  # kept whole instead, for Engine.score
    preemptions: int = 0
    first_scheduled: float | None = None  # perf_counter at first admission (queue time)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    def prompt_rows(self) -> int:
        """Prompt positions whose next-token result is already recorded."""
        if self.prompt_logits is not None:
            return sum(len(t) for t in self.prompt_logits)
        return len(self.prompt_logprobs)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def in_prefill(self) -> bool:
        """Tokens before the last one still lack KV (the prompt, or everything after a
        preemption): they are computed in chunks before decoding resumes."""
        return self.num_computed < len(self.token_ids) - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
