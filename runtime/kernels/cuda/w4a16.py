"""One W4A16 linear on the csrc library, as :mod:`gemm_plan` planned it: the fused GEMM (with its
split-K workspace) or the weights dequantized in the activation dtype and a dense GEMM on them.

The one caller of the GEMM's entry points: the cuda backend, ``lite tune`` and
``evals/bench/cuda_gemm.py`` run their plans through it, so what is tuned and benchmarked is
what serves. Kernels launch on torch's current stream (CUDA graphs capture them); on the CPU
(``emulated``, tests only) the library's ``lsq_emulate_*`` twins run the same code.
"""

from __future__ import annotations

import ctypes

import torch

from runtime.device import check_devices
from runtime.kernels.counters import arrival_counters
from runtime.kernels.cuda.gemm_plan import DequantPlan, Plan
from runtime.kernels.cuda.library import check
from runtime.kv.format import STORAGE_KINDS


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def dequantize(
    lib: ctypes.CDLL,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    emulated: bool,
) -> torch.Tensor:
    """W_hat [n, k] in ``dtype``: the weights the fused GEMM multiplies, bit for bit."""
    check_devices(qweight.device, owner="the weights", qparams=qparams)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    args = (qweight.data_ptr(), qparams.data_ptr(), w.data_ptr(), w.stride(0), n, k, group_size)
    args += (STORAGE_KINDS[dtype],)
    if emulated:
        status = lib.lsq_emulate_w4a16_dequantize(*args)
    else:
        status = lib.lsq_w4a16_dequantize(*args, _stream(w.device))
    check(lib, status, "lsq_w4a16_dequantize")
    return w


def linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    qweight: torch.Tensor,
    qparams: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    plan: Plan,
    emulated: bool,
) -> torch.Tensor:
    """y [m, n] = x [m, k] @ W_hat^T in x's dtype (fp16 or bf16; x's rows may be strided)."""
    check_devices(qweight.device, owner="the weights", x=x, qparams=qparams)
    if isinstance(plan, DequantPlan):
        w = dequantize(lib, qweight, qparams, n, k, group_size, x.dtype, emulated)
        return torch.nn.functional.linear(x, w)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    workspace = (
        torch.empty(plan.workspace_floats, dtype=torch.float32, device=x.device)
        if plan.workspace_floats
        else None
    )
    stream = 0 if emulated else _stream(x.device)
    counters = arrival_counters(x.device) if workspace is not None else None
    args = (x.data_ptr(), x.stride(0), qweight.data_ptr(), qparams.data_ptr(), y.data_ptr())
    args += (y.stride(0), None if workspace is None else workspace.data_ptr())
    args += (None, 0) if counters is None else (counters.data_ptr(), counters.numel())
    args += (m, n, k, group_size, STORAGE_KINDS[x.dtype], plan.config, plan.split_k)
    # emulated: cp.async copies land at their wait
    run = lib.lsq_emulate_w4a16_gemm if emulated else lib.lsq_w4a16_gemm
    status = run(*args, 0 if emulated else stream)
    check(lib, status, "lsq_w4a16_gemm")
    return y
