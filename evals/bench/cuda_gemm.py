"""The csrc W4A16 GEMM (csrc/w4a16_gemm.cu) on a GPU, against the baselines of issue 12 measured
in the same run: torch's bf16 matmul on dense weights of the same shape, torch's int4 kernel
(`_weight_int4pack_mm`, "tinygemm", on the same codes, scales and zero points) and the Triton
GEMM the triton backend runs.

Llama-3-8B's linears (fused qkv 6144x4096, o 4096x4096, fused gate/up 28672x4096, down
4096x14336) at group 128, bf16 activations, M = 1 .. 4096. The csrc launch is the cuda backend's
(runtime/kernels/cuda/gemm_plan.py picks the tile config and split-K for this GPU's SM count).
Every kernel is timed back to back in CUDA graphs (how the engine runs decode), cycling through
copies of its weights that together exceed the L2 (`gpu_timing.py`), so neither the host's
launch time nor L2 reuse is in the figures: each launch streams its weights from HBM, as each
layer's do in a decode step. Each output is compared with the dequantized weights' bf16 matmul
(relative Frobenius error), so a wrong layout or packing shows here and not as a fast time.
Where the plan is the dequantized weights plus a dense GEMM (prefill-sized M), the fused
kernel's best launch by the planner's model is timed too. Prints one row per shape and M, then
the targets:

* M = 1 .. 16: at least 2.5x torch's bf16 dense matmul;
* M = 1: at least 1.3x tinygemm;
* M = 4096: at least 0.8x the dense matmul.

--sweep M,... times every fused launch the planner considers (each tile config and split-K) on
each shape at those M and prints, per shape and M, the planned launch against the fastest one
measured, the model's estimates of both and the measured top 5: the figures the planner's
constants (runtime/kernels/cuda/gemm_plan.py) are fit to, and what `lite tune` would pin.

--sweep-json PATH also writes every timed launch of the sweep as one JSON object a line (shape,
M, N, K, group, the tile's fields, split-K, measured and model ms, whether planned): what
`evals/bench/fit_gemm_plan.py` fits the planner's issue constants to, on any machine.

--quick runs tiny shapes through the CPU emulation of the kernel (lsq_emulate_w4a16_gemm, no
GPU, no timing): a check of this script (with --sweep, every candidate of one decode shape).

Usage: python evals/bench/cuda_gemm.py [--ms 1,4,16,64,256,1024,4096] [--sweep 1,16]
    [--sweep-json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path

import torch

# run as a script, this folder is first on sys.path: the attention bench's timing and loading
from cuda_attention import setup
from gpu_timing import TIMING, copies_for, graph_ms, launch_floor_ms

from runtime.artifact.layout import dequantize, pack_qparams, pack_qweight
from runtime.kernels.cuda import gemm_plan, w4a16
from runtime.kernels.gpu import gpu_arch

SHAPES = {
    "qkv 6144x4096": (6144, 4096),
    "o 4096x4096": (4096, 4096),
    "gate/up 28672x4096": (28672, 4096),
    "down 4096x14336": (4096, 14336),
}
# --quick: (shape, rows) through the emulation: decode, a fused prefill launch, and a shape
# and M the planner gives the dequantized path
QUICK = {"quick 200x300": ((200, 300), (1, 17)), "quick 1024x1024": ((1024, 1024), (4096,))}
GROUP, QUICK_GROUP = 128, 32
MS = "1,4,16,64,256,1024,4096"
TINYGEMM_MAX_M = 16  # tinygemm is a decode kernel; the targets compare it at M = 1
SWEEP_QUICK = "quick 200x300"  # --quick --sweep emulates every candidate of this shape only
ERR_LIMIT = 1e-2  # bf16's bound in the tests (tests/cuda_lib.py GEMM_TOLERANCE)


class Weight:
    """Random codes, scales and zero points of one [n, k] linear in every form the kernels take."""

    def __init__(self, n: int, k: int, gs: int, device: torch.device) -> None:
        groups = -(-k // gs)
        self.n, self.k, self.gs = n, k, gs
        self.q = torch.randint(0, 16, (n, k), dtype=torch.int32)
        self.scale = torch.rand(n, groups) * 0.02 + 0.002
        self.zero = torch.randint(0, 16, (n, groups), dtype=torch.int32)
        self.qweight = pack_qweight(self.q, gs).to(device)
        self.qparams = pack_qparams(self.scale, self.zero, gs, k).to(device)
        self.exact = dequantize(self.qweight, self.qparams, n, k, gs).float()  # the reference
        self.dense = self.exact.to(torch.bfloat16)  # the dense baseline's weights

    def tinygemm(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's int4 form: two codes a byte (even k high), inner-k tiles of 8, and per group
        (scale, zero) in bf16 with w = (q - 8) * scale + zero, i.e. zero = b + 8 s."""
        device = self.qweight.device
        codes = (self.q[:, ::2] << 4 | self.q[:, 1::2]).to(torch.uint8).to(device)
        packed = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
        s = self.scale.to(torch.float16).float()  # as stored in qparams
        b = (-self.zero.float() * s).to(torch.float16).float()
        pairs = torch.stack([s, b + 8 * s], dim=-1).transpose(0, 1)  # [groups, n, 2]
        return packed, pairs.contiguous().to(torch.bfloat16).to(device)

    @functools.cached_property
    def packed_copies(self) -> list[tuple[torch.Tensor, ...]]:
        """(qweight, qparams) and its clones, for timing (:func:`rotated`)."""
        return rotated(self.qweight, self.qparams)

    @functools.cached_property
    def dense_copies(self) -> list[tuple[torch.Tensor, ...]]:
        return rotated(self.dense)

    @functools.cached_property
    def tinygemm_copies(self) -> list[tuple[torch.Tensor, ...]]:
        return rotated(*self.tinygemm())


