"""No Triton compile on the request path: every kernel specialization that serving launches was
already compiled at start-up (warm-up prefills and the decode graphs' warm-up forwards).

Triton compiles a kernel once per specialization: its constexprs, and for every other argument
its dtype, whether an integer is 1 or a multiple of 16, and whether a pointer is 16-byte
aligned. A launch whose row count, sequence count or block-table width lands on a new one of
those compiles on the spot, about a second on a GPU, inside a request. Here every launch is
recorded instead of run (the specialization depends on shapes and metadata, never on values),
and its key is computed with Triton's own binder for the target a GPU would have; the serving
steps sweep what varies from step to step: prompt lengths, prefix-cached chunks, mixed
prefill and decode rows, decode batches at every context length, prompt logprobs."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.ops import StepInputs
from runtime.kernels.triton.gemm import WARMUP_ROWS
from tests.conftest import GPU
from tests.test_triton_engine import engine_config
from tests.triton_compile import stand_in_driver

BLOCK = 16
SESSION = 1536  # three decode partitions of 512 tokens
MAX_PREFILL = 96  # the largest chunk (row bucket 128)
MAX_BATCH = 200  # the largest decode batch (row bucket 256)


class _Pointer:
    """What Triton's specialization reads of a tensor: its dtype and its address."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self._address = t.dtype, t.data_ptr()

    def data_ptr(self) -> int:
        return self._address


def _light(arg: object) -> object:
    return _Pointer(arg) if isinstance(arg, torch.Tensor) else arg


class Recorder:
    """Every ``kernel[grid](...)`` recorded under the current phase and not run."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, object, list, dict]] = []
        self.phase = "start"

    def install(self, patch: pytest.MonkeyPatch) -> None:
        from runtime.kernels.triton.gemm import _w4a16_kernel

        def record(kernel, *args, grid, warmup, **kwargs):  # noqa: ARG001 - grid: not a key
            light = {k: _light(v) for k, v in kwargs.items()}
            self.launches.append((self.phase, kernel, [_light(a) for a in args], light))

        patch.setattr(type(_w4a16_kernel), "run", record)

    def keys(self) -> dict[str, dict[tuple, str]]:
        """Per phase, each launch's compile key -> the kernel's name."""
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        jits: dict[int, JITFunction] = {}
        out: dict[str, dict[tuple, str]] = {"start": {}, "serve": {}}
        with _target():
            device = driver.active.get_current_device()
            for phase, kernel, args, kwargs in self.launches:
                jit = jits.setdefault(id(kernel), _jit(kernel))
                _, specialization, options = jit.device_caches[device][-1](*args, **kwargs)
                key = (kernel.fn.__name__, _describe(jit, specialization), str(options))
                out[phase][key] = kernel.fn.__name__
        return out


def _describe(jit: object, specialization: list[tuple]) -> str:
    """``name=value`` for constexprs, ``name:type`` (``/16``: a multiple of 16, aligned) else."""
    return ", ".join(
        f"{param.name}={value}"
        if kind == "constexpr"
        else f"{param.name}:{kind}{'/16' * (value == 'D')}"
        for param, (kind, value) in zip(jit.params, specialization, strict=True)
    )


def _jit(kernel: object) -> object:
    """The JIT function a GPU would launch (under the interpreter, one with the same options)."""
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


@contextlib.contextmanager
def _target() -> Iterator[None]:
    """Triton's driver on a GPU host; a stand-in naming an sm_90 target elsewhere."""
    from triton.runtime.driver import driver

    if GPU:
        yield
        return
    before = driver._active  # None where no GPU driver loads: `active` would raise
    driver.set_active(stand_in_driver(90))
    try:
        yield
    finally:
        driver._active = before


