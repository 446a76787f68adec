"""The GPU check: the GPU tests and the GPU figures in one call, into one markdown file.

A lent GPU machine is scarce (minutes, no network), so everything that needs a GPU runs in one
call of `bash evals/bench/gpu_check.sh` (which sets up the carried wheels, then runs this):

  environment  versions, nvidia-smi, the git commit
  gpu-tests    python -m pytest -q -m gpu
  all-tests    the whole suite on the GPU host, only when named (--only all-tests)
  model-1b     a random Llama of Llama-3.2-1B's shape (the carried 49152-token tokenizer), built
               with transformers on the GPU, and its RTN g128 artifact (`lite auto_awq`)
  model-8b     Llama-3-8B's shape with --layers-8b of its 32 layers (all 32 do not fit the
               time budget), for the memory and calibration figures
  engine       engine_gpu.py decode: start-up, first request, decode at batch 1/16/64/256,
               GPU vs host time, CUDA graphs vs eager, the streaming floor, transformers
  engine-cuda  the same decode figures with backend cuda (the csrc library)
  agree        engine_gpu.py agree: triton (bf16, fp16) against the CPU backend in fp32
  serve        serving_gpu.py: `runtime serve` with 1, 8 and 32 concurrent streams
  kernels      triton_bench.py: the W4A16 GEMM and decode attention on Llama-3-8B shapes
  cuda-attention, cuda-gemm   the csrc kernels against their baselines
  memory-8b    engine_gpu.py memory on the 8B-shaped artifact, projected to 32 layers
  awq-8b       lite auto_awq --device cuda at 128 x 512 calibration tokens on the 8B shape's
               layers: time projected to 32 layers, peak host RSS and GPU memory
  cpu-isa      cpu_isa.py: the CPU engine on this host's own CPU (issue 19: an AVX-512 server
               CPU, where the developers' machine is AVX2-only), 2 threads on 2 cores kept
               for it from the start, every other stage kept off them

The model stages run in the background while the GPU tests run; nothing runs beside the
measuring stages but cpu-isa, on its own cores. Each stage is a subprocess with its own
timeout, taken from one budget (--budget, about 9 minutes in all with the set-up) so that a
slow stage leaves time for the ones after it: each keeps a reserve, its time on an H200
(2026-12-04, where the stages took 371 s together, the GPU tests 97 s of it on 12 pytest-xdist
workers) plus a margin. A stage that fails or times out is recorded with its error and the
check goes on; the exit status is non-zero if any stage did not pass. The
report is rewritten after every stage, so an interrupted run still leaves its figures.

--smoke runs the same pipeline on a CPU with a tiny model in a minute or two (backend cpu;
the triton backend and triton_bench.py interpreted), to check the check itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import cpu_isa  # this folder's: the script's own directory is first on sys.path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
PY = sys.executable


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- stages ----------------------------------------------------------------------------------


@dataclass
class Result:
    status: str  # passed, failed, timed out, skipped
    seconds: float = 0.0
    rc: int | None = None
    stdout: str = ""
    stderr_tail: str = ""
    note: str = ""  # the reason for a skip, or what failed

    @property
    def ok(self) -> bool:
        return self.status == "passed"


@dataclass
class Stage:
    name: str
    title: str
    cmd: list[str]
    cap: float  # seconds at most
    reserve: float = 0.0  # seconds kept free for this stage while the stages before it run
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[Path, ...] = ()  # inputs an earlier stage makes
    skip: str | None = None  # a reason not to run it at all (smoke run, not selected)
    background: bool = False  # runs beside the GPU tests
    render: Callable[[Result], Result] | None = None  # turns raw stdout into the report's text
    result: Result | None = None

    def command(self) -> str:
        """The command as a user would type it from the project root."""
        words = ["python3" if w == PY else w for w in self.cmd]
        words = [w.removeprefix(str(ROOT) + "/") for w in words]
        env = [f"{k}={v}" for k, v in self.env.items() if k != "PYTHONUNBUFFERED"]
        return shlex.join([*env, *words]) if not env else " ".join([*env, shlex.join(words)])


def run_stage(stage: Stage, timeout: float, logs: Path) -> Result:
    """Run one stage in its own process group (a server it starts dies with it on timeout);
    stdout (the stage's markdown) and stderr go to files under logs/."""
    missing = [p for p in stage.needs if not p.exists()]
    if missing:
        return Result("skipped", note=f"needs {missing[0]}, which an earlier stage did not make")
    out_file, err_file = logs / f"{stage.name}.md", logs / f"{stage.name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env}
    log(f"[{clock()}] {stage.name}: {stage.command()} (limit {timeout:.0f} s)")
    start = time.perf_counter()
    with open(out_file, "w") as so, open(err_file, "w") as se:
        proc = subprocess.Popen(
            stage.cmd, stdout=so, stderr=se, env=env, cwd=ROOT, start_new_session=True
        )
        status = None
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            status = "timed out"
            kill_group(proc)
            rc = proc.returncode
    seconds = time.perf_counter() - start
    if status is None:
        status = "passed" if rc == 0 else "failed"
    err = err_file.read_text(errors="replace").splitlines()
    result = Result(
        status,
        seconds,
        rc,
        out_file.read_text(errors="replace"),
        "\n".join(err[-40:]),
        f"after its limit of {timeout:.0f} s" if status == "timed out" else "",
    )
    if stage.render is not None:
        result = stage.render(result)
    log(f"[{clock()}] {stage.name}: {result.status} in {seconds:.0f} s {result.note}".rstrip())
    return result


def kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


STARTED = time.perf_counter()


def clock() -> str:
    return f"{time.perf_counter() - STARTED:4.0f} s"


# --- pytest ----------------------------------------------------------------------------------


def render_pytest(r: Result) -> Result:
    """The summary line, the failures, the slowest tests; the full output stays in logs/.

    A lent machine lacks some test-only packages (hypothesis, openai): a test module that
    cannot be imported there and has no gpu test in it is noted, not failed; one that has
    gpu tests fails the stage, since those tests did not run."""
    lines = r.stdout.splitlines()
    summary = next(
        (
            ln.strip("= ")
            for ln in reversed(lines)
            if re.search(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b", ln)
            and " in " in ln
        ),
        None,
    )
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    skipped = [ln for ln in lines if ln.startswith("SKIPPED ")]  # on a GPU host: say why
    unimportable = [ln for ln in failed if re.match(r"ERROR \S+\.py( - |$)", ln)]
    relevant = [ln for ln in unimportable if _mentions_gpu(ln.split()[1])]
    others = [ln for ln in failed if ln not in unimportable]
    durations, inside = [], False
    for ln in lines:
        if "slowest" in ln and "durations" in ln:
            inside = True
            continue
        if inside:
            if not ln.strip() or ln.startswith(("=", "(")):
                break
            durations.append(ln)
    text = [f"Result: `{summary}`." if summary else "No summary line: see logs/gpu-tests.*"]
    if r.rc == 5:
        r.status, r.note = "failed", "no test marked gpu was collected"
        text.append("\nNo test is marked `gpu` in this checkout: the GPU tests did not run.")
    elif r.status == "failed" and summary and not others and not relevant and unimportable:
        r.status = "passed"
        r.note = f"({len(unimportable)} test modules without gpu tests could not be imported here)"
    if others or relevant:
        text += ["\nFailures:\n", "```", *(others + relevant)[:40], "```"]
    if unimportable and not relevant:
        text += [
            "\nTest modules that could not be imported here (no gpu tests in them; the packages "
            "they need can be carried with prepare-device.sh's EXTRA_WHEELS):\n",
            "```",
            *unimportable[:20],
            "```",
        ]
    if skipped:
        text += ["\nSkipped (a gpu test should run on this host):\n", "```", *skipped[:20], "```"]
    if durations:
        text += ["\nSlowest:\n", "```", *durations, "```"]
    r.stdout = "\n".join(text) + "\n"
    return r


AWQ_LINE = re.compile(
    r"wrote \S+ in (?P<s>\d+) s on (?P<dev>[^;]+); peak RSS (?P<rss>[\d.]+) GiB"
    r"(?:; peak GPU memory (?P<gpu>[\d.]+) GiB(?: \((?P<tensors>[\d.]+) GiB in tensors\))?)?"
)


def render_awq(source: Path, full: int) -> Callable[[Result], Result]:
    """`lite auto_awq`'s last line as a table: wall time on the source's layers and its
    projection to `full` (layers x per-layer time, the fixed costs counted `full / layers`
    times: an upper bound), peak host RSS and peak GPU memory (one layer at a time: the same
    at any depth)."""

    def render(r: Result) -> Result:
        found = AWQ_LINE.search(r.stderr_tail)
        if found is None:
            r.stdout = "No summary line from lite auto_awq: see logs/ and the tail below.\n"
            return r
        seconds = int(found["s"])
        layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
        gpu = f"{found['gpu']} GiB" if found["gpu"] else "-"
        tensors = f"{found['tensors']} GiB" if found["tensors"] else "-"
        row = f"| {layers} | {seconds} | {seconds * full / layers / 60:.1f} min | {found['dev']} | "
        r.stdout = (
            f"| layers | wall s | projected to {full} layers | device | peak RSS | peak GPU "
            "| of it in tensors |\n"
            "|---:|---:|---:|---|---:|---:|---:|\n"
            f"{row}{found['rss']} GiB | {gpu} | {tensors} |\n"
        )
        return r

    return render


def _mentions_gpu(test_file: str) -> bool:
    path = ROOT / test_file
    try:
        return "gpu" in path.read_text(errors="replace")
    except OSError:
        return True


# --- environment -----------------------------------------------------------------------------

VERSIONS = """
import json, platform, dataclasses, os
facts = {"python": platform.python_version(), "cpus": os.cpu_count()}
try:
    import torch
    facts["torch"] = torch.__version__
    facts["torch cuda"] = torch.version.cuda
    facts["cuda available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts["device"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
        facts["devices"] = torch.cuda.device_count()
except Exception as e:
    facts["torch"] = f"import failed: {e!r}"
for name in ("triton", "transformers", "tokenizers", "safetensors", "fastapi", "httpx", "httpx2"):
    try:
        facts[name] = __import__(name).__version__
    except Exception as e:
        facts[name] = f"missing ({type(e).__name__})"
try:
    from runtime.config import EngineConfig
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    facts["EngineConfig.device"] = "device" in names
    facts["EngineConfig.enforce_eager"] = "enforce_eager" in names
except Exception as e:
    facts["runtime"] = f"import failed: {e!r}"
print(json.dumps(facts))
"""


def sh(cmd: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return p.returncode, (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, f"{type(e).__name__}: {e}"


@dataclass
class Environment:
    date: str
    commit: str
    gpu: str
    facts: dict
    nvidia_smi: str
    seconds: float

    @property
    def cuda(self) -> bool:
        return bool(self.facts.get("cuda available"))


def environment() -> Environment:
    start = time.perf_counter()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rc, head = sh(["git", "rev-parse", "HEAD"])
    if rc == 0:
        _, dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"])
        n = len(dirty.splitlines())
        commit = f"`{head}`" + (f" with {n} modified tracked files" if n else "")
    else:
        commit = os.environ.get("GPU_CHECK_COMMIT", "unknown (no git here; set GPU_CHECK_COMMIT)")
    rc, gpu = sh(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    )
    gpu = gpu.splitlines()[0] if rc == 0 and gpu else "none (no nvidia-smi)"
    rc, smi = sh(["nvidia-smi"])
    rc, versions = sh([PY, "-c", VERSIONS], timeout=180)
    try:
        facts = json.loads(versions.splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        facts = {"versions": f"failed: {versions[-500:]}"}
    return Environment(date, commit, gpu, facts, smi, time.perf_counter() - start)


# --- the plan --------------------------------------------------------------------------------


@dataclass
class Plan:
    foreground_first: list[Stage]  # beside the background stages
    background: list[Stage]
    measuring: list[Stage]  # alone, after the background stages
    beside: list[Stage] = field(default_factory=list)  # all along, on CPUs of their own

    def all(self) -> list[Stage]:
        return [*self.foreground_first, *self.background, *self.measuring, *self.beside]


def plan(
    a: argparse.Namespace, work: Path, logs: Path, cpus: tuple[list[int], list[int]] | None
) -> Plan:
    """The stages; `cpus` is (the CPU stage's CPUs, the CPUs kept for it) when this host has
    cores to spare for it, else None and it runs alone after the GPU stages."""
    smoke = a.smoke
    tok = ["--tokenizer", str(a.tokenizer)] if a.tokenizer.is_dir() else []
    small = "tiny" if smoke else "1b"
    src, art = work / f"src-{small}", work / f"art-{small}"
    src8, art8 = work / "src-8b", work / "art-8b"
    device = "cpu" if smoke else "cuda"
    triton_cache = {"TRITON_CACHE_DIR": str(work / "triton-cache")}
    interp = {"TRITON_INTERPRET": "1"} if smoke else {}
    gpu_only = "smoke run: needs a GPU" if smoke else None
    chosen = set(a.only.split(",")) if a.only else None
    engine = [PY, str(BENCH / "engine_gpu.py")]

    tests = Stage(
        "gpu-tests",
        "the tests marked gpu",
        [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs"]
        + ["--durations=10", "--continue-on-collection-errors", *test_workers(smoke)],
        cap=240,
        render=render_pytest,
        # 97 s on the H200 (2026-12-04) for 233 tests, when 94 were marked gpu (142 now, two of
        # them Triton engines that recompile every kernel): without a reserve of its own it
        # would get what the measuring stages' 450 s of reserves leave of the budget. Those
        # stages took about 275 s on the H200 before their A/Bs and sweeps were added, so 150 s
        # of tests still leaves them room within the 540 s
        reserve=150,
    )
    # The whole suite on the GPU host (issue 11 asks `make test` green there too): the CPU
    # modules run their CPU path with the GPU hidden (conftest). Minutes even on 16 cores, so
    # only when asked for by name: --only all-tests.
    suite = Stage(
        "all-tests",
        "the whole test suite on this host",
        [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=10"]
        + ["--continue-on-collection-errors", *test_workers(smoke)],
        cap=a.budget - 60,
        render=render_pytest,
        skip=suite_skip(smoke, chosen),
    )
    model = Stage(
        f"model-{small}",
        f"random Llama of the {small} shape and its RTN g128 artifact",
        [PY, str(BENCH / "random_model.py"), small, str(work), "--device", device, "--artifact"]
        + tok,
        cap=240,
        background=True,
    )
    model8 = Stage(
        "model-8b",
        f"Llama-3-8B shape with {a.layers_8b} of its 32 layers (all 32, written, hashed "
        "and quantized, do not fit the 8-minute budget), and its RTN g128 artifact",
        [PY, str(BENCH / "random_model.py"), "8b", str(work), "--device", device, "--artifact"]
        + ["--layers", str(a.layers_8b), *tok],
        cap=240,
        background=True,
        skip=gpu_only,
    )
    decode = Stage(
        "engine",
        "engine speed: start-up, first request, decode per batch, graphs vs eager, overlap vs "
        "step by step, Triton's pointwise kernels vs torch's ops, programmatic launch vs not, "
        "transformers",
        [*engine, "decode", str(art), "--source", str(src)]
        + (
            ["--batches", "1,4", "--new-tokens", "16", "--hf-new-tokens", "8", "--backend", "cpu"]
            if smoke
            else ["--batches", "1,16,64,256", "--backend", "triton", "--kv-quant", "int8"]
        ),
        cap=240 if smoke else 150,
        reserve=110,  # 63 s on the H200 before the pointwise and programmatic-launch A/Bs
        env=triton_cache,
        needs=(art, src),
    )
    agree = Stage(
        "agree",
        "greedy tokens and prompt logprobs: triton on the GPU against cpu fp32",
        [*engine, "agree", str(art), "--backend", "triton"]
        + (["--prompts", "2", "--prompt-len", "16", "--new-tokens", "4"] if smoke else []),
        cap=240 if smoke else 90,
        reserve=55,
        env={**triton_cache, **interp},
        needs=(art,),
    )
    serve = Stage(
        "serve",
        "runtime serve with concurrent streams",
        [PY, str(BENCH / "serving_gpu.py"), str(art), "--log", str(logs / "serve-server.log")]
        + (
            ["--streams", "1,4", "--new-tokens", "16", "--prompt-len", "32", "--backend", "cpu"]
            if smoke
            else ["--streams", "1,8,32", "--backend", "triton", "--kv-quant", "int8"]
        ),
        cap=180 if smoke else 120,
        reserve=30,
        env=triton_cache,
        needs=(art,),
    )
    kernels = Stage(
        "kernels",
        "W4A16 GEMM and paged decode attention on Llama-3-8B shapes",
        [PY, str(BENCH / "triton_bench.py"), "--batch", "1" if smoke else "1,8"]
        + (["--quick"] if smoke else []),
        cap=120,
        reserve=45,  # 20-27 s on the H200 before the dequantization tiles' sweep
        env=interp,
    )
    engine_cuda = Stage(
        "engine-cuda",
        "engine decode with backend cuda (the csrc library; issue 12), no transformers baseline",
        [*engine, "decode", str(art), "--batches", "1,16,64,256", "--backend", "cuda"]
        + ["--kv-quant", "int8"],
        cap=100,
        # 24 s on the H200 before the fused-pointwise, PDL and swapped-tile comparisons
        reserve=60,
        env=triton_cache,
        needs=(art,),
        skip=gpu_only,
    )
    cuda_attention = Stage(
        "cuda-attention",
        "csrc paged decode attention against Triton's on Llama-3-8B shapes",
        [PY, str(BENCH / "cuda_attention.py")]
        + (["--quick"] if smoke else ["--batch", "1,8", "--sweep"]),
        # a smoke run may build the library first (nvcc, 2-3 min on 2 cores); a GPU machine
        # gets it prebuilt in .kernels/
        cap=300 if smoke else 90,
        reserve=25,  # 15 s on the H200 before the partition sweep (issue 12)
    )
    cuda_gemm = Stage(
        "cuda-gemm",
        "csrc W4A16 GEMM against dense bf16, tinygemm and Triton on Llama-3-8B shapes",
        [PY, str(BENCH / "cuda_gemm.py"), "--sweep", "1" if smoke else "1,16"]
        + (["--quick"] if smoke else ["--ms", "1,4,16,4096"])
        # every timed launch, for evals/bench/fit_gemm_plan.py after the run
        + ["--sweep-json", str(logs / "cuda-gemm-sweep.jsonl")],
        cap=240 if smoke else 120,  # the library may be built first in a smoke run
        reserve=40,  # 16 s on the H200 without the sweep of every decode launch (issue 12)
    )
    memory = Stage(
        "memory-8b",
        "device memory of the 8B shape, projected to 32 layers",
        [*engine, "memory", str(art8), "--full-layers", "32", "--backend", "triton"],
        cap=90,
        reserve=30,
        needs=(art8,),
        skip=gpu_only,
    )
    # issue 13: AWQ calibration on the GPU at the 128 x 512 tokens (smoke: the tiny
    # model on the CPU at 8 x 64, to check the stage)
    awq_src = src if smoke else src8
    calib = ["8", "64"] if smoke else ["128", "512"]
    awq = Stage(
        "awq-8b",
        f"`lite auto_awq --device {device}` with {calib[0]} x {calib[1]} calibration tokens on "
        + ("the tiny model" if smoke else f"{a.layers_8b} layers of the 8B shape")
        + ": wall time projected to 32 layers, peak host RSS and GPU memory",
        [PY, "-m", "lite", "auto_awq", str(awq_src), "--work-dir", str(work / "awq-8b")]
        + ["--device", device, "--calib-samples", calib[0], "--calib-seqlen", calib[1]]
        + ["--w-group-size", "128" if not smoke else "32", "--overwrite", "--quiet"],
        cap=240 if smoke else 150,
        reserve=55,
        needs=(awq_src,),
        render=render_awq(awq_src, 32),
    )
    # `lite tune` had never run on a GPU: pin the cuda GEMM's launches for two buckets into a
    # copy of the artifact (the other stages read the untuned one), then show what it pinned.
    # The default run's budget has no room left for it: it runs when named, with the model
    # it needs (--only model-1b,tune)
    tuned = work / f"art-{small}-tuned"
    tune = Stage(
        "tune",
        "`lite tune --backend cuda` on a copy of the artifact, buckets 1 and 16, and what "
        "`lite inspect` then reports",
        [
            "bash",
            "-c",
            'rm -rf "$2" && cp -r "$1" "$2" && "$0" -m lite tune "$2" --backend cuda '
            '--buckets 1,16 --max-configs 4 && "$0" -m lite inspect "$2"',
            PY,
            str(art),
            str(tuned),
        ],
        cap=90,
        reserve=20,
        env=triton_cache,
        needs=(art,),
        skip=gpu_only or named_only("tune", chosen, "model-1b,tune"),
    )
    if smoke:  # the memory code on the tiny model instead, to check it runs
        memory = Stage(
            "memory",
            "memory figures on the tiny model (the 8B shape needs a GPU)",
            [*engine, "memory", str(art), "--full-layers", "4", "--backend", "cpu"]
            + ["--batch", "4", "--new-tokens", "16", "--session-len", "256"],
            cap=120,
            reserve=25,
            needs=(art,),
        )
    cpu_isa = Stage(
        "cpu-isa",
        "the CPU engine on this host's ISA paths (issue 19): SmolLM2-135M's shape, 2 threads, "
        "against transformers fp32",
        [PY, str(BENCH / "cpu_isa.py"), str(work / "cpu-isa"), "--tokenizer", str(a.tokenizer)]
        + (["--shape", "tiny", "--batches", "1", "--new-tokens", "8"] if smoke else [])
        + (["--cpus", ",".join(map(str, cpus[0]))] if cpus else []),
        cap=240 if smoke else a.budget - 60,
    )
    measuring = [decode, engine_cuda, agree, serve, kernels, cuda_attention, cuda_gemm, memory]
    measuring += [awq, tune]
    p = Plan([tests, suite], [model, model8], measuring, [cpu_isa] if cpus else [])
    if not cpus:
        measuring.append(cpu_isa)
    for s in p.all():
        if chosen is not None and s.name not in chosen and s.skip is None:
            s.skip = "not selected (--only)"
    return p


# --- running the plan ------------------------------------------------------------------------


def stage_limit(
    stage: Stage, later: list[Stage], left: float, overlapped: float = 0.0
) -> float | None:
    """The stage's limit in seconds: its cap, but never eating into the reserves kept for
    `later` stages out of the `left` seconds of the budget; None when too little is left to be
    worth starting. `overlapped` is how long a stage running beside this one may still run
    while those later stages wait for it: the background stages (the model builds) may use it
    whatever the reserves say. Without it the 8B build got 35 s on the H200's timings (it takes
    45 s) while the GPU tests beside it could run for another 100 s."""
    if left < min(20.0, stage.cap):
        return None
    own = min(max(stage.reserve, 20.0), left)  # what no later stage's reserve takes
    kept = min(sum(s.reserve for s in later if s.skip is None), left - own)
    return min(stage.cap, max(left - kept, min(overlapped, left)))


def run_plan(p: Plan, a: argparse.Namespace, env: Environment, logs: Path, report: Path) -> None:
    deadline = STARTED + a.budget

    lock = threading.Lock()  # stages end on three threads

    def write() -> None:
        with lock:
            report.write_text(render_report(p, a, env))

    def go(stage: Stage, later: list[Stage], overlapped: float = 0.0) -> None:
        limit = stage_limit(stage, later, deadline - time.perf_counter(), overlapped)
        if stage.skip is not None:
            stage.result = Result("skipped", note=stage.skip)
            log(f"[{clock()}] {stage.name}: skipped ({stage.skip})")
        elif limit is None:
            stage.result = Result("skipped", note="out of time: the budget was spent")
            log(f"[{clock()}] {stage.name}: skipped, out of time")
        else:
            stage.result = run_stage(stage, limit, logs)
        write()

    write()
    # Until when the foreground stages (the GPU tests) may run: the measuring stages wait for
    # them anyway, so the background stages beside them (the model builds) may run as long.
    foreground_until = time.perf_counter()
    for i, s in enumerate(p.foreground_first):
        later = p.foreground_first[i + 1 :] + p.measuring
        if s.skip is None:
            foreground_until += stage_limit(s, later, deadline - foreground_until) or 0.0

    def background() -> None:
        for i, s in enumerate(p.background):
            # A failed 1B model leaves nothing for the 8B one to be compared with, but its
            # own figures still count: run it regardless.
            go(s, p.background[i + 1 :] + p.measuring, foreground_until - time.perf_counter())

    beside = [threading.Thread(target=go, args=(s, []), daemon=True) for s in p.beside]
    for t in beside:
        t.start()
    worker = threading.Thread(target=background, daemon=True)
    worker.start()
    for i, s in enumerate(p.foreground_first):
        go(s, p.foreground_first[i + 1 :] + p.measuring)
    worker.join()  # every background stage has its own limit, so this ends
    for i, s in enumerate(p.measuring):
        go(s, p.measuring[i + 1 :])
    for t in beside:  # each has its own limit within the budget
        t.join()


# --- the report ------------------------------------------------------------------------------


def demote(markdown: str, top: int = 3) -> str:
    """Shift a stage's headings so its highest one is level `top` (the report's stage
    sections are level 2); lines inside fenced code are left alone."""
    lines = markdown.splitlines()
    fenced, levels = False, []
    for ln in lines:
        if ln.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) ", ln)):
            levels.append(len(m.group(1)))
    if not levels:
        return markdown
    shift = top - min(levels)
    out, fenced = [], False
    for ln in lines:
        if ln.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", ln):
            ln = "#" * shift + ln if shift > 0 else ln[-shift:]
        out.append(ln)
    return "\n".join(out)


def clip(text: str, name: str, width: int = 400, rows: int = 300) -> str:
    """A stage's output as the report shows it: a runaway line (a tensor printed by mistake)
    or a flood of lines is cut, pointing at the full text in logs/."""
    where = f"logs/{name}.md"
    lines = [
        ln if len(ln) <= width else ln[:width] + f" ... (line cut; in full in {where})"
        for ln in text.splitlines()
    ]
    if len(lines) > rows:
        lines = lines[:rows] + ["", f"... {len(lines) - rows} more lines in {where}"]
    return "\n".join(lines)


def render_report(p: Plan, a: argparse.Namespace, env: Environment) -> str:
    stages = p.all()
    done = [s for s in stages if s.result is not None]
    bad = [s for s in done if not passed(s.result)]
    pending = [s for s in stages if s.result is None]
    elapsed = time.perf_counter() - STARTED
    if pending:
        verdict = f"running ({len(done)} of {len(stages)} stages done)"
    elif bad:
        verdict = f"**{len(bad)} stage(s) did not pass: {', '.join(s.name for s in bad)}**"
    else:
        verdict = "**every stage that ran passed**"
    mode = (
        "smoke run on the CPU: tiny model, backend cpu, triton interpreted; GPU-only stages skipped"
        if a.smoke
        else "full run on the GPU"
    )
    lines = [
        f"# GPU check, {env.date}",
        "",
        f"- commit: {env.commit}",
        f"- GPU: {env.gpu}",
        f"- command: `{a.command}`",
        f"- mode: {mode}",
        f"- result: {verdict}; {elapsed:.0f} s of a {a.budget:.0f} s budget",
        "",
        "| stage | status | seconds | what |",
        "|---|---|---:|---|",
        f"| environment | passed | {env.seconds:.0f} | versions, nvidia-smi |",
    ]
    for s in stages:
        r = s.result
        status = "pending" if r is None else r.status
        if r is not None and r.status == "skipped":
            status = f"skipped: {r.note}"
        secs = f"{r.seconds:.0f}" if r is not None and r.seconds else ""
        lines.append(f"| {s.name} | {status} | {secs} | {s.title} |")
    lines += ["", "## environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.facts.items()]
    lines += ["", "```", env.nvidia_smi or "nvidia-smi printed nothing", "```"]
    for s in stages:
        r = s.result
        lines += ["", f"## {s.name}: {s.title}", "", f"`{s.command()}`", ""]
        if r is None:
            lines.append("Not run yet.")
            continue
        if r.status == "skipped":
            lines.append(f"Skipped: {r.note}.")
            continue
        head = {
            "passed": "Passed",
            "failed": f"**Failed** (exit {r.rc})",
            "timed out": "**Timed out**",
        }
        lines.append(f"{head[r.status]} in {r.seconds:.1f} s{' ' + r.note if r.note else ''}.")
        if r.stdout.strip():
            lines += ["", demote(clip(r.stdout.rstrip(), s.name))]
        if r.status != "passed" and r.stderr_tail:
            lines += ["", "Last lines of its log:", "", "```", r.stderr_tail, "```"]
    lines += [
        "",
        "Logs of every stage (stdout as .md, stderr as .log) are in `logs/` beside this file.",
    ]
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out/gpu-check")))
    p.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "liteserve-gpu-check",
        help="models and artifacts (GBs; kept out of --out, which a lent machine sends back)",
    )
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".tok")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: check the check")
    p.add_argument("--budget", type=float, help="seconds for all stages (default 540; smoke 900)")
    p.add_argument("--layers-8b", type=int, default=4, help="layers of the 8B shape to build")
    p.add_argument("--only", help="run only these stages (comma-separated names)")
    p.add_argument("--keep-work", action="store_true", help="leave --work in place at the end")
    a = p.parse_args()
    a.budget = a.budget or (900.0 if a.smoke else 540.0)
    a.command = os.environ.get("GPU_CHECK_COMMAND") or shlex.join(
        ["python3", "evals/bench/gpu_check.py", *sys.argv[1:]]
    )
    out = a.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    clean_work(a.work)  # a fresh Triton cache and no stale artifacts
    report = out / "gpu-check.md"

    env = environment()
    log(f"[{clock()}] environment: {env.gpu}; {env.facts}")
    stages = plan(a, a.work, logs, None if a.smoke else keep_cpus())
    if not a.smoke and not env.cuda:
        for s in stages.all():
            s.result = Result("skipped", note="no CUDA GPU visible (use --smoke on a CPU)")
        report.write_text(render_report(stages, a, env))
        log(f"no CUDA GPU visible: nothing run; see {report}")
        return 2
    try:
        run_plan(stages, a, env, logs, report)
    finally:
        if not a.keep_work:
            clean_work(a.work)
    report.write_text(render_report(stages, a, env))
    bad = [s for s in stages.all() if s.result is not None and not passed(s.result)]
    log(f"[{clock()}] wrote {report}: {len(bad)} stage(s) did not pass")
    return 1 if bad else 0


def keep_cpus() -> tuple[list[int], list[int]] | None:
    """Two cores for the cpu-isa stage, this process (and so every other stage, and the
    threads that start them) moved off them; None where there are too few cores or the
    sandbox refuses affinity, and the stage runs alone at the end."""
    allowed = os.sched_getaffinity(0)
    cpus = cpu_isa.reserve(2, cpu_isa.core_groups(allowed))
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(0, allowed - set(cpus[1]))
    except OSError as e:
        log(f"[{clock()}] cannot set CPU affinity ({e}): cpu-isa runs alone, last")
        return None
    log(f"[{clock()}] CPUs {cpus[1]} kept for the cpu-isa stage, which runs on {cpus[0]}")
    return cpus


def suite_skip(smoke: bool, chosen: set[str] | None) -> str | None:
    """Why the all-tests stage does not run: on a CPU the whole suite is CI's; on a GPU host
    it runs only when named (`chosen`: the --only names), being minutes long even on 16 cores."""
    if smoke:
        return "smoke run: on a CPU the whole suite is CI's"
    return named_only("all-tests", chosen, "all-tests")


def named_only(name: str, chosen: set[str] | None, only: str) -> str | None:
    """Why a stage outside the default run does not run: it was not named (--only ONLY)."""
    if chosen is not None and name in chosen:
        return None
    return f"not selected: it runs only when named (--only {only})"


def test_workers(smoke: bool) -> list[str]:
    """pytest-xdist's workers where the machine has it: the GPU tests' time goes mostly to
    Triton's compiles, which are CPU work, and a lent machine has 16 cores for a budget of
    minutes. One module per worker (`loadfile`) keeps module fixtures (artifacts, servers)
    built once."""
    if smoke or importlib.util.find_spec("xdist") is None:
        return []
    workers = max(1, min(12, len(os.sched_getaffinity(0)) - 2))
    return ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else []


def passed(r: Result) -> bool:
    """Skips by design (smoke run, --only) do not fail the check; running out of time or
    missing an input does."""
    return r.ok or (r.status == "skipped" and r.note.startswith(("smoke run", "not selected")))


def clean_work(work: Path) -> None:
    """Remove what this check puts in --work, and nothing else (it may be a shared folder)."""
    for pattern in ("src-*", "art-*", "triton-cache", "tokenizer", "cpu-isa"):
        for path in work.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
