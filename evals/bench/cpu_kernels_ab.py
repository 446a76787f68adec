"""The C CPU kernels of this checkout against those of another revision, in one process.

This VM-class of machine drifts by 30% within minutes, so two runs minutes apart cannot tell
a 10% change from noise; loading both libraries into one process and alternating them can.
Builds the kernels of `--against` (a git revision: its runtime/kernels/*.c) beside this
checkout's, checks that they agree, and prints the minimum time of alternated rounds:

- int4 linears: SmolLM2-135M's four matrices of one layer (qkv 960x576, o 576x576, gate/up
  3072x576, down 576x1536, group 64) at the given row counts, random codes and scales; "same
  bits" says whether both libraries gave identical outputs (the kernels promise it);
- the int8 lm_head (49152 x 576, per-32 scales) at the same row counts;
- decode attention: 8 sequences of --ctx tokens over 30 layers of SmolLM2's heads (9 query, 3
  KV, dim 64, int8 KV), the pool evicted between layers by streaming 64 MB (as a step's
  weights evict it) and hot (one layer repeated).

Usage: python evals/bench/cpu_kernels_ab.py --against HEAD~3 [--rows 1,8,128] [--ctx 210]
    [--paths int8,int8-unpacked]  (the int4 linears' dispatch path, baseline's and checkout's)
The ratio column is the baseline's time over this checkout's (above 1: this checkout faster).
"""

from __future__ import annotations

# isort: off
import runtime.kernels.isa  # noqa: F401  first: LITESERVE_CPU_ISA limits torch before it loads

# isort: on
import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.artifact.layout import pack_qparams, pack_qweight
from runtime.kernels import cpu, native
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec

ROOT = Path(__file__).resolve().parents[2]
LINEARS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2's (n, k) of one layer
GROUP = 64


def sources_at(revision: str, into: Path) -> Path:
    """The kernel sources of `revision` written under `into` (same file names as SOURCES)."""
    for src in native.SOURCES:
        rel = src.relative_to(ROOT).as_posix()
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{revision}:{rel}"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
        (into / src.name).write_text(text)
    return into


USED = ("int4_int8_linear", "int8_int8_linear", "decode_attention")  # what this script calls


def load(directory: Path):
    """The library built from `directory`'s sources, typed for the kernels compared (a
    baseline may predate others)."""
    signatures = {name: native._SIGNATURES[name] for name in USED}
    return native.load_native(tuple(directory / s.name for s in native.SOURCES), signatures)


