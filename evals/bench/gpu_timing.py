"""Kernel times on a GPU as a decode step sees them: back to back inside one CUDA graph, each
launch reading its operands from HBM.

Timing one launch per graph replay (what the kernel benchmarks did until 2026-12-05) has two
biases that grow as kernels shrink. Each replay is a host call (torch's `CUDAGraph.replay`, a
graph launch): a kernel shorter than that leaves the GPU idle between replays, so its figure is
the host's, not the kernel's (on the H200 machine of 2026-12-04 nothing timed that way came in
under 7 us). And the same operands read replay after replay stay in L2 (50-60 MB on an
H100/H200), where in a decode step each layer's weights, and each sequence's KV, are read once
per step from HBM. So one graph here holds ROUND_CALLS launches or more (short ones: a launch
that outlasts the host's part of the next needs no company), cycling through copies of the
operands that together exceed L2_MULTIPLE times the device's L2 (as quack's and Triton's
benchmarks rotate or flush), and a launch's time is the replay's over the launches in it.
Kernels that use programmatic dependent launch overlap the one before them there, as they do in
a step.

`launch_floor_ms` times the old way's floor: one tiny kernel a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ROUND_CALLS = 16  # launches one graph holds at least
L2_MULTIPLE = 3  # copies of the operands cover this many times the L2
MAX_COPIES = 32
DEFAULT_L2_BYTES = 50 * 2**20  # an H100's, where torch does not report it
REPLAYS = 20
TARGET_MS = 20.0  # GPU time the timed replays should take, about
LONG_MS = 0.2  # a launch at least this long hides the host's part of the next: no repeats
TIMING = f"launches back to back in CUDA graphs, operands rotated over {L2_MULTIPLE}x the L2"


def copies_for(nbytes: int, device: torch.device) -> int:
    """How many copies of operands of ``nbytes`` a round cycles through so that none is still in
    L2 when it comes round again: at least 1, at most MAX_COPIES (1 on a CPU)."""
    if device.type != "cuda" or nbytes <= 0:
        return 1
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES
    return max(1, min(MAX_COPIES, -(-L2_MULTIPLE * l2 // nbytes)))


def graph_ms(calls: Callable[[], object] | Sequence[Callable[[], object]]) -> float:
    """Milliseconds per launch of ``calls`` (one call, or one per copy of the operands), captured
    in order in one graph and replayed. Each call runs once eagerly first (compiles, autotuning,
    allocations), then once more, timed: a bound on a launch that decides how many rounds the
    graph holds (enough for ROUND_CALLS launches unless a launch outlasts the host's part,
    LONG_MS) and how often it is replayed (about TARGET_MS of GPU time, 3 to REPLAYS times)."""
    distinct = [calls] if callable(calls) else list(calls)
    for call in distinct:
        call()
    torch.cuda.synchronize()
    eager = _elapsed_ms(lambda: [call() for call in distinct]) / len(distinct)
    rounds = 1 if eager > LONG_MS else -(-ROUND_CALLS // len(distinct))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in distinct:
                call()
    launches = rounds * len(distinct)
    replays = max(3, min(REPLAYS, int(TARGET_MS / max(eager * launches, 1e-3))))
    return _replay_ms(graph, replays) / launches


def launch_floor_ms(device: torch.device) -> float:
    """Milliseconds per replay of a graph of one 1-element add: what timing a single launch per
    replay cannot go below on this host (the figures before 2026-12-05 include it)."""
    t = torch.zeros(1, device=device)
    t.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t.add_(1)
    return _replay_ms(graph, 10 * REPLAYS)


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay, after 3 untimed ones."""
    for _ in range(3):
        graph.replay()
    return _elapsed_ms(lambda: [graph.replay() for _ in range(replays)]) / replays


def _elapsed_ms(work: Callable[[], object]) -> float:
    """GPU milliseconds between events recorded before and after ``work``'s launches."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)
