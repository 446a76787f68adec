"""The engine's host time per decode step, outside the model and the sampler.

That is the work overlapped scheduling hides behind the GPU's step (runtime.engine.overlap):
scheduling, step inputs, recording computed KV, reading ids, detokenizing, stop checks. On a
GPU, a decode step takes about max(this, GPU time) with overlap and their sum without; issue
11's target asks for it below the GPU's step at batch >= 16.

Measured on the CPU backend, where every op is synchronous, so the model's and the sampler's
time can be taken out exactly: greedy decode of batches of 20-token prompts, 20 steps timed
after 4, median of --rounds fresh engines, step by step against overlapped (on the CPU overlap
gains nothing: the ratio shows that it costs no host time either).

    python evals/bench/engine_host.py ARTIFACT [--batches 1,16,64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from runtime.config import EngineConfig
from runtime.engine.engine import Engine

STEPS = 20


def host_ms(artifact: Path, batch: int, overlap: bool) -> tuple[float, float]:
    """(host ms per decode step outside the model and the sampler, whole step ms)."""
    engine = Engine(
        artifact,
        EngineConfig(
            backend="cpu",
            max_batch_size=batch,
            session_len=256,
            kv_quant="int8",
            overlap_schedule=overlap,
        ),
    )
    params = engine.sampling_params(temperature=0.0, max_new_tokens=STEPS + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1 + (i * 7 + j) % 1000 for j in range(20)], params)
    for _ in range(4):  # the prefill, and the first decodes
        engine.step()
    spent = [0.0]
    run, sample = engine.runner.step, engine.sampler.sample

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    engine.runner.step, engine.sampler.sample = timed(run), timed(sample)
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    total = time.perf_counter() - start
    return 1000 * (total - spent[0]) / STEPS, 1000 * total / STEPS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print("| batch | host ms, step by step | host ms, overlapped | ratio | whole step ms |")
    print("|---:|---:|---:|---:|---:|")
    for batch in map(int, a.batches.split(",")):
        runs = {
            overlap: [host_ms(a.artifact, batch, overlap) for _ in range(a.rounds)]
            for overlap in (False, True)
        }
        off, on = (statistics.median(r[0] for r in runs[o]) for o in (False, True))
        step = statistics.median(r[1] for r in runs[False])
        print(f"| {batch} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
