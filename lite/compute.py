"""Where `lite auto_awq` computes: the device, its numerics and memory, and the facts recorded.

One code path for every device: a decoder layer's weights stream from the source shards onto
the device, calibration activations cross to it one chunk at a time, and the packed tensors
come back to the host to be written. Only the device and the chunk size differ, and neither is
part of a run's identity, so a run that ran out of GPU memory resumes with a smaller chunk or
on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.profiler import profile

from runtime import host_memory
from runtime.device import resolve_device

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
CHUNK_FLAG = "--calib-batch-size"
# torch's allocator settings (the second name is the older, CUDA-only one); a user's wins
ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


class DeviceMemoryError(ValueError):
    """The device ran out of memory; the message says which flag fixes it and that the run
    resumes where it stopped."""


def pick_device(requested: str) -> torch.device:
    """auto: the current GPU when there is one, else the CPU. `cuda` becomes `cuda:N`, and a
    missing GPU is refused with the reason (runtime.device.resolve_device)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device {requested!r}: use {DEVICE_CHOICES}") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index is not None):
        raise ValueError(f"--device {requested!r}: use {DEVICE_CHOICES}")
    return resolve_device(device)


def expandable_segments() -> bool:
    """Ask torch's CUDA allocator for expandable segments, unless the user configured it or CUDA
    is already initialized (then it is too late to matter); returns whether it was set.

    Calibration streams layers of one shape after another through chunks of another, and the
    caching allocator's fixed-size segments keep blocks that no later request fits: on the
    H200 (2026-12-04) a 4-layer Llama-3-8B-shaped run reserved 15.05 GiB. Expandable segments
    grow one mapping instead, so what is reserved stays near what tensors hold."""
    if any(name in os.environ for name in ALLOC_ENV) or torch.cuda.is_initialized():
        return False
    os.environ[ALLOC_ENV[1]] = EXPANDABLE  # the name torch 2.11-2.13 all read
    return True


def device_label(device: torch.device) -> str:
    """`cpu`, or `cuda:0 (NVIDIA H200)`: what the progress bar and the manifest name."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def cuda_version(devices: list[str]) -> str | None:
    """torch's CUDA version when a GPU calibrated (a CPU run's bytes do not depend on it)."""
    return torch.version.cuda if any(d.startswith("cuda") for d in devices) else None


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """fp32 matrix products in full fp32, whatever the process set before: TF32 would round
    the Gram matrices' inputs to 10 mantissa bits and move the searches' choices."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def free_bytes(device: torch.device) -> int | None:
    """Memory the device can still give this process (None on the CPU: not managed here).
    Blocks torch's allocator caches but does not use count as free."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can have: the GPU's free memory (as `free_bytes`), or the
    host's available memory within the process's cgroup limit (a container's)."""
    free = free_bytes(device)
    return host_memory.available_bytes() if free is None else free


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """Peak GPU memory torch's allocator reserved (what nvidia-smi shows of this process, less
    the CUDA context), or None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**30


def peak_tensors_gib(device: torch.device) -> float | None:
    """Peak GPU memory held by tensors at once: below peak_gib by what the allocator cached
    but did not use (fragmentation), so the two say whether a peak is the code's or the
    cache's. None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


@dataclass
class PeakBytes:
    """What :func:`tensor_peak` measured: the most bytes tensors held at once above the start,
    and on the CPU with `where`, the calls the process was in at that moment."""

    bytes: int = 0
    where: str | None = None


@contextlib.contextmanager
def tensor_peak(device: torch.device, where: bool = False) -> Iterator[PeakBytes]:
    """The peak of the bytes tensors held on `device` inside the block, above what they held
    when it began; filled in when the block exits.

    On a GPU torch's allocator keeps the count. On the CPU nothing does, and process RSS would
    count the allocator's caching and untouched pages, so the profiler's allocation and free
    events are summed in order: exact at the allocator, at a cost per op that calibration's
    large ops hide. It sees the frees of the block's own tensors only, so what tensors made
    before the block give back does not lower the count. `where` also records the project's
    Python calls at the peak (CPU only)."""
    result = PeakBytes()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result.bytes = torch.cuda.max_memory_allocated(device) - start
        return
    # the autograd profiler, not torch.profiler's: that one either warns (torch 2.11) or, with
    # acc_events, builds Python objects for every event when it stops (10 s a calibration layer,
    # half again its time); the raw kineto results below are all this reads
    p = profile(use_cpu=True, profile_memory=True, with_stack=where, use_kineto=True)
    with _quiet_stderr():  # the profiler's library logs its start and stop there
        p.__enter__()
    try:
        entered = time.time_ns()  # the profiler's events are stamped in Unix time too
        yield result
    finally:
        with _quiet_stderr():
            p.__exit__(None, None, None)
    events = p.kineto_results.events()
    live, at = 0, None
    for ts, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if live > result.bytes:
            result.bytes, at = live, ts
    if where and at is not None:
        result.where = _python_calls_at(_python_calls(p), entered, at)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: C++ libraries write there directly."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def _in_lite(call: str) -> bool:
    """Whether a profiled call, `path(line): name` with the path as the profiler shortens it
    (relative to sys.path, or absolute), is a function of this package."""
    return os.path.basename(os.path.dirname(call.split("(", 1)[0])) == __package__


def _python_calls(p: profile) -> list[tuple[str, int, int]]:
    """(name, start, end) of every Python call the profiler traced. From its event tree: torch
    2.11's flat event list leaves Python calls out (2.13's marks them), the tree has them in
    2.11-2.13 alike."""
    from torch._C._profiler import _EventType

    calls, nodes = [], list(p.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.PyCall:
            calls.append((node.name, node.start_time_ns, node.end_time_ns))
        nodes.extend(node.children)
    return calls


def _python_calls_at(calls: list[tuple[str, int, int]], since: int, ns: int) -> str:
    """The package's Python functions called from `since` on and running at `ns`, outermost
    first: where in the measured block the peak came."""
    running = sorted(
        (start, name)
        for name, start, end in calls
        if since <= start <= ns <= end and _in_lite(name)
    )
    return " > ".join(name.rsplit(": ", 1)[-1] for _, name in running)


def out_of_memory(
    device: torch.device, layer: int, rows: int, room: tuple[int, int | None] = (0, None)
) -> DeviceMemoryError:
    """The error a user sees instead of a CUDA traceback: what ran out, and how to go on.
    `rows` is the samples per activation chunk (0 for round-to-nearest); `room` the bytes the
    layer needs besides its activations (lite.plan) and those the device had free at the start
    (None: unknown). Where the layer alone does not fit, smaller chunks cannot help: saying
    "halve the chunk" would send the user round that loop down to 1."""
    where = f"out of memory on {device_label(device)} in decoder layer {layer}"
    if rows:
        where += f" with calibration chunks of {rows} sample(s) ({CHUNK_FLAG} {rows})"
    need, free = room
    if free is not None and need > free:
        fix = (
            f"the layer alone needs about {need / 2**30:.2f} GiB (weights, statistics, search "
            f"workspace; `lite auto_awq --dry-run` itemizes it) and {free / 2**30:.2f} GiB was "
            "free: rerun the same command with --device cpu, or on a GPU with more free memory"
        )
    elif rows > 1:
        fix = f"rerun the same command with {CHUNK_FLAG} {rows // 2}"
    else:
        fix = "rerun the same command with --device cpu"
    return DeviceMemoryError(
        f"{where}; {fix}: the run resumes at layer {layer}, the finished layers are kept"
    )
