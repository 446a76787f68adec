"""What the GPU backends (triton, cuda) share: the artifact's packed weights as they are on
disk, fused by concatenation, and the step's metadata in one device buffer.

Linears that share an input (q/k/v, gate/up) are fused by concatenating their packed tensors
along N: every part is already padded to whole 64-column tiles, so the concatenation is itself
a valid ``lsq4-mma16x16-v1`` matrix and no weight is repacked. When a part's N is not a
multiple of 64 the fused output carries its padding columns, which one index_select drops.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import torch

from runtime.kernels.ops import Backend, StepInputs, StepTensors

log = logging.getLogger("runtime.kernels")

N_TILE = 64
_ALIGN = 4  # int32 elements in 16 bytes
_INT32 = next(code for code in "ilh" if array(code).itemsize == 4)  # C int on every platform


def int32_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int32 tensor of a list of ints. torch.tensor walks a list element by element in
    Python; array's C loop is about 10x faster on a decode step's metadata (10k values at batch
    256: 2.9 ms of host time per step before, measured on the 2-core EPYC)."""
    if not values:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(array(_INT32, values), dtype=torch.int32)


def gpu_arch(device: torch.device) -> str:
    """The key tuned configs are stored under: the CUDA compute capability, e.g. ``sm_90``."""
    if device.type != "cuda":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def gemm_key(n: int, k: int, bucket: int) -> str:
    """Pinned-config key of one GEMM shape and row bucket: ``w4a16/N{n}xK{k}/m{bucket}``."""
    return f"w4a16/N{n}xK{k}/m{bucket}"


