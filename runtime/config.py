"""EngineConfig: every knob of the serving engine, validated once, in one place.

Names follow LMDeploy's TurbomindEngineConfig where the meaning is the same, so settings carry
over from a command line people already have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from runtime.artifact.manifest import (
    BACKENDS,
    BLOCK_MULTIPLE,
    DEFAULT_BLOCK_SEQ_LEN,
    MIN_PREFILL_TOKENS,
    MIN_SESSION_LEN,
)
from runtime.kv.format import KV_QUANT

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    session_len: int | None = None  # None: the artifact's launch config
    kv_quant: str | None = None  # none/int8/int4; None: the artifact's launch config
    cache_block_seq_len: int | None = None  # None: the artifact's launch config (recipe)
    cache_max_entry_count: float = 0.8  # fraction of free memory (RAM on CPU) for the KV pool
    num_blocks: int | None = None  # explicit pool size, overrides cache_max_entry_count
    max_batch_size: int | None = None  # None: the artifact's launch config (recipe)
    # Per-step token budget (chunked prefill beyond it); None: the launch config's.
    max_prefill_token_num: int | None = None
    enable_prefix_caching: bool = False
    # None: the artifact's launch config; auto: cuda where its library runs, triton, then cpu
    backend: str | None = None
    dtype: str = "auto"  # activation dtype; auto = the fastest measured for the backend
    # the CPU backend's int8 activations (llama.cpp's Q8 scheme) on the linears and lm_head
    # where measured faster; False: float math only, what evaluation measures (an env of
    # LITESERVE_CPU_INT8=0 turns them off for every engine)
    int8_activations: bool = True
    # auto, cpu, cuda or cuda:N; auto = the backend's (the current GPU); a torch.device is
    # taken as its string
    device: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs: every decode step runs eagerly
    # Queue step N+1 before reading step N's ids (runtime.engine.overlap); None: on a GPU.
    overlap_schedule: bool | None = None
    verify_checksums: bool = True
    tp: int = 1  # tensor-parallel ranks, one process each (1: this process alone, no collectives)
    tp_timeout: float = 60.0  # seconds a rank waits in a collective before the engine fails

    def __post_init__(self) -> None:
        """torch.device("cpu") is how Python callers name a device: as its string it is one of
        the names the engine takes (it failed in validate() with an AttributeError)."""
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))

    def validate(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> ValueError:
            return ValueError(f"{name}={value!r} is invalid: expected {allowed}")

        for name in _INT_FIELDS:  # a string or a float here failed later as a TypeError
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(name, value, "an integer")
        for name in _NUMBER_FIELDS:  # a string failed in the range check as a bare TypeError
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise bad(name, value, "a number")
        for name in _BOOL_FIELDS:  # "no" is truthy: it turned overlap_schedule on
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name in _OPTIONAL and value is None):
                raise bad(name, value, "True, False or None" if name in _OPTIONAL else "a bool")
        if self.kv_quant is not None and self.kv_quant not in KV_QUANT:
            raise bad("kv_quant", self.kv_quant, " or ".join(KV_QUANT))
        if self.backend is not None and self.backend not in BACKENDS:
            raise bad("backend", self.backend, ", ".join(BACKENDS))
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, ", ".join(DTYPES))
        if not _device_ok(self.device):
            raise bad("device", self.device, "auto, cpu, cuda or cuda:N")
        if self.session_len is not None and self.session_len < MIN_SESSION_LEN:
            raise bad("session_len", self.session_len, f"an integer >= {MIN_SESSION_LEN}")
        block = self.cache_block_seq_len
        if block is not None and (block < 1 or block % BLOCK_MULTIPLE):
            raise bad("cache_block_seq_len", block, f"a positive multiple of {BLOCK_MULTIPLE}")
        self._check_block_within_session()
        if not 0 < self.cache_max_entry_count <= 1:
            raise bad("cache_max_entry_count", self.cache_max_entry_count, "a fraction in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise bad("num_blocks", self.num_blocks, "a positive integer")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise bad("max_batch_size", self.max_batch_size, "a positive integer")
        if self.tp < 1:
            raise bad("tp", self.tp, "a positive integer")
        if self.tp > 1 and self.overlap_schedule:
            raise ValueError(
                "overlap_schedule is not supported with tp > 1 (the other ranks take each "
                "step's token ids from the host); leave it unset or turn it off"
            )
        if not 0 < self.tp_timeout < float("inf"):  # NaN fails this too
            raise bad("tp_timeout", self.tp_timeout, "a positive number of seconds")
        prefill = self.max_prefill_token_num
        if prefill is not None and prefill < MIN_PREFILL_TOKENS:
            raise bad("max_prefill_token_num", prefill, f"an integer >= {MIN_PREFILL_TOKENS}")

    def _check_block_within_session(self) -> None:
        """A block never holds tokens of two sessions, so a block longer than one session is
        memory no sequence can use: --cache-block-seq-len 1048576 took 13 GB for a 4096-token
        session. The limit is the session rounded up to a legal block length, and never below
        the default block, so short sessions keep it (the evaluators' windows do)."""
        block, session = self.cache_block_seq_len, self.session_len
        if block is None or session is None:
            return  # checked again once the launch config fills them in
        limit = max(-(-session // BLOCK_MULTIPLE) * BLOCK_MULTIPLE, DEFAULT_BLOCK_SEQ_LEN)
        if block > limit:
            raise ValueError(
                f"cache_block_seq_len={block} is larger than session_len={session}: a block "
                f"never holds more than one session; choose at most {limit}"
            )

    def backend_from(self, launch: Any) -> str:
        """The backend asked for: this config's, else the one the artifact's launch config
        pins (usually auto)."""
        return launch.backend if self.backend is None else self.backend

    def with_launch_defaults(self, launch: Any) -> EngineConfig:
        """Fill what the user left unset from the artifact's pinned launch config (the
        recipe's serving fields land there)."""
        return replace(
            self,
            session_len=self.session_len or launch.session_len,
            kv_quant=self.kv_quant or launch.kv_quant,
            cache_block_seq_len=self.cache_block_seq_len or launch.cache_block_seq_len,
            max_batch_size=self.max_batch_size or launch.max_batch_size,
            max_prefill_token_num=self.max_prefill_token_num or launch.max_prefill_tokens,
        )


_INT_FIELDS = (
    "session_len",
    "cache_block_seq_len",
    "num_blocks",
    "max_batch_size",
    "max_prefill_token_num",
    "tp",
)
_NUMBER_FIELDS = ("cache_max_entry_count", "tp_timeout")
_BOOL_FIELDS = (
    "enable_prefix_caching",
    "enforce_eager",
    "int8_activations",
    "overlap_schedule",
    "verify_checksums",
)
_OPTIONAL = ("overlap_schedule",)  # None: decided by the device


def _device_ok(device: Any) -> bool:
    if not isinstance(device, str):
        return False
    if device in ("auto", "cpu", "cuda"):
        return True
    kind, _, index = device.partition(":")
    return kind == "cuda" and index.isdigit()