def rotated(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` and enough clones of them that a round of launches, one a copy, reads each
    from HBM rather than L2 (gpu_timing.copies_for)."""
    n = copies_for(sum(t.numel() * t.element_size() for t in tensors), tensors[0].device)
    return [tensors, *(tuple(t.clone() for t in tensors) for _ in range(n - 1))]


def csrc_call(lib, w: Weight, x: torch.Tensor, plan: gemm_plan.Plan, emulate: bool, packed=()):
    """The cuda backend's y = x @ W_hat^T under ``plan`` (on ``packed``, a copy of (qweight,
    qparams), if given), as a call returning y."""
    qweight, qparams = packed or (w.qweight, w.qparams)
    return lambda: w4a16.linear(lib, x, qweight, qparams, w.n, w.k, w.gs, plan, emulate)


def csrc_calls(lib, w: Weight, x: torch.Tensor, plan: gemm_plan.Plan) -> list:
    """The same launch on each copy of the weights, for graph_ms."""
    return [csrc_call(lib, w, x, plan, False, packed) for packed in w.packed_copies]


def label(plan: gemm_plan.Plan) -> str:
    """config/split of a fused launch; dequant for the dequantized weights and a dense GEMM."""
    if isinstance(plan, gemm_plan.DequantPlan):
        return "dequant"
    return f"{plan.config}/s{plan.split_k}"


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def row(lib, shape: str, w: Weight, m: int, sms: int, arch: str, quick: bool) -> dict:
    """One shape and M: the csrc plan, times and errors (None where not run). Where the plan is
    the dequantized path, the fused kernel's best launch by the model is timed too."""
    device = w.qweight.device
    x = torch.randn(m, w.k, device=device).to(torch.bfloat16)
    plans = gemm_plan.ranked(gemm_plan.configs(lib), m, w.n, w.k, w.gs, sms, arch)
    fused = next(p for p in plans if isinstance(p, gemm_plan.GemmPlan))
    run = csrc_call(lib, w, x, plans[0], quick)
    ref = x.double() @ w.exact.double().T
    out = {"label": shape, "m": m, "plan": label(plans[0])}
    if quick:  # the fused kernel emulated at prefill M would take minutes: not compared
        return {**out, "err": rel_err(run(), ref)}
    if plans[0] is not fused:
        out["fused"] = label(fused)
        out["fused_err"] = rel_err(csrc_call(lib, w, x, fused, quick)(), ref)
    out["ms"] = graph_ms(csrc_calls(lib, w, x, plans[0]))
    out["err"] = rel_err(run(), ref)
    if plans[0] is not fused:
        out["fused_ms"] = graph_ms(csrc_calls(lib, w, x, fused))
    out["dense_ms"] = graph_ms([lambda d=d: torch.matmul(x, d.T) for (d,) in w.dense_copies])
    from runtime.kernels.triton.gemm import choose_config, w4a16_linear

    cfg = choose_config(m, w.n, w.k, w.gs)  # the triton backend's launch without pins
    triton = [lambda p=p: w4a16_linear(x, *p, w.n, w.k, w.gs, cfg) for p in w.packed_copies]
    out["triton_err"] = rel_err(triton[0](), ref)
    out["triton_ms"] = graph_ms(triton)
    if m <= TINYGEMM_MAX_M:
        try:
            mm = torch.ops.aten._weight_int4pack_mm
            tiny = [lambda p=p: mm(x, p[0], w.gs, p[1]) for p in w.tinygemm_copies]
            out["tiny_err"] = rel_err(tiny[0](), ref)
            out["tiny_ms"] = graph_ms(tiny)
        except (RuntimeError, NotImplementedError) as e:  # not in this torch build
            out["tiny_note"] = str(e).splitlines()[0][:80]
    return out


def fmt(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(r: dict, w: Weight) -> None:
    ms, dense, tiny, triton = (r.get(k) for k in ("ms", "dense_ms", "tiny_ms", "triton_ms"))
    nbytes = w.qweight.numel() * 4 + w.qparams.numel() * 2 + (r["m"] * (w.k + w.n)) * 2
    tb_s = nbytes / ms / 1e9 if ms else None
    ratio = lambda base: f"{base / ms:.2f}x" if ms and base else "-"  # noqa: E731
    tiny_cell = ratio(tiny) if tiny else r.get("tiny_note", "-")
    fused = "-"
    if "fused" in r:
        fused = f"{r['fused']}: {fmt(r.get('fused_ms'))} (err {r['fused_err']:.1e})"
    print(
        f"| {r['label']} | {r['m']} | {r['plan']} | {fmt(ms)} | {fmt(tb_s, '.2f')} | "
        f"{fmt(dense)} | {ratio(dense)} | {fmt(tiny)} | {tiny_cell} | {fmt(triton)} | "
        f"{ratio(triton)} | {fused} | {r['err']:.1e} | {fmt(r.get('tiny_err'), '.1e')} | "
        f"{fmt(r.get('triton_err'), '.1e')} |"
    )


def targets(rows: list[dict]) -> None:
    def ratios(key: str, ms: set[int]) -> list[float]:
        return [r[key] / r["ms"] for r in rows if r["m"] in ms and r.get(key) and r.get("ms")]

    print("\n## Targets")
    for what, key, ms, goal in (
        ("M = 1..16 vs dense bf16", "dense_ms", {1, 4, 16}, 2.5),
        ("M = 1 vs tinygemm", "tiny_ms", {1}, 1.3),
        ("M = 4096 vs dense bf16", "dense_ms", {4096}, 0.8),
    ):
        got = ratios(key, ms)
        span = f"{min(got):.2f}x .. {max(got):.2f}x" if got else "not measured"
        met = "met" if got and min(got) >= goal else "not met"
        print(f"- {what}: {span} (target >= {goal}x: {met if got else 'unknown'})")


def sweep(
    lib, shape: str, w: Weight, m: int, sms: int, arch: str, quick: bool, sink: Path | None
) -> list[str]:
    """Every fused candidate of one shape and M timed (emulated and checked with --quick): the
    planned one against the fastest, with the model's estimates; each timing also appended to
    ``sink`` as a JSON line. Returns the launches whose output was wrong (not timed)."""
    x = torch.randn(m, w.k, device=w.qweight.device).to(torch.bfloat16)
    ref = x.double() @ w.exact.double().T
    plans = gemm_plan.ranked(gemm_plan.configs(lib), m, w.n, w.k, w.gs, sms, arch)
    fused = [p for p in plans if isinstance(p, gemm_plan.GemmPlan)]
    timed, wrong = [], []
    for p in fused:
        run = csrc_call(lib, w, x, p, quick)
        err = rel_err(run(), ref)
        if err > ERR_LIMIT:  # reported, and the script fails once every launch has run
            wrong.append(f"{shape} M={m} {label(p)}: relative error {err:.1e}")
            continue
        timed.append((None if quick else graph_ms(csrc_calls(lib, w, x, p)), p))
    if wrong:
        print("\n".join(f"WRONG: {line}" for line in wrong))
    if quick or not timed:
        ok = f"{len(timed)} of {len(fused)} launches within error"
        print(f"| {shape} | {m} | {label(plans[0])} | {ok} |")
        return wrong
    planned = next((ms for ms, p in timed if p is plans[0]), None)
    best_ms, best = min(timed, key=lambda t: t[0])

    def est(p: gemm_plan.GemmPlan) -> float:
        return gemm_plan.estimate_seconds(p.tile, m, w.n, w.k, w.gs, p.split_k, sms) * 1e3

    if sink is not None:
        with sink.open("a") as f:
            for ms, p in timed:
                record = dict(shape=shape, m=m, n=w.n, k=w.k, group_size=w.gs, sms=sms)
                record |= dataclasses.asdict(p.tile) | dict(split_k=p.split_k, ms=ms)
                record |= dict(model_ms=est(p), planned=p is plans[0])
                f.write(json.dumps(record) + "\n")

    top = ", ".join(f"{label(p)} {ms:.4f}" for ms, p in sorted(timed, key=lambda t: t[0])[:5])
    ratio = f"{planned / best_ms:.2f}x" if planned else "-"
    print(
        f"| {shape} | {m} | {label(plans[0])} | {fmt(planned)} | "
        f"{fmt(est(plans[0]) if planned else None)} | "
        f"{label(best)} | {best_ms:.4f} | {est(best):.4f} | {ratio} | "
        f"{fused.index(best) + 1} of {len(fused)} | {swap_speedup(timed)} | {top} |"
    )
    return wrong


def swap_speedup(timed: list[tuple[float, gemm_plan.GemmPlan]]) -> str:
    """The fastest unswapped launch's time over the fastest swapped one's (csrc/README.md's
    swapped decode tiles): above 1 where swapping the operands pays."""
    best = {}
    for ms, p in timed:
        best[p.tile.swap_ab] = min(ms, best.get(p.tile.swap_ab, ms))
    return f"{best[0] / best[1]:.2f}x" if len(best) == 2 else "-"


def print_sweep(
    lib,
    runs: dict,
    gs: int,
    sweep_ms: tuple[int, ...],
    sms: int,
    arch: str,
    device,
    sink: Path | None,
) -> list[str]:
    """The sweep's table; returns the launches whose output was wrong."""
    quick = device.type == "cpu"
    sink = None if quick else sink  # nothing timed to fit
    print(f"\n## Every fused launch at M = {', '.join(map(str, sweep_ms))}\n")
    if quick:
        print("| shape | M | plan | checked |\n|---|---:|---|---|")
    else:
        print(
            "| shape | M | plan | ms | model ms | fastest | ms | model ms | plan / fastest | "
            "fastest's model rank | unswapped / swapped | measured top 5 (config/split ms) |\n"
            "|---|---:|---|---:|---:|---|---:|---:|---:|---|---:|---|"
        )
    wrong = []
    for name, ((n, k), _) in runs.items():
        w = Weight(n, k, gs, device)
        for m in sweep_ms:
            wrong += sweep(lib, name, w, m, sms, arch, quick, sink)
    return wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default=MS, help="row counts")
    p.add_argument("--sweep", default="", help="row counts at which to time every fused launch")
    p.add_argument("--sweep-json", type=Path, help="append the sweep's timings here (JSON lines)")
    p.add_argument("--quick", action="store_true", help="CPU emulation, tiny shapes, no timing")
    a = p.parse_args()
    sweep_ms = tuple(int(m) for m in a.sweep.split(",") if m)
    device, lib, sms = setup(a.quick)
    ms = tuple(int(m) for m in a.ms.split(","))
    runs = QUICK if a.quick else {name: (shape, ms) for name, shape in SHAPES.items()}
    gs = QUICK_GROUP if a.quick else GROUP
    name = "CPU (emulated)" if a.quick else torch.cuda.get_device_name(device)
    print(f"# csrc W4A16 GEMM on {name}, torch {torch.__version__}")
    print(f"group {gs}, bf16 activations, {sms} SMs planned; {TIMING}\n")
    if not a.quick:
        floor = launch_floor_ms(device)
        print(f"One launch a graph replay takes at least {floor:.4f} ms on this host.\n")
    print(
        "| shape | M | plan | csrc ms | TB/s | dense ms | vs dense | tinygemm ms | "
        "vs tinygemm | triton ms | vs triton | fused kernel ms | err | tinygemm err | triton err |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    torch.manual_seed(0)
    arch = "sm_90" if a.quick else gpu_arch(device)
    for name, ((n, k), rows_m) in runs.items():
        w = Weight(n, k, gs, device)
        for m in rows_m:
            rows.append(row(lib, name, w, m, sms, arch, a.quick))
            print_row(rows[-1], w)
    if not a.quick:
        targets(rows)
    if sweep_ms:
        swept = {k: v for k, v in runs.items() if not a.quick or k == SWEEP_QUICK}
        wrong = print_sweep(lib, swept, gs, sweep_ms, sms, arch, device, a.sweep_json)
        if wrong:
            raise SystemExit(f"{len(wrong)} launches gave wrong outputs: " + "; ".join(wrong))


if __name__ == "__main__":
    main()
