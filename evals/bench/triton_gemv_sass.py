"""Instructions per packed weight word in the loop of the Triton one-row GEMM
(``w4a16_gemv``), for every config `lite tune` would time: the CPU-side measure of the Triton
backend's batch-1 GEMM (issues 11 and 12), the counterpart of ``gemm_sass.py`` for the csrc
kernels.

The one-row kernel is bound by the instructions it issues per 32-bit weight word (8 codes):
the floor is one AND and one FMA a code; the rest is the activations' unpacking and scaling,
the group's (s, b), loads and addresses. This script compiles the product's own launch for a
GPU architecture without a GPU (``tests/triton_compile.py``'s stand-in driver), reads each
cubin with cuobjdump, finds the kernel's loop over groups (its longest backward branch) and
prints the loop's instructions per word a thread handles in one group, its registers, its
barriers (a layout change through shared memory) and the mix.

Run it under the Triton the GPU has: the SASS differs between versions (triton 3.6 and 3.9 give
118 and 72 registers for the same default config). For another version, unpack its wheel and
put it first on PYTHONPATH.

Usage: env -u TRITON_INTERPRET python evals/bench/triton_gemv_sass.py [--arch 90]
       [--dtype bfloat16] [--group-size 128] [--n 4096] [--k 14336]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from evals.bench.gemm_sass import BRANCH, INSTRUCTION  # noqa: E402
from runtime.artifact.layout import TILE, padded_shape  # noqa: E402
from runtime.kernels.triton.gemm import GemvConfig, gemv_space, w4a16_gemv  # noqa: E402
from tests.cuda_lib import find_cuobjdump  # noqa: E402
from tests.triton_compile import ARCHS, _compile_only, stand_in_driver  # noqa: E402

SHOWN = ("FFMA", "LOP3", "FMUL", "FADD", "SHF", "IMAD", "LDG", "HADD2", "PRMT", "BAR")


def loop_ops(sass: str) -> list[str]:
    """Opcodes of the kernel's longest loop (the one over groups)."""
    code = [(int(a, 16), op, args) for a, _, op, args in INSTRUCTION.findall(sass)]
    loops = []
    for address, op, args in code:
        found = BRANCH.search(f"{op} {args}") if op == "BRA" else None
        if found and int(found.group(1), 16) < address:
            loops.append([o for a, o, _ in code if int(found.group(1), 16) <= a <= address])
    if not loops:
        raise ValueError("no loop in this kernel")
    return max(loops, key=len)


def words_per_thread(cfg: GemvConfig, group_size: int) -> int:
    """Weight words a thread converts in one pass of the loop (one group)."""
    grid = (cfg.block_k // 4) * (cfg.block_n // 2) * (group_size // cfg.block_k)
    return grid // (32 * cfg.num_warps)


def dump(cubin: bytes, cuobjdump: str, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=ARCHS, default=90)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=14336)
    args = parser.parse_args()
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        sys.exit("cuobjdump not found (nvcc's directory, PATH, or triton's copy)")
    import triton
    from triton.runtime.driver import driver

    driver.set_active(stand_in_driver(args.arch))
    compiled: list = []
    _compile_only(compiled)
    gs = args.group_size
    np_, kp = padded_shape(args.n, args.k, gs)
    qweight = torch.randint(-(2**31), 2**31 - 1, (kp // TILE, 2 * np_), dtype=torch.int32)
    qparams = torch.rand(kp // gs, np_, 2).half()
    x = torch.randn(1, args.k).to(getattr(torch, args.dtype))
    shape = f"N {args.n}, K {args.k}, g{gs}, {args.dtype}"
    print(f"### one-row GEMM loop, sm_{args.arch}, triton {triton.__version__}, {shape}\n")
    print("| config | registers | words a thread | per word | " + " | ".join(SHOWN) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(SHOWN))
    seen = set()
    for cfg in gemv_space(args.n, args.k, gs):
        shape = (cfg.block_n, cfg.block_k, cfg.num_warps)  # split-K does not change the loop
        if shape in seen:
            continue
        seen.add(shape)
        w4a16_gemv(x, qweight, qparams, args.n, args.k, gs, cfg)
        cubin = compiled[-1][1].asm["cubin"]
        registers = re.search(r"REG:(\d+)", dump(cubin, cuobjdump, "--dump-resource-usage"))
        ops = Counter(op.split(".")[0] for op in loop_ops(dump(cubin, cuobjdump, "--dump-sass")))
        words = words_per_thread(cfg, gs)
        cells = " | ".join(f"{ops.get(op, 0) / words:.2f}" for op in SHOWN)
        label = f"{cfg.block_n} x {cfg.block_k}, {cfg.num_warps} warps"
        total = sum(ops.values()) / words
        print(f"| {label} | {registers.group(1)} | {words} | {total:.1f} | {cells} |")


if __name__ == "__main__":
    main()
