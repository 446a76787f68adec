"""`lite tune`: pin the W4A16 GEMM's launches for this GPU into the artifact's manifest.

Every distinct GEMM the runtime will run (the fused q/k/v and gate/up shapes included, as the
GPU backends build them) is timed over the backend's candidates at each row bucket, and the
winner is written under the GPU's architecture: ``sm_90`` for the triton backend's configs,
``cuda/sm_90`` for the cuda backend's (tile config and split-K, or the dequantized path). A
server then starts without autotuning and always runs the same kernels. The artifact's
weights, and so its checksums, are untouched: only manifest.json changes, by an atomic replace
of the manifest as it is then, with only this backend's key set (see pin_kernels).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from runtime.artifact.manifest import TUNED_BACKENDS
from runtime.artifact.reader import Artifact, read_manifest
from runtime.artifact.writer import write_manifest
from runtime.device import resolve_device
from runtime.kernels.ops import interpreting
from runtime.model.llama import FUSED_LINEARS

log = logging.getLogger("lite.tune")


class TuneError(ValueError):
    """Tuning cannot run here."""


@dataclass(frozen=True)
class Shape:
    n: int  # columns the GEMM computes (fused_n of its parts)
    k: int
    names: tuple[str, ...]  # the artifact linears of one instance, for real packed tensors


def gemm_shapes(artifact: Artifact) -> list[Shape]:
    """Distinct GEMM shapes of the runtime's fused linears, first instance of each."""
    from runtime.kernels.gpu import fused_n

    tensors = artifact.manifest.tensors
    seen: dict[tuple[int, int], Shape] = {}
    for i in range(artifact.manifest.architecture.num_layers):
        for parts in FUSED_LINEARS.values():
            names = tuple(f"model.layers.{i}.{p}" for p in parts)
            shapes = [tensors[f"{name}.qweight"].logical_shape for name in names]
            key = (fused_n([n for n, _ in shapes]), shapes[0][1])
            seen.setdefault(key, Shape(*key, names))
    return list(seen.values())


