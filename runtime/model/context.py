"""The step's batch metadata, set once per forward and read where it is needed (attention),
instead of threading it through every module's forward signature."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.engine.kv_cache import KVCache


@dataclass
class DecodeBatch:
    """The step's single-token sequences, laid out for one batched attention per layer."""

    rows: torch.Tensor  # int64 [B]: their rows in the step
    blocks: torch.Tensor  # int64 [B, NB]: block tables, padded with block 0
    valid: torch.Tensor  # bool [B, NB * block_size]: real (and in-window) positions
    lens: torch.Tensor  # int64 [B]: tokens in each sequence's KV after this step


@dataclass
class KernelTensors:
    """The step's metadata as device tensors, for the GPU kernels (built once per step)."""

    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with block 0
    context_lens: torch.Tensor  # int32 [S]
    cu_query_lens: torch.Tensor  # int32 [S + 1]
    all_decode: bool  # every sequence has one new token


@dataclass
class StepContext:
    """A step runs the new tokens of several sequences, concatenated without padding."""

    positions: torch.Tensor  # int64 [T]: absolute position of each new token
    slot_mapping: torch.Tensor  # int64 [T]: KV slot each new token writes
    block_tables: list[torch.Tensor]  # per sequence, int64 block ids
    context_lens: list[int]  # per sequence: tokens in its KV after this step
    query_lens: list[int]  # per sequence: new tokens in this step
    logits_indices: torch.Tensor  # int64: rows of the step whose logits are wanted
    cache: KVCache
    decode: DecodeBatch | None = None  # set when some sequences decode (query_len 1)
    tensors: KernelTensors | None = None  # set for the GPU backends


_current: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _current
    _current = ctx


def get_context() -> StepContext:
    if _current is None:
        raise RuntimeError("model forward called outside a step (no StepContext set)")
    return _current
