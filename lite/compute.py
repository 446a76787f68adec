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
from collections.abc import Iterator

import torch

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
    if device.type not in ("cpu", "cuda"):
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