def fused_n(ns: list[int]) -> int:
    """Columns the GEMM of fused linears computes: one part's logical N, or the parts' padded
    widths side by side (their concatenated packed tensors)."""
    return ns[0] if len(ns) == 1 else sum(-(-n // N_TILE) * N_TILE for n in ns)


@dataclass
class FusedInt4:
    """Packed linears sharing an input, concatenated along N, on the device."""

    qweight: torch.Tensor  # int32 [Kp / 16, 2 * Np_total], the artifact's words
    qparams: torch.Tensor  # fp16 [Kp / gs, Np_total, 2]
    n: int  # columns the GEMM computes (sum of padded parts, or the one part's logical N)
    k: int
    group_size: int
    columns: torch.Tensor | None  # logical columns to keep, None when all are


def fuse_int4(
    parts: list[tuple[torch.Tensor, torch.Tensor, int]],
    k: int,
    group_size: int,
    device: torch.device,
) -> FusedInt4:
    """parts are (qweight, qparams, n) of linears sharing an input."""
    qweight = torch.cat([qw for qw, _, _ in parts], dim=1).to(device)
    qparams = torch.cat([qp for _, qp, _ in parts], dim=1).to(device)
    n = fused_n([part_n for *_, part_n in parts])
    columns = None
    if len(parts) > 1 and any(p % N_TILE for *_, p in parts):
        keep, start = [], 0
        for qw, _, part_n in parts:
            keep.append(torch.arange(start, start + part_n))
            start += qw.shape[1] // 2
        columns = torch.cat(keep).to(device)
    return FusedInt4(qweight, qparams, n, k, group_size, columns)


@dataclass
class KernelTensors:
    """The GPU kernels' attention metadata: views of one device buffer (see StepBuffer)."""

    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with block 0
    context_lens: torch.Tensor  # int32 [S]
    cu_query_lens: torch.Tensor  # int32 [S + 1]
    all_decode: bool  # every sequence has one new token: the flash-decoding kernel


class HostStaging:
    """Lists of ints into a device tensor through one pinned host buffer, asynchronously.

    The host buffer is reused step after step. Under overlapped scheduling (the engine fills
    step N+1 while the device runs step N) step N's copy may still be waiting in the stream
    when the host fills the buffer again, so each fill first waits for the previous copy (an
    event, not the stream: step N's kernels keep running)."""

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.int32, pin_memory=cuda)
        # an event never recorded synchronizes at once (torch creates it on first record)
        self._copied = torch.cuda.Event() if cuda else None

    def copy(self, values: list[int], dev: torch.Tensor) -> None:
        """dev[:len(values)] = values, queued on the current stream."""
        n = len(values)
        if self._copied is not None:
            self._copied.synchronize()
        self._host[:n].copy_(int32_tensor(values))
        dev[:n].copy_(self._host[:n], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class StepBuffer:
    """A step's metadata in one int32 device buffer, filled by one host-to-device copy (seven
    small copies and their allocations per step were host time the GPU waited on)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = HostStaging(0, device)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)

    def _reserve(self, n: int) -> None:
        if self._dev.numel() >= n:
            return
        size = max(n, 2 * self._dev.numel(), 4096)
        self._staging = HostStaging(size, self.device)
        self._dev = torch.empty(size, dtype=torch.int32, device=self.device)

    def fill(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Device views of ``parts`` (lists of ints), in order, after one copy. Each part
        starts 16-byte aligned: Triton specializes kernels on pointer alignment, and a view
        whose alignment changed from step to step would compile a kernel variant mid-serving."""
        sizes = [len(x) for x in parts]
        padded = [-(-n // _ALIGN) * _ALIGN for n in sizes]
        total = sum(padded)
        self._reserve(total)
        flat: list[int] = []
        for x, room in zip(parts, padded, strict=True):
            flat += x
            flat += [0] * (room - len(x))
        dev = self._dev[:total]
        self._staging.copy(flat, dev)
        return [v[:n] for v, n in zip(dev.split(padded), sizes, strict=True)]


class GpuBackend(Backend):
    """The parts of a GPU backend that do not depend on its kernels."""

    graphs = True  # captured on a GPU; under the Triton interpreter the same buffers, eager

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer = StepBuffer(device)
        # the Triton kernels' programmatic launch, whichever backend launches them (opt-in);
        # imported here: the engine imports this module, and a CPU host has no triton
        from runtime.kernels.triton.launch import set_programmatic_launch

        self.triton_pdl = set_programmatic_launch(device)

    def default_dtype(self) -> torch.dtype:
        """bf16 on a GPU (fp16's range overflows on some models' activations) that has it in
        hardware (sm_80+; before, torch emulates it and Triton's dots do not compile in it);
        under the Triton interpreter fp16, which numpy computes exactly where its bf16 support
        is incomplete."""
        if self.device.type != "cuda":
            return torch.float16
        with torch.cuda.device(self.device):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)  # fused on GPUs

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return (x @ weight.T).float()  # cuBLAS

    def prepare_step(self, step: StepInputs) -> StepTensors:
        width = max(len(t) for t in step.block_tables)
        tables = [t + [0] * (width - len(t)) for t in step.block_tables]
        cu = [0, *itertools.accumulate(step.query_lens)]
        ids, pos, slots, rows, lens, cu_t, flat = self._buffer.fill(
            [
                step.input_ids,
                step.positions,
                step.slot_mapping,
                step.logits_indices,
                step.context_lens,
                cu,
                [b for t in tables for b in t],
            ]
        )
        attn = KernelTensors(flat.view(len(tables), width), lens, cu_t, step.all_decode)
        return StepTensors(ids, pos, slots, rows, attn)

    def decode_attn(self, block_tables: torch.Tensor, context_lens: torch.Tensor) -> Any:
        """Metadata of an all-decode step over static buffers (what a CUDA graph replays)."""
        cu = torch.arange(block_tables.shape[0] + 1, dtype=torch.int32, device=self.device)
        return KernelTensors(block_tables, context_lens, cu, True)

    def linear_out(self, y: torch.Tensor, w: FusedInt4) -> torch.Tensor:
        """The GEMM's output without the padding columns of fused parts."""
        return y if w.columns is None else y.index_select(1, w.columns)


def rows_of_one_dtype(dtypes: Container[torch.dtype], *tensors: torch.Tensor) -> bool:
    """Whether a backend's fused pointwise kernels take these as they are: one dtype of
    ``dtypes`` (what they compute in), and rows whose last dimension is contiguous (anything
    else runs torch's ops)."""
    dtype = tensors[0].dtype
    return dtype in dtypes and all(t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


def log_pinned(key: str, pinned: dict, kernels: dict, fallback: str) -> None:
    """Say at start whether the artifact pins GEMM configs for this GPU (launch.kernels[key]),
    and what runs instead when it does not."""
    if pinned:
        log.info("pinned GEMM configs for %s: %d", key, len(pinned))
        return
    tuned = ", ".join(sorted(kernels)) or "none"
    log.warning(
        "the artifact has no tuned kernel configs for %s (tuned for: %s); using %s. "
        "`lite tune ARTIFACT` on this GPU pins them.",
        key,
        tuned,
        fallback,
    )
