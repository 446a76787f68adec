"""One device identity for the backend, the KV pool, the model and every kernel check.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` name the same GPU but compare unequal,
which is how the first GPU release failed every step (``k is on cuda:0, the cache on cuda``).
Devices are resolved to an explicit index once, and compared through :func:`same_device`.
"""

from __future__ import annotations

import torch


def resolve_device(requested: str | torch.device) -> torch.device:
    """An explicit device: ``cuda`` becomes ``cuda:N`` for the current GPU. Refuses a GPU index
    that does not exist, naming the ones that do."""
    device = torch.device(requested)
    if device.type != "cuda":
        return torch.device(device.type)
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(requested)!r} needs a CUDA GPU and none is visible here")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"device {str(requested)!r}: this machine has {count} GPU(s), cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def make_current(device: torch.device) -> None:
    """Make ``device`` this thread's current GPU (nothing for the CPU). torch keeps the current
    device per thread, and the Triton and csrc kernels launch on the current device's stream:
    a thread that steps an engine on cuda:N without this launches on cuda:0, against tensors
    on cuda:N."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two devices are the same one, an unindexed ``cuda`` meaning the current GPU."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and _index(a) == _index(b)


def check_devices(
    expected: torch.device, *, owner: str = "the KV cache", **tensors: torch.Tensor
) -> None:
    """Raise ValueError naming the first tensor that is not on ``expected`` (``owner``'s
    device). A kernel handed a raw pointer to another device's memory faults, and a CUDA fault
    ends the process's use of the GPU: every later request fails too."""
    for name, t in tensors.items():
        if not same_device(t.device, expected):
            raise ValueError(f"{name} is on {t.device}, {owner} on {expected}")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: on a GPU through pinned
    memory and a non-blocking copy. A plain ``.to(cuda)``, ``torch.tensor(values,
    device=cuda)`` and indexing a GPU tensor with a Python list all copy from pageable memory
    and then synchronize the stream, stalling the host until every step queued on it has run:
    in a decode step that is overlapped scheduling's whole gain, lost."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def on_device(
    values: list[int] | list[float], device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """Host values as a tensor on ``device`` (to_device: no stream sync on a GPU)."""
    return to_device(torch.tensor(values, dtype=dtype), device)
