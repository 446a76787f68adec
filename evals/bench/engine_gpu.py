"""The engine's figures on a GPU, for the GPU check: speed, agreement with the CPU, memory.

Three subcommands, each one process (the GPU check gives each its own timeout):

    python evals/bench/engine_gpu.py decode ART [--source SRC] [--batches 1,16,64,256]
    python evals/bench/engine_gpu.py agree ART
    python evals/bench/engine_gpu.py memory ART [--full-layers 32]

`decode`: the start-up time and the first request's step times in a fresh process (a kernel
compiled on the request path shows there, not in a warmed benchmark); prefill and decode
tokens/s per batch size after a warm-up; GPU kernel time per decode step from the profiler
against the step's wall time (the host's share is what the GPU sits idle for); the same with
CUDA graphs off (`enforce_eager`) and with overlapped scheduling off (`overlap_schedule`), where
EngineConfig has them; the weights a decode step reads
over the measured device copy bandwidth (the floor no decoder can beat); and transformers' bf16
`generate` on the same random weights and prompts, as decode rates measured the same way.

`agree`: greedy tokens and prompt logprobs of the GPU backend (bf16 and fp16) against the CPU
backend in fp32, on a few prompts. On a random model the top logits nearly tie, so rounding
alone can flip a greedy token; the logprob difference is the figure to read, judged against
the CPU backend's own bf16 on the same reference (what bf16 rounding alone moves).

`memory`: device bytes of the weights (whole model, per layer), the KV pool, and the peak
during decode; with --full-layers, the layer-proportional part projected to the full depth
(the GPU check builds the 8B shape with a few layers, since quantizing all 32 on the CPU does
not fit its time budget).

Every subcommand prints markdown on stdout (tables row by row, so a timeout keeps the rows
already measured) and progress on stderr. Runs on a CPU too (the GPU check's --smoke), where
the GPU-only figures say n/a.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import engine as bench  # this folder's engine.py: prompts(), hf_generate(), weight_bytes(), ...
import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.cuda.backend import PDL_ENV, SWAP_ENV
from runtime.kernels.triton.launch import PDL_ENV as TRITON_PDL_ENV


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def out(msg: str = "") -> None:
    print(msg, flush=True)


# --- engines ---------------------------------------------------------------------------------


def config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(EngineConfig)}


def make_engine(artifact: Path, **fields) -> tuple[Engine, float]:
    """An Engine with the given EngineConfig fields, leaving out those this checkout's
    EngineConfig lacks (the check must run before and after a field lands); returns the
    engine and its start-up seconds (load, KV pool, graph capture if any)."""
    known = config_fields()
    dropped = sorted(k for k in fields if k not in known)
    if dropped:
        log(f"EngineConfig has no {', '.join(dropped)}: left out")
    start = time.perf_counter()
    engine = Engine(artifact, EngineConfig(**{k: v for k, v in fields.items() if k in known}))
    sync(engine_device(engine))
    return engine, time.perf_counter() - start


def engine_device(engine: Engine) -> torch.device:
    return torch.device(engine.ops.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prompts(batch: int, vocab: int, length: int) -> list[list[int]]:
    """engine.py's prompts (seeded, random ids) cut or repeated to `length` tokens."""
    ps = bench.prompts(batch, vocab)
    return [(p * (-(-length // len(p))))[:length] for p in ps]


@dataclass(frozen=True)
class BatchRun:
    """One batch run to completion: prefill until every sequence has its first token, then
    decode. Step times are host wall times of `Engine.step()` calls."""

    batch: int
    prompt_len: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    step_ms: tuple[float, ...]  # every step, prefill steps first
    prefill_steps: int
    # Tokens sampled after the prefill phase: with chunked prefill, the sequences admitted
    # first decode while later ones still prefill, so this is less than batch * (new - 1).
    decode_tokens: int

    @property
    def prefill_tok_s(self) -> float:
        return self.batch * self.prompt_len / self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def decode_steps(self) -> tuple[float, ...]:
        return self.step_ms[self.prefill_steps :]

    @property
    def decode_step_ms(self) -> float:
        return 1000 * self.decode_s / max(len(self.decode_steps), 1)


def run_batch(
    engine: Engine, ps: list[list[int]], new: int, sync_each_step: bool = False
) -> BatchRun:
    """Greedy, EOS ignored, `new` tokens per prompt. With sync_each_step every step waits for
    the device, so each step's time is its own (for the first request); otherwise the device
    is synchronised only at the phase boundaries, as a server would run."""
    device = engine_device(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in ps]
    steps: list[float] = []

    def step() -> None:
        t = time.perf_counter()
        engine.step()
        if sync_each_step:
            sync(device)
        steps.append(1000 * (time.perf_counter() - t))

    sync(device)
    start = time.perf_counter()
    while any(len(s.token_ids) == s.num_prompt and not s.finished for s in seqs):
        step()
    sync(device)
    prefill = time.perf_counter() - start
    n_prefill = len(steps)
    sampled = sum(len(s.output_ids) for s in seqs)
    start = time.perf_counter()
    while any(not s.finished for s in seqs):
        step()
    sync(device)
    decode = time.perf_counter() - start
    lens = {len(s.output_ids) for s in seqs}
    if lens != {new}:
        raise RuntimeError(f"asked for {new} new tokens per sequence, got {sorted(lens)}")
    decode_tokens = len(ps) * new - sampled
    return BatchRun(
        len(ps), len(ps[0]), new, prefill, decode, tuple(steps), n_prefill, decode_tokens
    )


@dataclass(frozen=True)
class GpuTime:
    kernel_ms: float  # summed device time of kernels and copies, per step
    ops: float  # device operations (kernels, copies, memsets) per step
    # (name, calls per step, us per step) of each device operation, most time first
    by_name: tuple[tuple[str, float, float], ...] = ()


def profile_decode(engine: Engine, ps: list[list[int]], steps: int = 10) -> GpuTime:
    """Device time per decode step from the profiler (CUDA activity only: the host-side
    overhead of recording CPU ops would distort nothing here, but is not needed either)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = engine_device(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in ps]
    while any(len(s.token_ids) < s.num_prompt + 3 for s in seqs):
        engine.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    while any(not s.finished for s in seqs):
        engine.step()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in events)
    calls: dict[str, int] = {}
    times: dict[str, float] = {}
    for e in events:
        calls[e.name] = calls.get(e.name, 0) + 1
        times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
    by_name = tuple(
        (name, calls[name] / steps, times[name] / steps)
        for name in sorted(times, key=times.__getitem__, reverse=True)
    )
    return GpuTime(busy_us / 1000 / steps, len(events) / steps, by_name)


def print_breakdown(g: GpuTime, batch: int, top: int = 15) -> None:
    """Where a decode step's device time goes: the operations that take most of it, and how
    many launches the rest are (at batch 1 most kernels are small, and each costs its launch
    and tail whatever its size)."""
    out(f"\n### Where a batch-{batch} decode step's GPU time goes (profiler, per step)\n")
    out("| device operation | calls | us | share | us a call |\n|---|---:|---:|---:|---:|")
    total = sum(us for _, _, us in g.by_name)
    for name, n, us in g.by_name[:top]:
        short = name if len(name) <= 80 else name[:77] + "..."
        short = short.replace("|", "/")
        out(f"| `{short}` | {n:.0f} | {us:.1f} | {us / total:.0%} | {us / n:.2f} |")
    rest = g.by_name[top:]
    if rest:
        n, us = sum(r[1] for r in rest), sum(r[2] for r in rest)
        out(f"| {len(rest)} others | {n:.0f} | {us:.1f} | {us / total:.0%} | {us / n:.2f} |")


def sync_sites(
    engine: Engine, ps: list[list[int]], params: SamplingParams, steps: int = 16
) -> tuple[float, list[tuple[str, int]]]:
    """Stream synchronizations per decode step, by torch's sync debug mode, and the lines that
    made the most. Overlapped scheduling gains nothing from a step that syncs the stream: the
    host then waits for the step it just queued."""
    import warnings
    from collections import Counter

    seqs = [engine.add_request(p, params) for p in ps]
    while any(len(s.token_ids) == s.num_prompt and not s.finished for s in seqs):
        engine.step()
    engine.step()
    sync(engine_device(engine))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for s in seqs:
        engine.abort(s.seq_id)
    while engine.has_work():
        engine.step()
    sites = Counter(
        f"{Path(w.filename).name}:{w.lineno}"
        for w in caught
        if "synchroniz" in str(w.message).lower()
    )
    return sum(sites.values()) / steps, sites.most_common(4)


def device_copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write): the practical ceiling for
    streaming the weights once per step."""
    if device.type != "cuda":
        return bench.copy_bandwidth()
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000 / 10
    del src, dst
    return 2 * 2**30 / seconds


def weights_read_per_step(engine: Engine) -> tuple[int, str]:
    """Bytes of weights a batch-1 decode step reads: on the CPU engine.py's count (the forms
    its measured dispatch reads); on a GPU every tensor of the decoder layers and the lm_head
    (the embedding too where it is tied; an untied one is read a row per token), as stored."""
    if engine.backend == "cpu":
        return int(bench.weight_bytes(engine)), "int4 linears + group params + lm_head"
    device, model, seen = engine_device(engine), engine.model, set()
    layers = sum(tensor_bytes(layer, device, seen) for layer in model.layers)
    return layers + tensor_bytes(model.lm_head, device, seen), "decoder layers + lm_head"


# --- decode ----------------------------------------------------------------------------------


def cmd_decode(a: argparse.Namespace) -> None:
    batches = [int(b) for b in a.batches.split(",")]
    fields = dict(
        backend=a.backend,
        kv_quant=a.kv_quant,
        session_len=a.prompt_len + a.new_tokens + 64,
        max_batch_size=max(batches),
    )
    log(f"starting the engine on {a.artifact} ({fields})")
    engine, start_s = make_engine(a.artifact, **fields)
    device = engine_device(engine)
    vocab = engine.arch.vocab_size
    on_gpu = device.type == "cuda"
    dtype = str(engine.dtype).removeprefix("torch.")
    if not on_gpu:
        graphs = "n/a on a CPU"
    elif "enforce_eager" in config_fields():
        graphs = "on (the default; enforce_eager=False)"
    else:
        graphs = "as this checkout does it (EngineConfig has no enforce_eager)"
    out(
        f"Engine: backend {engine.backend} ({engine.ops.detail}) on {device}, {dtype} "
        f"activations, kv {engine.config.kv_quant}; {a.prompt_len}-token random prompts, greedy, "
        f"EOS ignored. CUDA graphs: {graphs}."
    )

    # The first request in a fresh process, each step synchronised: a compile shows here.
    first = run_batch(engine, prompts(1, vocab, a.prompt_len), 32, sync_each_step=True)
    dec = first.decode_steps
    steady = statistics.median(dec[16:]) if len(dec) > 16 else statistics.median(dec)
    out("\n### Start-up and the first request (batch 1, fresh process)\n")
    out(
        "| engine start s | first prefill step ms | first decode step ms "
        "| slowest of first 8 decode steps ms | steady decode step ms (median, steps 17-31) |"
    )
    out("|---:|---:|---:|---:|---:|")
    out(
        f"| {start_s:.1f} | {max(first.step_ms[: first.prefill_steps]):.1f} | {dec[0]:.2f} | "
        f"{max(dec[:8]):.2f} | {steady:.2f} |"
    )
    first_request_ratio = max(dec[:8]) / steady

    out(f"\n### Decode, {a.new_tokens} new tokens per sequence\n")
    out(
        "Each batch size runs twice: a short cold run (the slowest step shows a compile on "
        "first use of a batch size), then the measured run. GPU kernel ms: profiler device "
        "time per decode step (10 steps); GPU idle = step - kernel time, the host's share not "
        "hidden behind the GPU.\n"
    )
    out(
        "| batch | prefill tok/s | decode tok/s | step ms | cold run's slowest step ms "
        "| GPU kernel ms/step | GPU idle ms/step | device ops/step |"
    )
    out("|---:|---:|---:|---:|---:|---:|---:|---:|")
    runs: dict[int, BatchRun] = {}
    gpu: dict[int, GpuTime] = {}
    for b in batches:
        ps = prompts(b, vocab, a.prompt_len)
        cold = run_batch(engine, ps, 8)
        runs[b] = run = run_batch(engine, ps, a.new_tokens)
        kernel = idle = ops = "n/a"
        if on_gpu:
            try:
                gpu[b] = g = profile_decode(engine, ps)
                kernel, ops = f"{g.kernel_ms:.2f}", f"{g.ops:.0f}"
                idle = f"{max(run.decode_step_ms - g.kernel_ms, 0.0):.2f}"
            except Exception as e:  # the profiler is optional equipment; the rest still counts
                kernel = f"profiler failed: {type(e).__name__}: {str(e)[:80]}"
        out(
            f"| {b} | {run.prefill_tok_s:.0f} | {run.decode_tok_s:.1f} | "
            f"{run.decode_step_ms:.2f} | {max(cold.step_ms):.1f} | {kernel} | {idle} | {ops} |"
        )

    if gpu:
        first = next(iter(gpu))  # the smallest batch: where small kernels weigh most
        print_breakdown(gpu[first], first)
    if on_gpu:
        out("\n### Stream synchronizations inside decode steps (sync debug mode, batch 16)\n")
        out("| rows | syncs per decode step | where, most first (file:line x count) |")
        out("|---|---:|---|")
        ps = prompts(16, vocab, a.prompt_len)
        for name, params in (
            ("greedy", SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)),
            (
                "top-p 0.9, temperature 0.7",
                SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=64, ignore_eos=True),
            ),
        ):
            try:
                per_step, top = sync_sites(engine, ps, params)
                where = ", ".join(f"{site} x{n}" for site, n in top) or "none"
                out(f"| {name} | {per_step:.1f} | {where} |")
            except Exception as e:  # a diagnostic: the figures above still count
                out(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | |")

    bandwidth = device_copy_bandwidth(device)
    wbytes, what = weights_read_per_step(engine)
    floor_ms = 1000 * wbytes / bandwidth
    b0 = batches[0]
    out(
        f"\nStreaming floor: a decode step reads {wbytes / 2**20:.0f} MiB of weights ({what}); "
        f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s; floor {floor_ms:.3f} ms per step. "
        f"The batch-{b0} step ({runs[b0].decode_step_ms:.2f} ms) is "
        f"{runs[b0].decode_step_ms / floor_ms:.1f}x the floor."
    )
    backend, fused_env = engine.backend, engine.ops.fused_env
    del engine
    free(device)

    if a.source:
        hf_baseline(a.source, batches, a.hf_new_tokens, vocab, a.prompt_len, device, runs)

    if on_gpu:
        out("\n### Against the issue's targets (1B shape, RTN g128, int8 KV, 128-token prompts)\n")
        out("| measure | measured | target | met |")
        out("|---|---:|---:|---|")

        def row(name: str, measured: str, target: str, ok: bool | None) -> None:
            verdict = "n/a" if ok is None else ("yes" if ok else "no")
            out(f"| {name} | {measured} | {target} | {verdict} |")

        if 1 in runs:
            ms = runs[1].decode_step_ms
            row("batch-1 decode step", f"{ms:.2f} ms", "<= 1.5 ms", ms <= 1.5)
        if 64 in runs:
            tps = runs[64].decode_tok_s
            row("batch-64 decode", f"{tps:.0f} tok/s", ">= 12000 tok/s", tps >= 12000)
        for b in (b for b in batches if b >= 16 and b in gpu):
            idle = runs[b].decode_step_ms - gpu[b].kernel_ms
            row(
                f"host share of a batch-{b} step (GPU idle)",
                f"{idle:.2f} ms vs GPU {gpu[b].kernel_ms:.2f} ms",
                "below the GPU time",
                idle < gpu[b].kernel_ms,
            )
        row(
            "first request: slowest early decode step / steady",
            f"{first_request_ratio:.1f}x",
            "no compile (<= 2x)",
            first_request_ratio <= 2.0,
        )

    # the A/B comparisons last: each starts another engine (Triton's PDL one recompiles every
    # kernel), so a stage cut short by its time limit has printed the targets already
    for field, value, what in (
        ("enforce_eager", True, "CUDA graphs against eager decode"),
        ("overlap_schedule", False, "overlapped scheduling against step by step"),
    ):
        compare_decode(a, fields, runs, start_s, field, value, what)
    if fused_env:  # the backend's switch (cuda, triton): its pointwise kernels or torch's ops
        what = f"backend {backend}'s pointwise kernels (rotary + KV write, add + RMSNorm, "
        what += f"SiLU-and-mul) against torch's ops ({fused_env}=0)"
        with mock.patch.dict(os.environ, {fused_env: "0"}):
            compare_decode(a, fields, runs, start_s, "", None, what)
    if backend == "cuda":
        what = "programmatic dependent launch (sm_90) against plain stream order"
        with mock.patch.dict(os.environ, {PDL_ENV: "0"}):
            compare_decode(a, fields, runs, start_s, "", None, what)
        what = f"the GEMM plans with the swapped decode tiles against those without ({SWAP_ENV}=0)"
        with mock.patch.dict(os.environ, {SWAP_ENV: "0"}):
            compare_decode(a, fields, runs, start_s, "", None, what)
    if backend == "triton":  # opt-in there: the other engine is the one with it
        what = f"plain stream order against programmatic dependent launch ({TRITON_PDL_ENV}=1)"
        try:  # never run on a GPU before: a failure is a finding, not the end of the stage
            with mock.patch.dict(os.environ, {TRITON_PDL_ENV: "1"}):
                compare_decode(a, fields, runs, start_s, "", None, what)
        except Exception as e:  # noqa: BLE001
            out(f"\n### {what}\n\nfailed: {type(e).__name__}: {str(e)[:300]}")
            free(device)


def compare_decode(
    a: argparse.Namespace,
    fields: dict,
    runs: dict[int, BatchRun],
    start_s: float,
    field: str,
    value: object,
    what: str,
) -> None:
    """The default engine's decode steps (``runs``) against an engine with ``field=value``,
    at batch 1 and 64, where this checkout's EngineConfig has the field; no field (""): the
    engine as the environment makes it (the caller sets os.environ), named by ``what``."""
    if field and field not in config_fields():
        out(f"\nEngineConfig has no {field} field in this checkout: {what} skipped.")
        return
    batches = [b for b in (1, 64) if b in runs] or list(runs)[:1]
    other_name = f"{field}={value}" if field else "other"
    log(f"the same with {other_name}: {what}")
    engine, start_other = make_engine(a.artifact, **fields, **({field: value} if field else {}))
    device = engine_device(engine)
    vocab = engine.arch.vocab_size
    out(f"\n### {what} ({other_name})\n" if field else f"\n### {what}\n")
    out(f"Engine: {engine.ops.detail}. Start {start_other:.1f} s (default: {start_s:.1f} s).\n")
    out(
        f"| batch | default step ms | {other_name} step ms | its decode tok/s "
        "| default's speed-up |"
    )
    out("|---:|---:|---:|---:|---:|")
    for b in batches:
        ps = prompts(b, vocab, a.prompt_len)
        run_batch(engine, ps, 8)
        other = run_batch(engine, ps, a.new_tokens)
        ms = runs[b].decode_step_ms
        out(
            f"| {b} | {ms:.2f} | {other.decode_step_ms:.2f} | {other.decode_tok_s:.1f} | "
            f"{other.decode_step_ms / ms:.2f}x |"
        )
    del engine
    free(device)


def hf_baseline(
    source: Path,
    batches: list[int],
    new: int,
    vocab: int,
    prompt_len: int,
    device: torch.device,
    runs: dict[int, BatchRun],
) -> dict[int, float]:
    """transformers' `generate` in bf16 on the same random weights and prompts. Its decode
    rate is b * (new - 1) / (t(new tokens) - t(1 token)): the prefill cancels out, so it
    compares with the runtime's decode rate."""
    from transformers import AutoModelForCausalLM

    log(f"transformers baseline from {source}")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).to(device).eval()

    out(f"\n### transformers bf16 `generate` on the same weights ({new} new tokens)\n")
    out(
        "hf decode tok/s = b * (n - 1) / (t(n tokens) - t(1 token)); n/a where that difference "
        "is within noise (then the ratio uses the end-to-end rate, b * n / t(n)).\n"
    )
    out("| batch | hf end-to-end tok/s | hf decode tok/s | runtime decode tok/s | runtime / hf |")
    out("|---:|---:|---:|---:|---:|")
    rates = {}
    for b in batches:
        ids = torch.tensor(prompts(b, vocab, prompt_len), device=device)
        bench.hf_generate(model, ids[:, :16], 2)  # warm-up
        t1 = min(bench.hf_generate(model, ids, 1) for _ in range(2))
        tn = bench.hf_generate(model, ids, new)
        e2e = b * new / tn
        decode = b * (new - 1) / (tn - t1) if tn - t1 > 0.1 * tn else None
        rates[b] = rate = decode or e2e
        rt = runs[b].decode_tok_s
        shown = f"{decode:.1f}" if decode else "n/a"
        out(f"| {b} | {e2e:.1f} | {shown} | {rt:.1f} | {rt / rate:.2f}x |")
    del model
    free(device)
    return rates


# --- agree -----------------------------------------------------------------------------------


# How far past the CPU's own bf16 spread a GPU backend's prompt logprobs may sit: fp16 has 3 more
# mantissa bits than bf16, but the GPU sums in other orders (split-K, partitions, fused
# multiply-adds), so the same rounding budget, with room for the prompts' chance.
YARDSTICK_SLACK = 1.5


def cmd_agree(a: argparse.Namespace) -> None:
    """GPU backend (bf16, fp16) against the CPU backend in fp32: greedy tokens and prompt
    logprobs of the same prompts; then the CPU backend in bf16 against the same reference,
    the spread that bf16 rounding alone gives in this model, which the GPU's is judged by."""
    from runtime.engine.sequence import Sequence

    def generate(**fields) -> tuple[list[Sequence], str]:
        engine, _ = make_engine(
            a.artifact, kv_quant=a.kv_quant, session_len=256, max_batch_size=a.prompts, **fields
        )
        label = f"{engine.backend} {str(engine.dtype).removeprefix('torch.')} on " + str(
            engine_device(engine)
        )
        vocab = engine.arch.vocab_size
        params = SamplingParams(
            temperature=0.0, max_new_tokens=a.new_tokens, ignore_eos=True, prompt_logprobs=0
        )
        seqs = engine.generate(prompts(a.prompts, vocab, a.prompt_len), params)
        device = engine_device(engine)
        del engine
        free(device)
        return seqs, label

    def logprobs(seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor(
            [lp.logprob for s in seqs for lp in s.prompt_logprobs if lp is not None],
            dtype=torch.float64,
        )

    log("reference: backend cpu, float32")
    ref, ref_label = generate(backend="cpu", dtype="float32")
    ref_lp = logprobs(ref)
    out(
        f"{a.prompts} prompts of {a.prompt_len} random tokens, {a.new_tokens} greedy tokens, "
        f"kv {a.kv_quant}; reference: {ref_label} (prompt logprob std {ref_lp.std():.3f}).\n"
    )
    out(
        "| engine | greedy tokens equal | first differing token per prompt "
        "| prompt logprob max abs diff | mean abs diff |"
    )
    out("|---|---:|---|---:|---:|")
    failed, worst = [], {}
    runs = [(a.backend, dtype) for dtype in a.dtypes.split(",")]
    if a.backend != "cpu":  # the yardstick: what bf16 rounding alone moves, on the CPU
        runs.append(("cpu", "bfloat16"))
    for backend, dtype in runs:
        try:
            seqs, label = generate(backend=backend, dtype=dtype)
        except Exception as e:  # the next run's figures still count; the exit status says
            log(f"backend {backend} {dtype} failed: {e!r}")
            out(f"| {backend} {dtype} | failed: {type(e).__name__}: {str(e)[:120]} | | | |")
            failed.append(f"{backend} {dtype}")
            continue
        pairs = list(zip(seqs, ref, strict=True))
        diverge = [first_difference(s.output_ids, r.output_ids) for s, r in pairs]
        same = diverge.count("-")
        diff = (logprobs(seqs) - ref_lp).abs()
        worst[backend, dtype] = float(diff.max())
        out(
            f"| {label} | {same}/{len(ref)} | {', '.join(diverge)} | "
            f"{diff.max():.4f} | {diff.mean():.4f} |"
        )
    yardstick = worst.pop(("cpu", "bfloat16"), None) if a.backend != "cpu" else None
    if yardstick is not None and worst:
        within = all(d <= YARDSTICK_SLACK * yardstick for d in worst.values())
        out(
            f"\nThe CPU backend in bf16 is the yardstick: rounding alone moves its prompt logprobs "
            f"by up to {yardstick:.4f} from its own fp32. {a.backend} stays within "
            f"{YARDSTICK_SLACK}x of that: {'yes' if within else '**no**'}."
        )
        if not within:
            failed.append(f"{a.backend} beyond {YARDSTICK_SLACK}x the CPU's bf16 spread")
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def first_difference(a: list[int], b: list[int]) -> str:
    """Index of the first differing token, '-' when none does."""
    return next((str(i) for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), "-")


# --- memory ----------------------------------------------------------------------------------


def tensor_bytes(obj: object, device: torch.device, seen: set[int] | None = None) -> int:
    """Bytes of every tensor on `device` reachable from obj's attributes, lists and dicts, each
    storage counted once (tied embeddings, views). Attribute names may move; this does not
    care. Functions, classes and modules are not followed (the backend's op table)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen or obj.device.type != device.type:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, _NOT_FOLLOWED):
        items = list(vars(obj).values())
    else:
        return 0
    return sum(tensor_bytes(x, device, seen) for x in items)


_NOT_FOLLOWED = (
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    functools.partial,
)


def cmd_memory(a: argparse.Namespace) -> None:
    engine, start_s = make_engine(
        a.artifact,
        backend=a.backend,
        kv_quant=a.kv_quant,
        session_len=a.session_len,
        max_batch_size=max(a.batch, 1),
    )
    device = engine_device(engine)
    on_gpu = device.type == "cuda"
    arch = engine.arch
    model = engine.model
    seen: set[int] = set()
    layer_bytes = [tensor_bytes(layer, device, seen) for layer in model.layers]
    rest = tensor_bytes(model, device, seen)  # embedding, lm_head, final norm, rotary tables
    weights = rest + sum(layer_bytes)
    pool = tensor_bytes(engine.cache, device)
    per_layer = statistics.mean(layer_bytes)
    per_token = engine.kv_spec.bytes_per_token()
    allocated = torch.cuda.memory_allocated(device) if on_gpu else None
    out(
        f"Artifact {a.artifact.name}: {arch.num_layers} layers of hidden {arch.hidden_size}, "
        f"vocab {arch.vocab_size}; backend {engine.backend} on {device}, kv "
        f"{engine.config.kv_quant}; engine start {start_s:.1f} s.\n"
    )
    out("| measure | MiB |")
    out("|---|---:|")
    out(f"| weights on the device | {weights / 2**20:.1f} |")
    out(f"| of which per decoder layer | {per_layer / 2**20:.1f} |")
    out(f"| of which embedding, lm_head, norm | {rest / 2**20:.1f} |")
    out(
        f"| KV pool ({engine.blocks.num_blocks} blocks; {per_token / 1024:.1f} KiB per token) "
        f"| {pool / 2**20:.1f} |"
    )
    if allocated is not None:
        out(f"| torch allocated after start-up | {allocated / 2**20:.1f} |")

    vocab = arch.vocab_size
    peaks = []
    for b in sorted({1, a.batch}):
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        run = run_batch(engine, prompts(b, vocab, a.prompt_len), a.new_tokens)
        peak = (torch.cuda.max_memory_allocated(device) - before) if on_gpu else None
        peaks.append((b, run, peak))
    bandwidth = device_copy_bandwidth(device)
    out("\n| batch | decode step ms | decode tok/s | streaming floor ms | activation peak MiB |")
    out("|---:|---:|---:|---:|---:|")
    for b, run, peak in peaks:
        p = f"{peak / 2**20:.1f}" if peak is not None else "n/a (CPU)"
        out(
            f"| {b} | {run.decode_step_ms:.2f} | {run.decode_tok_s:.1f} | "
            f"{1000 * weights / bandwidth:.3f} | {p} |"
        )

    full = a.full_layers or arch.num_layers
    if full != arch.num_layers:
        projected = rest + full * per_layer
        out(
            f"\nProjected to {full} layers (the per-layer part scaled by {full}/"
            f"{arch.num_layers}; the embedding and lm_head as measured):\n"
        )
        out("| measure | GiB |")
        out("|---|---:|")
        out(f"| int4 weights on the device | {projected / 2**30:.2f} |")
        params = _dense_params(arch, full)
        out(
            f"| the same model dense in bf16 ({params / 1e9:.2f} B parameters) | "
            f"{2 * params / 2**30:.2f} |"
        )
        out(
            f"| KV, {engine.config.kv_quant}, per 1k tokens | "
            f"{per_token * full / arch.num_layers * 1024 / 2**30:.3f} |"
        )


def _dense_params(arch, layers: int) -> int:
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return layers * per_layer + embed + h


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    on_gpu = torch.cuda.is_available()
    default_backend = "triton" if on_gpu else "cpu"

    d = sub.add_parser("decode", help="speed: start-up, first request, decode per batch size")
    d.add_argument("artifact", type=Path)
    d.add_argument("--source", type=Path, help="the HF directory, for transformers' baseline")
    d.add_argument("--batches", default="1,16,64,256")
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--hf-new-tokens", type=int, default=32, help="transformers' run length")
    d.add_argument("--prompt-len", type=int, default=bench.PROMPT_LEN)
    d.add_argument("--backend", default=default_backend)
    d.add_argument("--kv-quant", default="int8")

    g = sub.add_parser("agree", help="GPU backend against the CPU backend in fp32")
    g.add_argument("artifact", type=Path)
    g.add_argument("--backend", default="triton")
    g.add_argument("--dtypes", default="bfloat16,float16" if on_gpu else "float16")
    g.add_argument("--prompts", type=int, default=4)
    g.add_argument("--prompt-len", type=int, default=48)
    g.add_argument("--new-tokens", type=int, default=12)
    g.add_argument("--kv-quant", default="int8")

    m = sub.add_parser("memory", help="device memory of weights, KV pool and decode")
    m.add_argument("artifact", type=Path)
    m.add_argument("--full-layers", type=int, help="project the per-layer part to this depth")
    m.add_argument("--backend", default=default_backend)
    m.add_argument("--kv-quant", default="int8")
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--session-len", type=int, default=1024)
    m.add_argument("--prompt-len", type=int, default=bench.PROMPT_LEN)
    m.add_argument("--new-tokens", type=int, default=64)

    a = p.parse_args()
    {"decode": cmd_decode, "agree": cmd_agree, "memory": cmd_memory}[a.cmd](a)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
