"""Engine throughput on this CPU against transformers' `generate`, in one process.

Prefill tokens/s and decode tokens/s at batch 1, 8 and 32 (greedy, 128 new tokens, EOS
ignored), for the runtime on an artifact and for transformers on its source model in fp32 and
bf16. Prints ratios, the weight bytes a decode step reads over the measured step time as a
fraction of this machine's measured copy bandwidth, and where a decode step's time goes.

    python evals/bench/engine.py --artifact out/smollm2-awq [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict
from pathlib import Path

import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams

PROMPT_LEN = 128


def copy_bandwidth() -> float:
    """Bytes/s of a large tensor copy (read + write), the machine's practical ceiling."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def bench_runtime(engine: Engine, batch: int, new: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for one batch."""
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts(batch, engine.arch.vocab_size)]
    t = time.perf_counter()
    while any(s.num_computed < s.num_prompt for s in seqs):
        engine.step()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    while any(not s.finished for s in seqs):
        engine.step()
    decode = time.perf_counter() - t
    return batch * PROMPT_LEN / prefill, batch * (new - 1) / decode


def bench_hf(model, batch: int, new: int, vocab: int) -> float:
    ids = torch.tensor(prompts(batch, vocab))
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    return batch * new / (time.perf_counter() - t)


def profile_decode(engine: Engine, batch: int) -> dict[str, float]:
    """Milliseconds per decode step in each backend op, timed by wrapping the ops the model
    calls (a profiler's per-op overhead would swamp the small ops it is meant to find)."""
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts(batch, engine.arch.vocab_size)]
    while any(s.num_computed < s.num_prompt for s in seqs):
        engine.step()
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t
            return out

        return run

    model, ops = engine.model, engine.model.ops
    wrapped = copy.copy(ops)  # the same backend, its ops timed on the copy's attributes
    for op, name in (
        ("int4_linear", "int4 linears"),
        ("attention", "attention"),
        ("kv_write", "kv write"),
        ("rms_norm", "rms norms"),
        ("logits", "lm_head"),
    ):
        setattr(wrapped, op, timed(name, getattr(ops, op)))
    linears = [
        lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    modules = [model, *model.layers, *linears]
    for m in modules:
        m.ops = wrapped
    run_model = engine.runner.run
    engine.runner.run = timed("model forward", run_model)
    steps = 0
    try:
        t = time.perf_counter()
        while any(not s.finished for s in seqs):
            engine.step()
            steps += 1
        wall = time.perf_counter() - t
    finally:
        for m in modules:
            m.ops = ops
        engine.runner.run = run_model
    out = {k: 1000 * v / steps for k, v in spent.items() if k != "model forward"}
    forward = 1000 * spent["model forward"] / steps
    rest = forward - sum(out.values())
    out["rest of the forward (rotary, activations, residuals, python)"] = rest
    out["outside the forward (scheduler, sampler, detokenizer)"] = 1000 * wall / steps - forward
    out["step"] = 1000 * wall / steps
    return out


def weight_bytes(engine: Engine) -> int:
    """Bytes one decode step must read: int4 weights + group params + the fp lm_head/norms."""
    total = engine.model.lm_head.numel() * engine.model.lm_head.element_size()
    for layer in engine.model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w = lin.weight
            total += w.packed.numel() + w.scales_zeros.numel() * w.scales_zeros.element_size()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m-instruct", help="source for transformers")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--kv-quant", default="int8")
    p.add_argument("--dtype", default="auto", help="runtime activations (auto: bf16 on a CPU)")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}")

    engine = Engine(
        a.artifact,
        EngineConfig(
            kv_quant=a.kv_quant, session_len=1024, max_batch_size=max(batches), dtype=a.dtype
        ),
    )
    bench_runtime(engine, 2, 4)  # warm-up: first calls build kernels' primitives
    rt = {b: bench_runtime(engine, b, a.new_tokens) for b in batches}

    from lite.hf import load_source_model
    from lite.sources import resolve

    source = resolve(a.model).path
    hf32 = load_source_model(source)
    vocab = engine.arch.vocab_size
    bench_hf(hf32, 1, 4, vocab)  # warm-up, as for the runtime
    hf = {("fp32", b): bench_hf(hf32, b, a.new_tokens, vocab) for b in batches}
    hf16 = hf32.to(torch.bfloat16)
    hf.update({("bf16", b): bench_hf(hf16, b, a.new_tokens, vocab) for b in batches})

    print(
        f"\n{a.new_tokens} new tokens after {PROMPT_LEN}-token prompts, greedy, kv {a.kv_quant}, "
        f"runtime activations {engine.dtype}\n"
    )
    print(
        "| batch | runtime prefill tok/s | runtime decode tok/s | hf fp32 tok/s | hf bf16 tok/s "
        "| runtime / hf fp32 | runtime / hf bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        pre, dec = rt[b]
        print(
            f"| {b} | {pre:.0f} | {dec:.1f} | {hf['fp32', b]:.1f} | {hf['bf16', b]:.1f} | "
            f"{dec / hf['fp32', b]:.2f}x | {dec / hf['bf16', b]:.2f}x |"
        )
    step_s = 1 / rt[batches[0]][1]
    wb = weight_bytes(engine)
    print(
        f"\nweights read per decode step: {wb / 2**20:.1f} MiB; at batch {batches[0]} that is "
        f"{wb / step_s / 1e9:.2f} GB/s = {wb / step_s / bandwidth:.0%} of copy bandwidth"
    )
    for b in (batches[0], batches[-1]):
        print(f"\nwhere a batch-{b} decode step goes (ms):")
        parts = profile_decode(engine, b)
        for k, v in parts.items():
            print(f"  {k}: {v:.2f} ({v / parts['step']:.0%})")


if __name__ == "__main__":
    main()
