"""The zeroed int32 counters that one-launch reductions count their finished blocks in: the
csrc GEMM's and the Triton GEMMs' split-K tiles, the csrc decode attention's partitions.

Each block of a tile stores its partial, then counts itself in on the tile's counter; the last
to arrive sums the partials in a fixed order and sets the counter back to 0. So every launch
finds its counters at zero, a CUDA graph replays without resetting them, and the sum's bits do
not depend on which block came last.

One buffer per device. Two launches counting in one tile at once would mix their counts, so
the launches that use it run one at a time: the runtime launches every kernel on one stream,
and a CUDA graph's launches run on the stream that replays it. The buffer is made, zeroed,
outside any graph capture: the engine captures one decode graph per batch bucket on torch's
capture stream, and a buffer first made inside the first capture would be zeroed only when that
graph replays, so the others could count from whatever the memory held.
"""

from __future__ import annotations

import torch

COUNTERS = 1 << 14  # per buffer unless a launch asks for more
_buffers: dict[tuple[str, int | None], torch.Tensor] = {}
# buffers outgrown by a larger launch: a captured CUDA graph may still count in one
_outgrown: list[torch.Tensor] = []


def arrival_counters(device: torch.device, size: int = COUNTERS) -> torch.Tensor:
    """At least ``size`` zeros on ``device`` (``cuda`` and ``cuda:N`` of the current device
    alike; on the CPU, where the kernels are emulated, one buffer). Inside a CUDA graph capture
    only a buffer made before it is handed out (a launch outside the capture first makes it)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index)
    found = _buffers.get(key)
    if found is None or found.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"no split-K/merge counters on {device} for {size} tiles before this CUDA graph "
                "capture: run the launch once outside the capture first (a warm-up), so that "
                "they are made and zeroed eagerly"
            )
        if found is not None:
            _outgrown.append(found)
        found = _buffers[key] = torch.zeros(max(size, COUNTERS), dtype=torch.int32, device=device)
    return found
