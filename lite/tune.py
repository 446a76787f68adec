"""`lite tune`: pin the W4A16 GEMM's tile configs for this GPU into the artifact's manifest.

Every distinct GEMM the runtime will run (the fused q/k/v and gate/up shapes included, as the
triton backend builds them) is timed over the kernel's config space at each row bucket, and the
winner is written under the GPU's architecture name (``sm_90``). A server then starts without
autotuning and always runs the same kernels. The artifact's weights, and so its checksums, are
untouched: only manifest.json changes, by an atomic replace.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime.artifact.reader import Artifact
from runtime.artifact.writer import write_manifest
from runtime.kernels.ops import interpreting
from runtime.model.llama import FUSED_LINEARS

if TYPE_CHECKING:
    from runtime.kernels.triton.backend import TritonInt4Weight
    from runtime.kernels.triton.gemm import GemmConfig

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
        return torch.device("cuda")
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


def _fastest(
    x: torch.Tensor,
    w: TritonInt4Weight,
    space: list[GemmConfig],
    timer: Callable[[Callable[[], object]], float],
) -> tuple[float, GemmConfig]:
    from runtime.kernels.triton.gemm import w4a16_gemm

    timed = []
    for cfg in space:
        try:
            ms = timer(lambda c=cfg: w4a16_gemm(x, w.qweight, w.qparams, w.n, w.k, w.group_size, c))
        except Exception as e:  # a config the compiler rejects on this GPU
            log.debug("config %s failed: %s", cfg, e)
            continue
        timed.append((ms, cfg))
    if not timed:
        raise TuneError(f"no config of the space ran for N={w.n} K={w.k} M={x.shape[0]}")
    return min(timed, key=lambda t: t[0])


def tune(
    path: Path,
    buckets: tuple[int, ...] | None = None,
    max_configs: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    reps: int = 5,
    progress: Callable[[str], None] = log.info,
) -> dict[str, dict[str, int]]:
    """Time every config per shape and bucket; write the winners; return them by key."""
    from runtime.kernels.gpu import gemm_key, gpu_arch
    from runtime.kernels.triton.backend import prepare_weight
    from runtime.kernels.triton.gemm import M_BUCKETS, config_space

    device = check_device()
    bad = [b for b in buckets or () if b not in M_BUCKETS]
    if bad:
        raise TuneError(f"buckets {bad} are not among the runtime's row buckets {M_BUCKETS}")
    artifact = Artifact(path)
    manifest = artifact.manifest
    gs = manifest.quantization.group_size
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
        w = prepare_weight(parts, shape.k, gs, device, {})
        for bucket in buckets or M_BUCKETS:
            x = torch.randn(bucket, shape.k, device=device, dtype=dtype)
            space = config_space(bucket, shape.n, shape.k, gs)[:max_configs]
            ms, best = _fastest(x, w, space, timer)
            winners[gemm_key(shape.n, shape.k, bucket)] = best.to_dict()
            progress(f"N={shape.n} K={shape.k} M={bucket}: {ms:.4f} ms with {best}")
    arch = gpu_arch(device)
    kernels = {**manifest.launch.kernels, arch: winners}
    launch = manifest.launch.model_copy(update={"kernels": kernels})
    write_manifest(artifact.path, manifest.model_copy(update={"launch": launch}))
    return winners
