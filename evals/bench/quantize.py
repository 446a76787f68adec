"""Quantization benchmark on the shared pydoc protocol: source vs RTN vs AWQ, one table.

Each quantization runs `lite auto_awq` as a child process, so its wall time and peak RSS are
the command's own (the one-off GGUF conversion is done before the clock starts). Perplexity
is scored in this process on the held-out pydoc part: 512-token non-overlapping windows, no
BOS, each window alone. Ratios are printed against the source model (perplexity) and against
llm-compressor 0.14's AWQModifier measured with the same protocol on the same 2-core machine.

    python evals/bench/quantize.py [--calib-file ../shared/data/groups_merged.txt] [--limit N]
        [--device cpu|cuda]   # cpu by default: the llm-compressor figures are CPU figures
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from pathlib import Path

from lite.perplexity import hf_logits, perplexity, windows
from lite.sources import resolve

MODEL = "smollm2-135m-instruct"
# llm-compressor 0.14 AWQModifier defaults, 64 x 512 in-order pydoc calibration tokens, fp32,
# w4 asymmetric g64, on this 2-core machine (figures from the project's issue tracker).
LLMC = {"ppl": 13.77, "wall_s": 26.7 * 60, "rss_gib": 3.4, "source_ppl": 11.98}


def vm_hwm_gib(pid: int) -> float:
    """A process's own high-water RSS (ru_maxrss would include this parent's at fork)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


def run_quantize(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one `lite auto_awq` child process."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lite", "auto_awq", *args])
    peak = 0.0
    while proc.poll() is None:
        with contextlib.suppress(OSError):  # the child may exit between poll and read
            peak = max(peak, vm_hwm_gib(proc.pid))
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"lite auto_awq {' '.join(args)} failed")
    return time.perf_counter() - start, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib-file", type=Path, help="also calibrate on this text file")
    p.add_argument("--limit", type=int, help="score at most this many 512-token windows")
    p.add_argument("--device", default="cpu", help="lite auto_awq --device (default: cpu)")
    a = p.parse_args()

    from transformers import AutoTokenizer

    from lite.data import heldout_text
    from lite.hf import load_dequantized, load_source_model
    from runtime.artifact.reader import Artifact

    source = resolve(MODEL)  # converts the GGUF once, outside the timed runs
    common = [
        "--w-group-size",
        str(a.group_size),
        "--calib-seqlen",
        str(a.seqlen),
        "--device",
        a.device,
        "--quiet",
        "--overwrite",
    ]
    variants = {"RTN": ["--calib-samples", "0"], "AWQ pydoc": ["--calib-samples", str(a.samples)]}
    if a.calib_file:
        variants[f"AWQ {a.calib_file.name}"] = [
            "--calib-samples",
            str(a.samples),
            "--calib-dataset",
            str(a.calib_file),
        ]

    measured = {}  # all quantizations first, while this process is still small
    for name, extra in variants.items():
        out = a.out / name.lower().replace(" ", "-")
        measured[name] = (out, *run_quantize([MODEL, "--work-dir", str(out), *common, *extra]))

    tok = AutoTokenizer.from_pretrained(source.path)
    ids = tok(heldout_text(), add_special_tokens=False, verbose=False, return_tensors="pt")
    batches = windows(ids.input_ids[0], 512, a.limit)
    source_ppl = perplexity("source", hf_logits(load_source_model(source.path)), batches).ppl
    rows = [("source fp32", None, None, None, source_ppl)]
    for name, (out, wall, rss) in measured.items():
        art = Artifact(out)
        ppl = perplexity(name, hf_logits(load_dequantized(art)), batches).ppl
        rows.append((name, wall, rss, art.size_on_disk() / 2**20, ppl))

    src = rows[0][4]
    print(
        f"\nheld-out pydoc, {len(batches)} x 512 tokens; {a.samples} x {a.seqlen} calibration, "
        f"w4 g{a.group_size} asym\n"
    )
    print("| variant | wall s | peak RSS GiB | size MiB | ppl | ppl vs source |")
    print("|---|---|---|---|---|---|")
    for name, wall, rss, size, ppl in rows:
        w = f"{wall:.0f}" if wall else "-"
        r = f"{rss:.2f}" if rss else "-"
        s = f"{size:.1f}" if size else "-"
        print(f"| {name} | {w} | {r} | {s} | {ppl:.3f} | {100 * (ppl / src - 1):+.1f}% |")
    for name, wall, rss, _, ppl in rows[2:]:
        loss_ratio = (ppl - src) / (LLMC["ppl"] - LLMC["source_ppl"])
        print(
            f"\n{name} vs llm-compressor AWQ: wall {wall / LLMC['wall_s']:.2f}x, "
            f"peak RSS {rss / LLMC['rss_gib']:.2f}x, ppl loss over source {loss_ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