def _step(seqs: list[tuple[int, int]], logprob_rows: bool = False) -> StepInputs:
    """A step of sequences given as (context length after the step, new tokens); blocks are
    numbered from 0 for each (the kernels are not run, so sequences may share them)."""
    ids, positions, slots, tables, lens, queries, last = [], [], [], [], [], [], []
    for ctx, n in seqs:
        table = list(range(-(-ctx // BLOCK)))
        for pos in range(ctx - n, ctx):
            ids.append(pos % 500 + 3)
            positions.append(pos)
            slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        tables.append(table)
        lens.append(ctx)
        queries.append(n)
        last.append(len(ids) - 1)
    rows = last + [i for i in range(len(ids)) if i not in last] if logprob_rows else last
    return StepInputs(ids, positions, slots, tables, lens, queries, rows, BLOCK)


def serving_steps() -> Iterator[StepInputs]:
    """What a serving engine's steps vary in, swept."""
    for n in range(1, MAX_PREFILL + 1):  # a prompt's first chunk of every length
        yield _step([(n, n)])
    for cached in (16, 48, 500, 1100):  # a chunk after a cached prefix or an earlier chunk
        for n in (1, 7, 16, 33, MAX_PREFILL):
            yield _step([(cached + n, n)])
    for decoding in (1, 2, 3, 5, 8, 15, 16, 17, 31, 40):  # a chunk beside decoding sequences
        ctx = [(1 + 37 * i) % (SESSION - 1) + 1 for i in range(decoding)]
        for n in (1, 9, 32, 50):
            yield _step([(c, 1) for c in ctx] + [(n + 20, n)])
    # decode batches: each row bucket at, below and above a multiple of 16, at a short and a long
    # context; and every kind of table width (1, a multiple of 16 or not; one partition or
    # several) at a single row and at 17 rows
    batches = (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, MAX_BATCH)
    for batch in batches:
        for ctx in (16, 700):
            yield _step([(max(1, ctx - i), 1) for i in range(batch)])
    for ctx in (1, 15, 16, 17, 255, 256, 257, 512, 513, 1024, 1025, SESSION):
        for batch in (1, 17):
            yield _step([(max(1, ctx - i), 1) for i in range(batch)])
    for n in (3, 16, 40):  # prompt logprobs: every row's logits
        yield _step([(n, n)], logprob_rows=True)
        yield _step([(200, 1), (n, n)], logprob_rows=True)


def _with_positions(artifact: Path, positions: int, where: Path) -> Path:
    """A copy whose model claims ``positions`` trained positions (the tiny models have 1024;
    the engine holds a session to them): the random weights mean nothing either way."""
    copy = Path(shutil.copytree(artifact, where / "long"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["architecture"]["max_position_embeddings"] = positions
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_serving_compiles_nothing_after_start(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch, eager: bool, tmp_path: Path
) -> None:
    rtn_artifact = _with_positions(rtn_artifact, SESSION, tmp_path)
    recorder = Recorder()
    recorder.install(monkeypatch)
    config = engine_config(
        "triton",
        kv_quant="int8",
        num_blocks=SESSION // BLOCK + 2,
        session_len=SESSION,
        max_prefill_token_num=MAX_PREFILL,
        max_batch_size=MAX_BATCH,
        enforce_eager=eager,
    )
    engine = Engine(rtn_artifact, config)
    runner = engine.runner
    engine.ops.warmup_tokens = WARMUP_ROWS  # what a GPU warms up (the interpreter: nothing)
    engine.warm_up()
    if runner.graphs is not None:  # a GPU runs each bucket's forward before capturing it
        for bs in runner.graphs.buckets:
            runner.graphs._forward(bs)
    recorder.phase = "serve"
    for step in serving_steps():
        runner.step(step)
    prompts = [[5 + i % 300 for i in range(n)] for n in (3, 40, 90, 17)]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, prompt_logprobs=0)
    engine.generate(prompts, params)  # the scheduler's own mixes
    keys = recorder.keys()
    decode = {"_decode_partition_kernel"}
    served = {"_w4a16_kernel", "_w4a16_gemv_kernel", "_prefill_kernel", "_rotary_kv_write_kernel"}
    served |= {"_add_rms_norm_kernel", "_silu_mul_kernel"}
    if runner.graphs is None:
        served |= decode
    else:  # decode steps replay the graphs captured at start: no launch passes the recorder
        assert set(keys["start"].values()) >= decode, sorted(set(keys["start"].values()))
    assert len(recorder.launches) > 2000 and set(keys["serve"].values()) >= served, sorted(
        set(keys["serve"].values())
    )
    new = sorted(key for key in keys["serve"] if key not in keys["start"])
    assert not new, f"{len(new)} kernels would compile while serving:\n" + "\n".join(
        f"{name}: {spec}" for name, spec, _ in new
    )