def alternate(calls: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Minimum seconds per call of each, the candidates taking turns every round, after an
    untimed round (the first call of the first candidate paid for both's warm-up: 136x
    between identical kernels at --rounds 1)."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                call()
            best[name] = min(best[name], (time.perf_counter() - t) / reps)
    return best


def report(label: str, best: dict[str, float], same: bool | None = None) -> None:
    base, new = best["baseline"], best["checkout"]
    bits = "" if same is None else f"  same bits: {same}"
    times = f"baseline {base * 1e3:.3f} ms, checkout {new * 1e3:.3f} ms"
    print(f"{label}: {times}, {base / new:.2f}x{bits}")


def bench_linears(libs: dict, rows: list[int], rounds: int, paths: dict[str, str]) -> None:
    g = torch.Generator().manual_seed(0)
    weights = []
    for n, k in LINEARS:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // GROUP, generator=g) / 64 + 1e-3
        zero = torch.randint(0, 16, (n, k // GROUP), generator=g)
        packed = (pack_qweight(q, GROUP), pack_qparams(scale, zero, GROUP, k), n)
        weights.append(cpu.prepare_int4([packed], k, GROUP, torch.float32, lib=libs["checkout"]))
    head = cpu.prepare_head(torch.randn(49152, 576, generator=g) / 32)
    for m in rows:
        xs = [torch.randn(m, w.kp, generator=g) for w in weights]

        def layer(name, xs=xs):
            lib, path = libs[name], paths[name]
            return [cpu.int4_linear(x, w, path, lib) for x, w in zip(xs, weights, strict=True)]

        outs = {name: torch.cat([o.flatten() for o in layer(name)]) for name in libs}
        same = torch.equal(outs["baseline"], outs["checkout"])
        reps = max(2, int(4e7 / (m * sum(n * k for n, k in LINEARS))))
        best = alternate({n: (lambda n=n: layer(n)) for n in libs}, rounds, reps)
        report(f"int4 linears, {m} rows", best, same)
        x = torch.randn(m, 576, generator=g)
        outs = {n: cpu.logits(x, head, "int8", lib) for n, lib in libs.items()}
        same = torch.equal(outs["baseline"], outs["checkout"])
        calls = {
            n: (lambda lib=lib, x=x: cpu.logits(x, head, "int8", lib)) for n, lib in libs.items()
        }
        report(f"int8 lm_head, {m} rows", alternate(calls, rounds, 2), same)


def bench_attention(libs: dict, ctx: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    batch, layers, block = 8, 30, 16
    spec = KVSpec(
        num_layers=layers,
        num_kv_heads=3,
        head_dim=64,
        block_size=block,
        kv_quant="int8",
        dtype=torch.float32,
    )
    per_seq = -(-ctx // block)
    cache = KVCache(spec, num_blocks=batch * per_seq + 1)
    perm = torch.randperm(batch * per_seq, generator=g)
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    for i in range(layers):
        kv = cache.layer(i)
        for table in tables:
            k, v = torch.randn(2, ctx, 3, 64, generator=g)
            kv.write(k, v, kv.slots_for(table, ctx))
    q = torch.randn(batch, 9, 64, generator=g)
    lens, ones = [ctx] * batch, [1] * batch
    attn = cpu.CpuAttention(tables, lens, ones, cpu.decode_batch(tables, lens, ones, block))
    junk = torch.randn(16 << 20)

    def run(lib, cold: bool) -> float:
        total = 0.0
        for i in range(layers):
            if cold:
                junk.add_(1.0)
            t = time.perf_counter()
            cpu.paged_attention(q, cache.layer(i if cold else 0), attn, 0.125, None, lib=lib)
            total += time.perf_counter() - t
        return total

    outs = {
        n: cpu.paged_attention(q, cache.layer(0), attn, 0.125, None, lib=lib)
        for n, lib in libs.items()
    }
    diff = (outs["baseline"] - outs["checkout"]).abs().max().item()
    for cold in (True, False):
        for lib in libs.values():  # untimed, as alternate()'s first round
            run(lib, cold)
        best = dict.fromkeys(libs, float("inf"))
        for _ in range(rounds):
            for name, lib in libs.items():
                best[name] = min(best[name], run(lib, cold))
        state = "pool evicted between layers" if cold else "hot pool"
        report(f"decode attention, 8 x {ctx} tokens x 30 layers, {state}", best)
    print(f"  decode attention outputs differ by at most {diff:.2e} (summation order)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="git revision of the baseline kernels")
    p.add_argument("--rows", default="1,8,128")
    p.add_argument("--ctx", type=int, default=210, help="decode attention's context; 0: skip it")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--paths",
        default="int8,int8",
        help="the int4 linears' paths, baseline's and checkout's (cpu.INT8_PATHS)",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {
            "baseline": load(sources_at(a.against, Path(tmp))),
            "checkout": load(ROOT / "runtime/kernels"),
        }
        path = native.isa_path(libs["checkout"])
        print(f"C kernels of {a.against} (baseline) against this checkout, {path} path")
        paths = dict(zip(("baseline", "checkout"), a.paths.split(","), strict=True))
        bench_linears(libs, [int(r) for r in a.rows.split(",")], a.rounds, paths)
        if a.ctx > 0:
            bench_attention(libs, a.ctx, a.rounds)


if __name__ == "__main__":
    main()
