"""Compile every Triton launch the runtime makes for a real GPU target, on a machine without a
GPU: ``python -m tests.triton_compile --arch 90 --out launches.json`` (``--quick``: what CI
compiles).

Why: the kernel tests run the Triton kernels under ``TRITON_INTERPRET=1`` where there is no GPU,
and the interpreter neither runs the compiled branches (``INTERPRETED`` is a constexpr of the
attention kernels) nor applies the compiler's rules (types, layouts, register and shared-memory
budgets). The Triton backend as first landed failed on its first step on a GPU. Triton's
compiler runs without a driver once it is told the target, so this runs the product's own
launch wrappers (``w4a16_gemm``, ``w4a16_dequantize``, the paged attention, the KV write and
the pointwise kernels) on CPU tensors with every ``kernel[grid](...)`` turned into a
compile-only warm-up (``JITFunction.run(warmup=True)``): the launches, their specializations
and their constexprs are the ones a GPU would get. Each compiled kernel's cubin is then read
with cuobjdump for its registers, stack (spills) and whether its SASS issues tensor-core
instructions.

One architecture per process: a JIT function keeps its compiled kernels per device, and the
stand-in driver has one device. Run by ``tests/test_offline_compile.py``; outputs of the
wrappers are never read (nothing runs).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from tests.cuda_lib import find_cuobjdump

ROOT = Path(__file__).resolve().parent.parent
ARCHS = (80, 90)  # A100 (mma.sync, like sm_86/sm_89), H100/H200 (wgmma)
# dynamic shared memory a block may use: sm_80 code also runs on sm_86/sm_89 (99 KiB)
SHARED_LIMIT = {80: 99 * 1024, 90: 227 * 1024}
TENSOR_CORE_OPS = ("HMMA", "HGMMA")  # SASS of mma.sync and wgmma
# Llama-3-8B's qkv and down projections (N, K), and a narrow N that pads to one 64-column tile
GEMM_SHAPES = ((6144, 4096), (4096, 14336), (40, 256))
# (heads, KV heads, head_dim): Llama-3-8B, SmolLM2, and a 256-wide head (wider than a tile)
ATTENTION_SHAPES = ((32, 8, 128), (9, 3, 64), (8, 2, 256))
# (hidden, intermediate): SmolLM2, Llama-3.2-1B, Llama-3-8B, Llama-3-70B
POINTWISE_WIDTHS = ((576, 1536), (2048, 8192), (4096, 14336), (8192, 28672))


@dataclass
class Launch:
    """One compiled launch: what was compiled, for which case, and what ptxas made of it."""

    case: str
    kernel: str
    shared: int = 0
    num_warps: int = 0
    registers: int = 0
    stack: int = 0  # bytes of local stack per thread: register spills
    tensor_cores: bool = False
    flush_to_zero: bool = False  # some fp32 instruction flushes subnormals (.FTZ in the SASS)
    pdl: bool = False  # launched with programmatic dependent launch (launch_pdl)
    waits_first: bool = False  # ACQBULK (griddepcontrol.wait) before any global memory access
    seconds: float = 0.0  # compile time of the case's launches
    error: str = ""


def stand_in_driver(arch: int) -> object:
    """The part of Triton's driver that compiling (not loading or launching) asks for."""
    from triton.backends.compiler import GPUTarget

    class Driver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    return Driver()


