"""One dispatch point per op: the engine picks a backend once and the model calls its ops.

``cpu`` is torch (reference ops plus torch's int4 CPU matmul); ``triton`` is the GPU kernels in
``runtime/kernels/triton/`` (on a CPU only under ``TRITON_INTERPRET=1``, which the tests use);
``cuda`` (the csrc extension) is not built yet. ``auto`` takes triton on a CUDA device and the
CPU otherwise. A backend that cannot run is refused with the reason, never silently swapped.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("auto", "cpu", "triton", "cuda")
log = logging.getLogger(__name__)


class BackendError(ValueError):
    """The requested backend cannot run here."""


@dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device
    # prepare_int4(parts, k, group_size, dtype) -> weight; parts are (qweight, qparams, n)
    prepare_int4: Callable[..., Any]
    int4_linear: Callable[[torch.Tensor, Any], torch.Tensor]
    # paged_attention(q, ctx, layer, scale, sliding_window) -> [T, H, D]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # kv_write(cache, layer, k, v, slot_mapping)
    kv_write: Callable[..., None]
    # logits(x [M, K], lm_head [V, K]) -> float32 [M, V]
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dtypes: tuple[torch.dtype, ...]  # activation dtypes it supports
    detail: str = ""  # what it runs on, for logs, /health and `runtime check`


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_name(requested: str) -> str:
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "triton" if torch.cuda.is_available() and _has_triton() else "cpu"
    return requested


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(requested: str, pinned: dict[str, dict[str, dict[str, int]]]) -> Backend:
    """`pinned` is the artifact's launch.kernels (tuned configs per GPU architecture)."""
    name = resolve_name(requested)
    if name == "cpu":
        return _cpu()
    if name == "cuda":
        raise BackendError(
            "backend 'cuda' (the csrc extension) is not built in this release; use --backend "
            "triton on a GPU or --backend cpu"
        )
    if not _has_triton():
        raise BackendError("backend 'triton' needs the triton package: pip install triton")
    if not torch.cuda.is_available() and not interpreting():
        raise BackendError(
            "backend 'triton' needs a CUDA GPU (TRITON_INTERPRET=1 interprets its kernels on "
            "the CPU, for tests only); use --backend cpu here"
        )
    from runtime.kernels.triton.backend import triton_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return triton_backend(device, pinned)


def _cpu() -> Backend:
    from runtime.kernels import cpu, native

    lib, kernels = native.load()
    if lib is None:
        log.warning("CPU backend without its C decode kernels: %s", kernels)
    return Backend(
        name="cpu",
        device=torch.device("cpu"),
        prepare_int4=functools.partial(cpu.prepare_int4, lib=lib),
        int4_linear=functools.partial(cpu.int4_linear, lib=lib),
        paged_attention=functools.partial(cpu.paged_attention, lib=lib),
        rms_norm=functools.partial(cpu.rms_norm, lib=lib),
        kv_write=functools.partial(cpu.kv_write, lib=lib),
        logits=functools.partial(cpu.logits, lib=lib),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        detail=f"torch {torch.__version__} on the CPU ({torch.get_num_threads()} threads), "
        f"{kernels}",
    )
