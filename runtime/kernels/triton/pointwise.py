"""The pointwise work between the Triton backend's GEMMs as one kernel each: the residual add
with the RMSNorm after it, and SiLU-and-mul (rotary is fused into the KV write, ``kv_write.py``).

Why: in torch these are several small kernels per sublayer (the add, the norm; the SiLU, the
multiply), and at batch 1 every kernel of a decode step costs its launch and tail whatever its
size. The cuda backend's csrc kernels do the same work (``csrc/rms_norm.cu``,
``csrc/silu_mul.cu``); these are the GPU fallback where nvcc or the library is missing.

Numerics, against torch's ops in the activations' dtype:

* the residual sum is computed in fp32 and rounded once to the dtype, bit for bit torch's add;
* the norm sums the squares of that rounded sum in fp32 and rounds ``x * rstd * weight`` once,
  as :func:`runtime.kernels.reference.rms_norm` does; the summation order and the GPU's
  ``rsqrt`` differ from torch's, so the output is within one step of the dtype of the
  reference, not bit for bit (``F.rms_norm``, what the unfused backend runs, itself rounds the
  normalized row before the weight multiply: it too is one step from the reference at most);
* SiLU-and-mul rounds as ``F.silu(gate) * up`` does: the SiLU in fp32 rounded to the dtype, then
  the product rounded again. Compiled, the SiLU is torch's CUDA formula with its operations:
  libdevice's ``expf`` (what CUDA's ``expf`` is) and a correctly rounded division, where
  Triton's ``exp`` and ``/`` are approximations (``ex2.approx``, ``div.full``) a few fp32 ulps
  off, enough to move a rounded SiLU by a step and the product then by two (Triton links
  libdevice flushing subnormals, which changes no SiLU of a normal gate). Interpreted (the
  interpreter has no libdevice) the SiLU is numpy's, within an fp32 ulp of torch's CPU one.

Every kernel widens its inputs to fp32 and rounds back with ``rounding.round_to``: the same
bits compiled and under the interpreter, whose own bf16 arithmetic and casts differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from runtime.device import same_device
from runtime.kernels.triton.gemm import ACTIVATION_DTYPES
from runtime.kernels.triton.launch import pdl_launch, wait_for_producers
from runtime.kernels.triton.rounding import round_to

_SILU_BLOCK = 1024  # elements of a row per SiLU-and-mul program


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_d,
    stride_s,
    stride_o,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row, the whole row in registers (a decode step has one row: its latency
    is the kernel's)."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        summed = round_to(x + d, dtype)
        tl.store(sum_ptr + row * stride_s + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, round_to(x * rstd * w, dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_g,
    stride_o,
    n,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = out_ptr.dtype.element_ty
    gate_row = gate_up_ptr + row * stride_g
    gate = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + n + offs, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:  # torch's CUDA SiLU, bit for bit (module docstring)
        act = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = round_to(act, dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, round_to(act * up, dtype), mask=mask)


def _check_rows(op: str, **tensors: torch.Tensor) -> None:
    """One activation dtype, each last dimension contiguous, one device: what the kernels
    index (the backend sends anything else to torch's ops)."""
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.dtype not in ACTIVATION_DTYPES or t.dtype != first.dtype:
            raise ValueError(
                f"{op}: {name} must be float16 or bfloat16 like the others, got "
                + ", ".join(f"{key} {x.dtype}" for key, x in tensors.items())
            )
        if t.dim() and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name}'s last dimension must be contiguous")
        if not same_device(t.device, first.device):
            raise ValueError(
                f"{op}: tensors on different devices: "
                + ", ".join(f"{key} on {x.device}" for key, x in tensors.items())
            )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [T, N] and weight [N]; without
    delta (x, rms_norm(x) * weight). The sum is torch's add bit for bit, the norm within one
    step of the dtype of ``reference.rms_norm`` (module docstring)."""
    given = {"x": x, "weight": weight} | ({} if delta is None else {"delta": delta})
    _check_rows("add_rms_norm", **given)
    if (
        x.dim() != 2
        or weight.shape != x.shape[1:]
        or (delta is not None and delta.shape != x.shape)
    ):
        shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in given.items())
        raise ValueError(f"add_rms_norm expects x [T, N], weight [N], delta [T, N]; got {shapes}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = x if delta is None else torch.empty_like(out)
    rows, n = x.shape
    if rows == 0:
        return summed, out
    block = triton.next_power_of_2(n)
    stand_in = x if delta is None else delta  # never read or written without delta
    _add_rms_norm_kernel[(rows,)](
        x, stand_in, summed, weight, out,
        x.stride(0), stand_in.stride(0), summed.stride(0), out.stride(0),
        n, eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),  # 8 elements a thread up to 4096 wide rows
        **pdl_launch(x.device),
    )  # fmt: skip
    return summed, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from gate_up [T, 2I] (gate first, as the fused gate/up GEMM writes it),
    rounded as torch's two ops round (module docstring)."""
    _check_rows("silu_mul", gate_up=gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(
            f"silu_mul expects gate_up [T, 2I] (gate and up halves), got {list(gate_up.shape)}"
        )
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), _SILU_BLOCK)
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        n,
        BLOCK=block,
        LIBDEVICE=not isinstance(_silu_mul_kernel, InterpretedFunction),  # compiled: it is there
        num_warps=4,
        **pdl_launch(gate_up.device),
    )
    return out
