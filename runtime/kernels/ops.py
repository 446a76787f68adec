"""One dispatch point per op. The CPU backend is torch (reference ops plus torch's int4 CPU
matmul); GPU backends plug in here without the model changing."""

from __future__ import annotations

from runtime.kernels.cpu import int4_linear, paged_attention, prepare_int4, rms_norm

BACKEND = "cpu"

__all__ = ["BACKEND", "int4_linear", "paged_attention", "prepare_int4", "rms_norm"]