def check_device() -> torch.device:
    if torch.cuda.is_available():
        return resolve_device("cuda")  # cuda:N: kernel checks compare explicit indices
    if interpreting():
        return torch.device("cpu")
    raise TuneError(
        "lite tune times the GPU kernels and needs a CUDA GPU (TRITON_INTERPRET=1 runs it "
        "interpreted on the CPU, which only tests the plumbing)"
    )


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: triton's do_bench on a GPU, the median wall time otherwise."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=10, rep=reps * 5))

    def wall(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall


@dataclass
class Tuner:
    """What tuning one backend's GEMM takes: its weights as the backend prepares them, its
    candidates per row count (each with ``to_dict``, the pinned form), a call of one, and where
    its winners go in ``launch.kernels``."""

    kernels_key: str
    prepare: Callable[[list, int, int], Any]  # (parts, k, group_size) -> weight
    space: Callable[[int, Any], list]  # (rows, weight) -> candidates, best guess first
    call: Callable[[torch.Tensor, Any, Any], object]  # (x, weight, candidate)


def triton_tuner(device: torch.device, max_configs: int | None) -> Tuner:
    """The Triton GEMM's config space (tile shapes, split-K, warps, stages; one compile each),
    and past the decode rows the dequantized path."""
    from runtime.kernels.gpu import gpu_arch
    from runtime.kernels.triton.backend import prepare_weight
    from runtime.kernels.triton.gemm import tune_space, w4a16_linear

    return Tuner(
        gpu_arch(device),
        lambda parts, k, gs: prepare_weight(parts, k, gs, device, {}),
        lambda m, w: tune_space(m, w.n, w.k, w.group_size, max_configs),
        lambda x, w, cfg: w4a16_linear(x, w.qweight, w.qparams, w.n, w.k, w.group_size, cfg),
    )


def cuda_tuner(dtype: torch.dtype, max_configs: int | None) -> Tuner:
    """The csrc GEMM's launches as the planner ranks them (tile config and split-K, and past
    the decode rows the dequantized weights with a dense GEMM, always timed there: the model's
    least certain choice). No compiles, so the whole ranking is cheap to time."""
    from runtime.kernels.cuda import gemm_plan as gp
    from runtime.kernels.cuda import w4a16
    from runtime.kernels.ops import BackendError, select_backend

    try:
        backend = select_backend("cuda", {})
    except BackendError as e:
        raise TuneError(f"cannot tune the cuda backend: {e}") from e

    def space(m: int, w: Any) -> list:
        plans = gp.ranked(
            backend.configs, m, w.n, w.k, w.group_size, backend.sm_count, backend.plan_arch
        )
        chosen = plans[:max_configs]
        dequant = gp.DequantPlan(m, w.n, w.k)
        return chosen + [dequant] if dequant in plans and dequant not in chosen else chosen

    return Tuner(
        f"cuda/{backend.arch}",
        lambda parts, k, gs: backend.prepare_int4(parts, k, gs, dtype),
        space,
        lambda x, w, plan: w4a16.linear(
            backend.lib, x, w.qweight, w.qparams, w.n, w.k, w.group_size, plan, backend.emulated
        ),
    )


def tuner_for(
    backend: str, device: torch.device, dtype: torch.dtype, max_configs: int | None
) -> Tuner:
    """``auto``: the backend `runtime serve --backend auto` would run here, cuda when the csrc
    library loads, else triton; without a CUDA device (Triton interpreted) triton, since
    emulating cuda first built its library for every architecture, minutes of nvcc."""
    if backend not in TUNED_BACKENDS:
        raise TuneError(f"unknown backend {backend!r}: expected one of {', '.join(TUNED_BACKENDS)}")
    if backend == "cuda":
        return cuda_tuner(dtype, max_configs)
    if backend == "auto" and device.type == "cuda":
        try:
            return cuda_tuner(dtype, max_configs)
        except TuneError as e:
            log.info("tuning the triton backend: %s", e)
    return triton_tuner(device, max_configs)


def _fastest(
    x: torch.Tensor, w: Any, space: list, call: Callable, timer: Callable[[Callable], float]
) -> tuple[float, Any]:
    timed = []
    for cand in space:
        try:
            ms = timer(lambda c=cand: call(x, w, c))
        except Exception as e:  # a config the compiler rejects on this GPU
            log.debug("candidate %s failed: %s", cand, e)
            continue
        timed.append((ms, cand))
    if not timed:
        raise TuneError(f"no candidate ran for N={w.n} K={w.k} M={x.shape[0]}")
    return min(timed, key=lambda t: t[0])


def tune(
    path: Path,
    buckets: tuple[int, ...] | None = None,
    max_configs: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 5,
    progress: Callable[[str], None] = log.info,
    backend: str = "auto",
) -> dict[str, dict[str, int]]:
    """Time the candidates per shape and bucket; write the winners under the backend's key
    (``sm_90`` for triton, ``cuda/sm_90`` for cuda); return them by GEMM key. The open-ended
    last bucket (512+) is timed at the artifact's max_prefill_tokens rows, the size of the
    prefill chunks it mostly serves."""
    from runtime.kernels.gpu import gemm_key
    from runtime.kernels.triton.gemm import M_BUCKETS

    device = check_device()
    bad = [b for b in buckets or () if b not in M_BUCKETS]
    if bad:
        raise TuneError(f"buckets {bad} are not among the runtime's row buckets {M_BUCKETS}")
    artifact = Artifact(path)
    manifest = artifact.manifest
    gs = manifest.quantization.group_size
    tuner = tuner_for(backend, device, dtype, max_configs)
    timer = _timer(device, reps)
    winners: dict[str, dict[str, int]] = {}
    for shape in gemm_shapes(artifact):
        parts = [
            (
                artifact.tensor(f"{name}.qweight"),
                artifact.tensor(f"{name}.qparams"),
                manifest.tensors[f"{name}.qweight"].logical_shape[0],
            )
            for name in shape.names
        ]
        w = tuner.prepare(parts, shape.k, gs)
        for bucket in buckets or M_BUCKETS:
            rows = bucket
            if bucket == M_BUCKETS[-1]:
                rows = max(bucket, manifest.launch.max_prefill_tokens)
            x = torch.randn(rows, shape.k, device=device, dtype=dtype)
            ms, best = _fastest(x, w, tuner.space(rows, w), tuner.call, timer)
            winners[gemm_key(shape.n, shape.k, bucket)] = best.to_dict()
            progress(f"N={shape.n} K={shape.k} M={rows}: {ms:.4f} ms with {best.to_dict()}")
    pin_kernels(artifact.path, tuner.kernels_key, winners)
    return winners


def pin_kernels(path: Path, key: str, winners: dict[str, dict[str, int]]) -> None:
    """Set ``launch.kernels[key]`` in the manifest as it is now, under a lock beside the
    artifact: writing back the manifest read before minutes of timing lost the pins that
    another tune (of another backend) wrote meanwhile."""
    root = path.resolve()
    with FileLock(root.with_name(f".{root.name}.manifest.lock")):
        manifest = read_manifest(root)
        kernels = {**manifest.launch.kernels, key: winners}
        launch = manifest.launch.model_copy(update={"kernels": kernels})
        write_manifest(root, manifest.model_copy(update={"launch": launch}))
