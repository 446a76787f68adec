"""Instructions per packed weight word in the main loop of each csrc W4A16 GEMM kernel, read from
its SASS: the CPU-side measure of the decode path's cost (issue 12).

At M <= 16 the GEMM streams 4-bit weights, and on an H200 it is bound by the instructions it
issues per weight word, not by HBM: every 32-bit word costs a shared load, the int4 to fp16/bf16
bit tricks, the group's scale and offset and two mma.sync, whatever M is. The floor by the
layout's design is about 18 (1 LDS, 3 shifts, 4 LOP3, 8 HFMA2, 2 HMMA); everything above it is
overhead (group pairs recomputed, address arithmetic, selects). The swapped tiles (weights as
the mma's A operand, the group's scale in fp32 after it) drop the 8 HFMA2 and one HMMA, and
add per group an epilogue in fp32 and per slice an mma summing x. This script compiles
csrc/w4a16_gemm.cu for one architecture, finds each kernel's main loop (the backward branch
around its HMMA) and prints the instructions of the loop's compute part (after the k-step's
copies are committed: shared loads, conversions, mma, the loop's bookkeeping) per word a thread
handles in one k-step, with the mix. The copies themselves (a few instructions per 16 bytes)
are left out: their general (ragged-K) path shares the loop with the fast one.

No GPU: nvcc and cuobjdump (nvcc's directory, PATH, or the copy triton ships) are enough.

Usage: python evals/bench/gemm_sass.py [--arch 90]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from runtime.kernels.cuda import library  # noqa: E402
from tests.cuda_lib import find_cuobjdump  # noqa: E402

KERNEL = re.compile(
    r"w4a16_gemm_kernelINS_4TileILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi\d+ELi(\d)EEELi(\d+)ELb(\d)"
)
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
BRANCH = re.compile(r"BRA (?:`\()?[^0-9]*(0x[0-9a-f]+)")
SHOWN = ("HMMA", "HFMA2", "LDS", "LDSM", "LOP3", "SHF", "PRMT", "HADD2", "F2FP", "IMAD", "SEL")


def compile_sass(arch: str, work: Path) -> str:
    cubin = work / "gemm.cubin"
    command = [library.nvcc(), "-O3", "-std=c++17", "-cubin", f"-arch=sm_{arch}"]
    subprocess.run([*command, "-o", str(cubin), str(ROOT / "csrc" / "w4a16_gemm.cu")], check=True)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        sys.exit("cuobjdump not found (nvcc's directory, PATH, or triton's copy)")
    done = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True)
    return done.stdout.decode()


def main_loop(body: str) -> list[str]:
    """Opcodes of the compute part of the innermost loop around HMMA: after its last cp.async
    commit, up to the backward branch."""
    code = [(int(a, 16), op, args) for a, _, op, args in INSTRUCTION.findall(body)]
    loops = []
    for address, op, args in code:
        found = BRANCH.search(f"{op} {args}") if op == "BRA" else None
        if found and int(found.group(1), 16) < address:
            ops = [o for a, o, _ in code if int(found.group(1), 16) <= a <= address]
            if any(o.startswith("HMMA") for o in ops):
                loops.append(ops)
    if not loops:
        raise ValueError("no loop around HMMA in this kernel")
    loop = min(loops, key=len)
    # the copies of the next stage end at their commit (LDGDEPBAR); the stage's compute follows
    commit = max(i for i, op in enumerate(loop) if op.startswith("LDGDEPBAR"))
    return loop[commit + 1 :]


def rows(sass: str) -> list[tuple[str, float, Counter]]:
    found = []
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = function.split("\n", 1)[0].strip()
        tile = KERNEL.search(name)
        if not tile:
            continue
        bm, bn, bk, wm, wn, wk, stages, swap, gs, bf16 = map(int, tile.groups())
        words = (bk // 16 // wk) * (bn // wn // 16)  # words a thread turns into fragments a step
        ops = Counter(op.split(".")[0] for op in main_loop(function))
        group = f"g{gs}" if gs else "any g"
        tile = f"{bm}x{bn}x{bk}{' swapped' if swap else ''}"
        label = f"{tile} {wm}x{wn}x{wk}w s{stages} {group} {'bf16' if bf16 else 'fp16'}"
        per_word = Counter({k: v / words for k, v in ops.items()})
        found.append((label, sum(ops.values()) / words, per_word))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90", help="SASS architecture (default 90)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        sass = compile_sass(args.arch, Path(work))
    print(f"### W4A16 GEMM main loop, sm_{args.arch}: instructions per packed word\n")
    print("| kernel | per word | " + " | ".join(SHOWN) + " |")
    print("|---|---:|" + "---:|" * len(SHOWN))
    for label, total, mix in rows(sass):
        cells = " | ".join(f"{mix.get(op, 0):.2f}" for op in SHOWN)
        print(f"| {label} | {total:.1f} | {cells} |")


if __name__ == "__main__":
    main()
