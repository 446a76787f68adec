"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on sm_90 and
later, opt-in: ``LITESERVE_TRITON_PDL=1``.

At batch 1 a decode step is about 150 small launches (9 a layer), so each boundary's launch
latency and tail show. With PDL a kernel may start while the one before it in the stream is
still running: it waits (``griddepcontrol.wait``) before touching anything an earlier kernel
wrote, then at once lets the next kernel launch (``griddepcontrol.launch_dependents``). The
one-row GEMM first asks L2 for its first group of weights, which no kernel writes, so its
weight stream starts during the kernel before it. CUDA graphs keep these as programmatic
edges. The csrc backend does the same (``LITESERVE_CUDA_PDL``, on by default); here it stays
off until a GPU has timed it (`evals/bench/engine_gpu.py` runs the A/B).

A kernel launched this way after one that never lets it go early (torch's) simply starts when
that one ends, and a normal launch after a PDL kernel waits for it to end, so mixing is safe.
One setting per process, as the csrc library's: the backend sets it at start."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENV = "LITESERVE_TRITON_PDL"  # "1": programmatic dependent launch on sm_90+

_enabled = [False]  # this process's setting (set_programmatic_launch)


def set_programmatic_launch(device: torch.device) -> bool:
    """Turn PDL on for this process's launches when the environment asks for it and the device
    is a CUDA GPU of compute capability 9.0 or later (griddepcontrol is sm_90 PTX)."""
    on = os.environ.get(PDL_ENV) == "1" and device.type == "cuda"
    _enabled[0] = on and torch.cuda.get_device_capability(device)[0] >= 9
    return _enabled[0]


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of a launch on ``device``: the kernels' PDL constexpr, and Triton's
    ``launch_pdl`` option where it is on (never under the interpreter, which runs on the CPU)."""
    if _enabled[0] and device.type == "cuda":
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """First in a kernel launched with :func:`pdl_launch`: wait for the kernels before it,
    then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask, base, PDL: tl.constexpr):
    """Ask L2 for the lines of ``ptrs`` where ``mask`` (``base`` elsewhere: a valid address of
    the same tensor), before :func:`wait_for_producers`: only for data no kernel of the step
    writes (weights). A hint: nothing waits for it."""
    if PDL:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];",
            "=r,l",
            [tl.where(mask, ptrs, base)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
