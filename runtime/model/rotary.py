"""Rotary position embedding tables, including Llama-3's frequency scaling.

Uses the rotate-half convention of Hugging Face checkpoints (the first and second halves of
each head are the two components of a rotation), which is the convention the artifact keeps.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_SCALING = ("default", "linear", "llama3")


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(
        f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_SCALING)}"
    )


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    """Long wavelengths slowed by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class Rotary:
    """cos/sin tables for every position up to `max_positions`, computed once."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        inv = inv_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.cos = angles.cos().to(device, dtype)
        self.sin = angles.sin().to(device, dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim/2] for a step's positions: looked up once, used by every
        layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
