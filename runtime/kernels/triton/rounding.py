"""fp32 to the activations' 16-bit dtype inside a Triton kernel, as torch rounds it.

bf16 under ``TRITON_INTERPRET=1`` (the CPU tests; triton 3.6 to 3.9): the interpreter stores a
bf16 value as its raw uint16 bits, so arithmetic on bf16 tensors is integer arithmetic on those
bits, and its fp32 -> bf16 conversion truncates (also when asked for ``rtne``). So kernels
widen their inputs to fp32 (exact, interpreted or compiled) and round back with
:func:`round_to`, which rounds to nearest even by integer arithmetic on the fp32 bits for bf16:
the same bits compiled and interpreted, so the CPU tests check what a GPU computes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in ``dtype`` (float16, bfloat16 or float32), as
    torch's casts and its 16-bit elementwise ops round (bf16: see the module docstring)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # carries into the exponent
        rounded = tl.where(x != x, 0x7FC0, rounded)  # a NaN stays one (torch's quiet NaN)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
