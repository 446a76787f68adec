"""The zeroed int32 counters that one-launch reductions count their finished blocks in: the
csrc GEMM's and the Triton GEMMs' split-K tiles, the csrc decode attention's partitions.

Each block of a tile stores its partial, then counts itself in on the tile's counter; the last
to arrive sums the partials in a fixed order and sets the counter back to 0. So every launch
finds its counters at zero, a CUDA graph replays without resetting them, and the sum's bits do
not depend on which block came last. Launches on one stream run in order, but two streams
could count into one tile at once, so each (device, stream) has its own buffer.
"""

from __future__ import annotations

import torch

COUNTERS = 1 << 14  # per buffer unless a launch asks for more
_buffers: dict[tuple[str, int | None, int], torch.Tensor] = {}
# buffers outgrown by a larger launch: a captured CUDA graph may still count in one
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, size: int = COUNTERS) -> torch.Tensor:
    """At least ``size`` zeros on ``device`` for launches on torch's current stream there (the
    one a CUDA graph captures; on the CPU, where the kernels are emulated, one buffer)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    found = _buffers.get(key)
    if found is None or found.numel() < size:
        if found is not None:
            _outgrown.append(found)
        found = _buffers[key] = torch.zeros(max(size, COUNTERS), dtype=torch.int32, device=device)
    return found