def _compile_only(compiled: list) -> None:
    """Every ``kernel[grid](...)`` compiles for the stand-in target and launches nothing; the
    (kernel name, compiled kernel) pairs go to ``compiled``."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warmup_run(self: JITFunction, *args: object, grid: object, warmup: bool, **kw: object):
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = warmup_run


# modules whose launches take runtime/kernels/triton/launch.py's pdl_launch
PDL_MODULES = ("gemm", "pointwise", "kv_write", "attention")
# SASS that reads or writes global memory (the L2 prefetch, CCTL, is a hint and may come first)
_GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|ATOMG|RED|LDGSTS|UTMALDG|UTMASTG|LD|ST|ATOM)\.")


@contextlib.contextmanager
def _forced_pdl() -> Iterator[None]:
    """Every launch that takes ``pdl_launch`` compiled with programmatic dependent launch, as
    ``LITESERVE_TRITON_PDL=1`` makes it on an sm_90 GPU (here the tensors are on the CPU)."""
    import importlib

    modules = [importlib.import_module(f"runtime.kernels.triton.{m}") for m in PDL_MODULES]
    saved = [m.pdl_launch for m in modules]
    for m in modules:
        m.pdl_launch = lambda device: {"PDL": True, "launch_pdl": True}  # noqa: ARG005
    try:
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            m.pdl_launch = f


def _waits_first(sass: str) -> bool:
    """Whether the kernel waits for the kernels before it (ACQBULK) before its first global
    memory access, and lets its dependents launch (PREEXIT)."""
    wait = sass.find("ACQBULK")
    first = _GLOBAL_ACCESS.search(sass)
    return wait >= 0 and "PREEXIT" in sass and (first is None or wait < first.start())


def _resources(cuobjdump: str, cubin: bytes) -> tuple[dict[str, int], str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True)
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    if "REG" not in found or "STACK" not in found:  # never a silent pass
        raise RuntimeError(f"{cuobjdump} printed no resource usage: {usage[-500:]!r}")
    return found, sass.stdout


def gemm_cases(quick: bool) -> Iterator[tuple[str, Callable[[], object]]]:
    """Each row bucket's default launch (the one-row kernel, a decode split-K tile, a prefill
    tile, or the dequantization) for every group size and activation dtype, on real and padded
    shapes; ``quick``: the smallest and largest group size."""
    from runtime.artifact.layout import GROUP_SIZES, TILE, padded_shape
    from runtime.kernels.triton.gemm import (
        ACTIVATION_DTYPES,
        M_BUCKETS,
        DequantConfig,
        GemvConfig,
        choose_config,
        w4a16_dequantize,
        w4a16_gemm,
        w4a16_gemv,
    )

    for n, k in GEMM_SHAPES:
        for gs in (GROUP_SIZES[0], GROUP_SIZES[-1]) if quick else GROUP_SIZES:
            # the artifact's tensor shapes and dtypes; their values are never read (nothing
            # runs), and packing real codes for 8B-sized weights would take minutes
            np_, kp = padded_shape(n, k, gs)
            qweight = torch.randint(-(2**31), 2**31 - 1, (kp // TILE, 2 * np_), dtype=torch.int32)
            qparams = torch.rand(kp // gs, np_, 2).half()
            for dtype in ACTIVATION_DTYPES:
                for m in M_BUCKETS:
                    config = choose_config(m, n, k, gs)
                    x = torch.randn(m, k).to(dtype)
                    # the dequantized path's launch is the dequantization (its matmul is torch's)
                    if isinstance(config, DequantConfig):
                        call = partial(w4a16_dequantize, qweight, qparams, n, k, gs, dtype)
                    else:
                        gemm = w4a16_gemv if isinstance(config, GemvConfig) else w4a16_gemm
                        call = partial(gemm, x, qweight, qparams, n, k, gs, config)
                    yield f"gemm n={n} k={k} gs={gs} {dtype} m={m} {config}", call


def _pool(kv_quant: str, dtype: torch.dtype, kv_heads: int, head_dim: int, lens: list[int]):
    """A pool with every sequence's blocks (ids in order) and int32 tables, as the engine has."""
    from runtime.kv.cache import KVCache
    from runtime.kv.format import KVSpec

    block_size = 16
    needed = [-(-n // block_size) for n in lens]
    cache = KVCache(KVSpec(1, kv_heads, head_dim, block_size, kv_quant, dtype), sum(needed) + 1)
    tables = torch.zeros(len(lens), max(needed) + 1, dtype=torch.int32)
    start = 0
    for i, nb in enumerate(needed):
        tables[i, :nb] = torch.arange(start, start + nb)
        start += nb
    return cache.layer(0), tables, torch.tensor(lens, dtype=torch.int32)


def attention_cases(quick: bool) -> Iterator[tuple[str, Callable[[], object]]]:
    """Decode (one partition, and several with the merge), prefill and the KV write (with
    rotary and without), for every head shape, KV format and activation dtype, with and
    without a sliding window; ``quick``: one activation dtype per KV format, and the window on
    the first head shape only."""
    from runtime.kernels.triton.attention import paged_decode_attention, paged_prefill_attention
    from runtime.kernels.triton.gemm import ACTIVATION_DTYPES
    from runtime.kernels.triton.kv_write import kv_write, rotary_kv_write
    from runtime.kv.format import KV_QUANT

    lens = [700, 33]
    for shape, (heads, kv_heads, head_dim) in enumerate(ATTENTION_SHAPES):
        for i, kv_quant in enumerate(KV_QUANT):
            dtypes = [ACTIVATION_DTYPES[i % 2]] if quick else ACTIVATION_DTYPES
            for dtype in dtypes:
                for window in (None,) if quick and shape else (None, 256):
                    kv, tables, ctx = _pool(kv_quant, dtype, kv_heads, head_dim, lens)
                    q = torch.randn(len(lens), heads, head_dim).to(dtype)
                    name = f"{heads}/{kv_heads}x{head_dim} kv={kv_quant} {dtype} window={window}"
                    for partition in (1024, None):  # one partition; the default two, merged
                        yield (
                            f"decode {name} partition={partition}",
                            lambda q=q, kv=kv, t=tables, c=ctx, w=window, p=partition: (
                                paged_decode_attention(q, kv, t, c, 0.1, w, p)
                            ),
                        )
                    query = torch.tensor([0, 100, 110], dtype=torch.int32)
                    qp = torch.randn(110, heads, head_dim).to(dtype)
                    yield (
                        f"prefill {name}",
                        lambda q=qp, kv=kv, t=tables, cu=query, c=ctx, w=window: (
                            paged_prefill_attention(q, kv, t, cu, c, 0.1, w)
                        ),
                    )
                kvs = torch.randn(5, kv_heads, head_dim).to(dtype)
                slots = torch.tensor([3, 0, -1, 17, 40], dtype=torch.int32)
                yield (
                    f"kv_write {kv_heads}x{head_dim} kv={kv_quant} {dtype}",
                    lambda kv=kv, k=kvs, s=slots: kv_write(kv, k, k, s),
                )
                qk = torch.randn(5, heads + kv_heads, head_dim).to(dtype)
                rope = tuple(torch.randn(5, 1, head_dim // 2).to(dtype) for _ in range(2))
                yield (
                    f"rotary_kv_write {heads}/{kv_heads}x{head_dim} kv={kv_quant} {dtype}",
                    lambda kv=kv, qk=qk, v=kvs, r=rope, s=slots: rotary_kv_write(kv, qk, v, r, s),
                )


def pointwise_cases(quick: bool) -> Iterator[tuple[str, Callable[[], object]]]:
    """Add + RMSNorm (with a residual and without) and SiLU-and-mul at every width, for each
    activation dtype; ``quick``: one dtype per width."""
    from runtime.kernels.triton.gemm import ACTIVATION_DTYPES
    from runtime.kernels.triton.pointwise import add_rms_norm, silu_mul

    for i, (hidden, intermediate) in enumerate(POINTWISE_WIDTHS):
        for dtype in [ACTIVATION_DTYPES[i % 2]] if quick else ACTIVATION_DTYPES:
            x, w = torch.randn(3, hidden).to(dtype), torch.ones(hidden, dtype=dtype)
            for delta in (x, None):
                yield (
                    f"add_rms_norm {hidden} {dtype} residual={delta is not None}",
                    lambda x=x, d=delta, w=w: add_rms_norm(x, d, w, 1e-5),
                )
            gate_up = torch.randn(3, 2 * intermediate).to(dtype)
            yield f"silu_mul {intermediate} {dtype}", lambda g=gate_up: silu_mul(g)


def compile_all(arch: int, cuobjdump: str, quick: bool) -> list[Launch]:
    """Every case's launches compiled for ``arch``; a case that fails records its error."""
    from triton.runtime.driver import driver

    driver.set_active(stand_in_driver(arch))
    compiled: list = []
    _compile_only(compiled)
    launches: list[Launch] = []
    seen: set[str] = set()
    for pdl in (False, True) if arch >= 90 else (False,):  # griddepcontrol is sm_90 PTX
        with _forced_pdl() if pdl else contextlib.nullcontext():
            cases = itertools.chain(
                gemm_cases(quick), attention_cases(quick), pointwise_cases(quick)
            )
            for case, call in cases:
                launches += _compile_case(f"{case} pdl" if pdl else case, call, compiled, seen)
    return [_read(launch, kernel, cuobjdump) for launch, kernel in launches]


def _compile_case(case: str, call: Callable[[], object], compiled: list, seen: set[str]) -> list:
    """(Launch, compiled kernel) of each new specialization the case launches; a case that
    fails records its error."""
    compiled.clear()
    start = time.perf_counter()
    try:
        call()
    except Exception:  # noqa: BLE001 - every failure is the finding, reported per case
        return [(Launch(case, "?", error=traceback.format_exc(limit=-3)), None)]
    seconds = round(time.perf_counter() - start, 2)
    new = []
    for name, kernel in compiled:
        if kernel.hash not in seen:  # else the same specialization as an earlier launch
            seen.add(kernel.hash)
            new.append((Launch(case, name, seconds=seconds), kernel))
    return new


def _read(launch: Launch, kernel: object, cuobjdump: str) -> Launch:
    """The launch with what its compiled kernel's metadata and cubin say."""
    if kernel is None:
        return launch
    usage, sass = _resources(cuobjdump, kernel.asm["cubin"])
    pdl = bool(getattr(kernel.metadata, "launch_pdl", False))
    return Launch(
        launch.case,
        launch.kernel,
        shared=kernel.metadata.shared,
        num_warps=kernel.metadata.num_warps,
        registers=usage.get("REG", 0),
        stack=max(usage.get("STACK", 0), usage.get("LOCAL", 0)),
        tensor_cores=any(op in sass for op in TENSOR_CORE_OPS),
        flush_to_zero=".FTZ" in sass,
        pdl=pdl,
        waits_first=pdl and _waits_first(sass),
        seconds=launch.seconds,
    )


def _command(arch: int, out: Path, cuobjdump: str, quick: bool) -> list[str]:
    command = [sys.executable, "-m", "tests.triton_compile", "--arch", str(arch)]
    command += ["--out", str(out), "--cuobjdump", cuobjdump]
    return command + (["--quick"] if quick else [])


@dataclass
class Job:
    """The background compiles of every architecture, one after the other (one core)."""

    proc: subprocess.Popen
    out_dir: Path
    outs: dict[int, Path]
    log: Path


_JOB: list[Job] = []  # at most one per test session


def start(cuobjdump: str, quick: bool = True) -> None:
    """Start compiling in the background (conftest does when the test module is collected):
    a few minutes on one core, which the serial test run before it leaves mostly idle."""
    if _JOB:
        return
    out_dir = Path(tempfile.mkdtemp(prefix="liteserve-triton-"))
    outs = {arch: out_dir / f"launches-sm{arch}.json" for arch in ARCHS}
    script = " && ".join(
        subprocess.list2cmdline(_command(arch, out, cuobjdump, quick)) for arch, out in outs.items()
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out_dir / "cache")  # compiled here, not taken from a cache
    log = out_dir / "compile.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["sh", "-c", script], stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    _JOB.append(Job(proc, out_dir, outs, log))


def stop() -> None:
    """End the compiles if nobody waited for them, and remove their files."""
    for job in _JOB:
        job.proc.kill()
        job.proc.wait()
        shutil.rmtree(job.out_dir, ignore_errors=True)
    _JOB.clear()


def results(cuobjdump: str) -> dict[int, list[Launch]]:
    """Each architecture's launches (starting the compiles unless conftest did)."""
    start(cuobjdump)
    job = _JOB[0]
    if job.proc.wait() != 0:
        raise RuntimeError(f"the offline Triton compile failed:\n{job.log.read_text()[-4000:]}")
    return {
        arch: [Launch(**d) for d in json.loads(out.read_text())] for arch, out in job.outs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=ARCHS, required=True)
    parser.add_argument("--out", required=True, help="JSON file of the launches")
    parser.add_argument("--cuobjdump", help="default: from PATH, nvcc's directory or triton")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (what CI compiles)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: unset it, or nothing is compiled")
    cuobjdump = args.cuobjdump or find_cuobjdump()
    if cuobjdump is None:
        parser.error("cuobjdump not found (PATH, nvcc's directory, triton): pass --cuobjdump")
    launches = compile_all(args.arch, cuobjdump, args.quick)
    with open(args.out, "w") as f:
        json.dump([asdict(launch) for launch in launches], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
