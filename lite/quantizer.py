"""Group-wise integer weight quantization: the math that AWQ's searches and the packer share.

Weights are [N, K] (out_features, in_features); groups run along K. K need not be a multiple
of the group size: the last group is partial, and its min/max see only real columns, so the
zero padding the artifact adds later never widens a group's range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.artifact.layout import GROUP_SIZES

SUPPORTED_BITS = (4,)


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"--w-bits {self.bits} is not supported: the artifact layout and kernels are "
                f"int4; use --w-bits 4"
            )
        if self.group_size not in GROUP_SIZES:
            raise ValueError(
                f"--w-group-size {self.group_size} is not supported: choose one of "
                f"{', '.join(map(str, GROUP_SIZES))}"
            )

    @property
    def qmax(self) -> int:
        return 2**self.bits - 1


@dataclass
class QuantizedWeight:
    """Integer codes with per-(row, group) parameters: w ~= (q - zero) * scale."""

    q: torch.Tensor  # uint8 [N, K], values 0..qmax
    scale: torch.Tensor  # fp32 [N, G]
    zero: torch.Tensor  # int32 [N, G]


def num_groups(k: int, group_size: int) -> int:
    return math.ceil(k / group_size)


def _group_range(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, group) min and max over the real columns only."""
    n, k = w.shape
    pad = num_groups(k, group_size) * group_size - k
    lo = torch.nn.functional.pad(w, (0, pad), value=math.inf).view(n, -1, group_size)
    hi = torch.nn.functional.pad(w, (0, pad), value=-math.inf).view(n, -1, group_size)
    return lo.amin(-1), hi.amax(-1)


def expand_groups(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """[N, G] per-group values -> [N, K] per-column values."""
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def compute_params(
    w: torch.Tensor, spec: QuantSpec, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per (row, group); `clip_ratio` shrinks the range toward zero."""
    w_min, w_max = _group_range(w.float(), spec.group_size)
    w_min, w_max = w_min * clip_ratio, w_max * clip_ratio
    if spec.symmetric:
        half = 2 ** (spec.bits - 1)
        scale = (torch.maximum(w_max.abs(), w_min.abs()) / (half - 1)).clamp(min=1e-8)
        zero = torch.full_like(scale, half, dtype=torch.int32)
    else:
        # The range always holds zero (as GPTQ does): a one-signed or constant group then
        # still gets a zero point inside 0..qmax instead of a clamped, wrong one.
        w_min, w_max = w_min.clamp(max=0), w_max.clamp(min=0)
        scale = ((w_max - w_min) / spec.qmax).clamp(min=1e-8)
        zero = (-torch.round(w_min / scale)).clamp(0, spec.qmax).to(torch.int32)
    return scale, zero


def quantize(
    w: torch.Tensor, spec: QuantSpec, clip_ratio: torch.Tensor | float = 1.0
) -> QuantizedWeight:
    scale, zero = compute_params(w, spec, clip_ratio)
    k = w.shape[1]
    s = expand_groups(scale, spec.group_size, k)
    z = expand_groups(zero, spec.group_size, k)
    q = (torch.round(w.float() / s) + z).clamp(0, spec.qmax).to(torch.uint8)
    return QuantizedWeight(q=q, scale=scale, zero=zero)


def dequantize(qw: QuantizedWeight, group_size: int) -> torch.Tensor:
    k = qw.q.shape[1]
    s = expand_groups(qw.scale, group_size, k)
    z = expand_groups(qw.zero, group_size, k)
    return (qw.q.float() - z) * s


def fake_quantize(
    w: torch.Tensor, spec: QuantSpec, clip_ratio: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """Quantize and dequantize in fp32: what the searches score candidates with."""
    return dequantize(quantize(w, spec, clip_ratio), spec.group_size)
