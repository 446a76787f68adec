"""The Triton backend's fused pointwise kernels against torch's ops, their fallbacks, their
switch, and the engine with and without them.

Kernels (on the test device: compiled on a GPU, interpreted on the CPU), on random inputs of
odd shapes (hidden 576, 9 query heads over 3 KV heads of 64, 7 tokens), the inputs strided
views as the model hands them over:

* add + RMSNorm: the sum equal to torch's add bit for bit; the norm within one step of the
  dtype (the next representable value either way) of ``reference.rms_norm`` and of
  ``F.rms_norm`` (what the unfused backend runs): the kernel sums the squares in another order
  and a GPU's ``rsqrt`` is approximate, so an fp32 result near a rounding boundary may round
  to the other neighbour;
* SiLU-and-mul: on a GPU bit for bit torch's ``F.silu(gate) * up`` there (the kernel uses
  CUDA's ``expf`` and a correctly rounded division, as torch's does); interpreted, within one
  epsilon of the dtype (relative) of torch's CPU ops and equal to them on more than 99% of the
  elements (numpy's ``exp`` may differ from torch's by an fp32 ulp, which moves the SiLU's
  rounding now and then, and the product with it);
* rotary + KV write: queries and every pool tensor (codes, scales, zeros; fp16, bf16, fp32
  pools) bit for bit ``apply_rotary`` followed by the KV write, for fp16 and bf16 activations.

The engine (the tiny RTN Llama, as ``test_triton_engine.py`` builds it): the same greedy tokens
with the fused kernels and with ``LITESERVE_TRITON_FUSED=0``, and prompt and sampled-token
logprobs within 0.005 nats with fp16 KV: only the norms and SiLU may round differently, by a
step of the dtype now and then (an fp16 step of a logprob near ln(512) is 0.004). With int4 KV
0.02: a K element one step away may round to the neighbouring int4 code, 1/15 of its head's
range (test_gpu.py's reasoning). Measured interpreted on the CPU: 0.00025 for both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import MethodType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels import reference
from runtime.kernels.ops import Backend
from runtime.kernels.triton import pointwise
from runtime.kernels.triton.backend import TritonBackend
from runtime.kernels.triton.kv_write import kv_write, rotary_kv_write
from runtime.kv.cache import KVCache
from runtime.kv.format import KVSpec
from tests.conftest import spread
from tests.test_gpu import logprobs
from tests.test_triton_engine import engine_config, mixed_prompts
from tests.test_triton_kv_write import assert_same_pool

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
TOKENS = 7  # an odd step
NORM_CASES = [(F16, 576), (BF16, 576), (BF16, 4096), (F16, 17)]  # dtype, hidden
SILU_CASES = [(F16, 1536), (BF16, 1500)]  # dtype, intermediate (1500: a masked last block)
# kv_quant, pool dtype, activation dtype, head_dim (96: a masked 128-wide tile)
ROTARY_CASES = [
    ("none", F16, F16, 64),
    ("none", BF16, BF16, 64),
    ("none", F32, BF16, 64),  # the rotated K converted to the pool's dtype
    ("int8", F16, F16, 64),
    ("int8", BF16, BF16, 64),
    ("int8", F16, BF16, 96),
    ("int4", F16, F16, 64),
    ("int4", BF16, BF16, 64),
    ("int4", BF16, F16, 96),
]
HEADS, KV_HEADS, BLOCK = 9, 3, 16
ENGINE_TOL = {"none": 0.005, "int4": 0.02}  # nats; see the module docstring
SWITCH = "LITESERVE_TRITON_FUSED"


def within_one_step(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Every element of ``out`` equal to ``ref``'s or to one of its two neighbours in the dtype."""
    out, ref = out.cpu(), ref.cpu()
    inf = torch.tensor(float("inf"), dtype=ref.dtype)
    return bool(((out == ref) | (out == ref.nextafter(inf)) | (out == ref.nextafter(-inf))).all())


def norm_inputs(dtype: torch.dtype, n: int, device: torch.device):
    """x [7, n] a strided view (every other row of a wider tensor), delta, weight around 1."""
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(2 * TOKENS, n + 8, generator=gen) * 4).to(device, dtype)[::2, 3 : n + 3]
    delta = torch.randn(TOKENS, n, generator=gen).to(device, dtype)
    weight = (1 + torch.randn(n, generator=gen) / 4).to(device, dtype)
    return x, delta, weight


def check_add_rms_norm(add_rms_norm: Callable, dtype: torch.dtype, n: int, device) -> None:
    x, delta, weight = norm_inputs(dtype, n, device)
    before = x.clone()
    for d in (delta, None):
        summed, out = add_rms_norm(x, d, weight, 1e-5)
        want = x if d is None else x + d
        assert summed.dtype == out.dtype == dtype and out.shape == x.shape
        assert torch.equal(summed, want)  # the add rounded as torch rounds it
        assert within_one_step(out, reference.rms_norm(want.cpu(), weight.cpu(), 1e-5))
        assert within_one_step(out, F.rms_norm(want, (n,), weight, 1e-5))
    assert torch.equal(x, before)


def check_silu_mul(act_mul: Callable, dtype: torch.dtype, n: int, device) -> None:
    gen = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(2 * TOKENS, 2 * n + 4, generator=gen) * 3).to(device, dtype)
    gate_up = gate_up[::2, : 2 * n]  # rows of a wider tensor
    out = act_mul(gate_up).cpu()
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (F.silu(gate) * up).cpu()  # torch's ops on the same device
    assert out.shape == ref.shape and out.dtype == dtype
    if gate_up.is_cuda:
        assert torch.equal(out, ref)
        return
    step = torch.finfo(dtype).eps * ref.float().abs() + torch.finfo(dtype).tiny
    assert ((out.float() - ref.float()).abs() <= step).all()
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_add_rms_norm(case: tuple, device: torch.device) -> None:
    check_add_rms_norm(pointwise.add_rms_norm, *case, device)


@pytest.mark.parametrize("case", SILU_CASES, ids=str)
def test_silu_mul(case: tuple, device: torch.device) -> None:
    check_silu_mul(pointwise.silu_mul, *case, device)


def rotary_inputs(case: tuple, device: torch.device):
    """(spec, qk, v, rope, slots): qk and v views of one qkv row per token, as the model's fused
    GEMM leaves them; the cos and sin of random positions in the activations' dtype; distinct
    random slots over 3 blocks, one of them padding (-1)."""
    kv_quant, pool_dtype, dtype, dim = case
    gen = torch.Generator().manual_seed(dim + len(kv_quant))
    spec = KVSpec(1, KV_HEADS, dim, BLOCK, kv_quant, pool_dtype)
    qkv = (torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * dim, generator=gen) * 3).to(device, dtype)
    qk = qkv[:, : (HEADS + KV_HEADS) * dim].view(TOKENS, HEADS + KV_HEADS, dim)
    v = qkv[:, (HEADS + KV_HEADS) * dim :].view(TOKENS, KV_HEADS, dim)
    angles = torch.rand(TOKENS, 1, dim // 2, generator=gen, dtype=torch.float64) * 1e4
    rope = tuple(f(angles).to(device, dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(3 * BLOCK, generator=gen)[:TOKENS]
    slots[TOKENS // 2] = -1
    return spec, qk, v, rope, slots


def check_rotary_kv_write(rotary: Callable, case: tuple, slot_dtype, device) -> None:
    """``rotary(qk, v, rope, layer, slots)`` against apply_rotary then the Triton KV write on the
    device and then LayerKV.write on the CPU (the write's own contract): every bit."""
    spec, qk, v, rope, slots = rotary_inputs(case, device)
    ours, unfused, theirs = KVCache(spec, 3, device), KVCache(spec, 3, device), KVCache(spec, 3)
    q = rotary(qk, v, rope, ours.layer(0), slots.to(device, slot_dtype))
    rotated = reference.apply_rotary(qk, *rope)
    kv_write(unfused.layer(0), rotated[:, HEADS:], v, slots.to(device, slot_dtype))
    theirs.layer(0).write(rotated[:, HEADS:].cpu(), v.cpu(), slots)
    assert_same_pool(ours, theirs)
    assert_same_pool(unfused, theirs)
    want = rotated[:, :HEADS].cpu().contiguous()
    assert q.shape == want.shape and q.dtype == want.dtype
    assert torch.equal(q.cpu().view(torch.int16), want.view(torch.int16))
    assert ours.layer(0).k.any()  # something was written


@pytest.mark.parametrize(
    ("case", "slot_dtype"), spread(ROTARY_CASES, [torch.int64, torch.int32]), ids=str
)
def test_rotary_kv_write_bit_identical(case: tuple, slot_dtype, device: torch.device) -> None:
    def rotary(qk, v, rope, layer, slots):
        return rotary_kv_write(layer, qk, v, rope, slots)

    check_rotary_kv_write(rotary, case, slot_dtype, device)


def test_no_tokens_launch_nothing(device: torch.device) -> None:
    spec, qk, v, rope, slots = rotary_inputs(ROTARY_CASES[3], device)
    layer = KVCache(spec, 3, device).layer(0)
    none = slots[:0].to(device)
    q = rotary_kv_write(layer, qk[:0], v[:0], tuple(t[:0] for t in rope), none)
    assert q.shape == (0, HEADS, 64) and not layer.k.any() and not layer.k_scale.any()
    x = torch.empty(0, 576, dtype=F16, device=device)
    summed, out = pointwise.add_rms_norm(x, x, torch.ones(576, dtype=F16, device=device), 1e-5)
    assert summed.shape == out.shape == (0, 576)
    assert pointwise.silu_mul(torch.empty(0, 64, dtype=F16, device=device)).shape == (0, 32)


# --- the backend's hooks -----------------------------------------------------------------


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Calls of the fused kernels' wrappers made through the triton backend, by name."""
    from runtime.kernels.triton import backend as module

    calls: Counter = Counter()

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in ("add_rms_norm", "silu_mul"):
        monkeypatch.setattr(pointwise, name, counted(name, getattr(pointwise, name)))
    monkeypatch.setattr(module, "rotary_kv_write", counted("rotary_kv_write", rotary_kv_write))
    return calls


@pytest.fixture
def backend(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> TritonBackend:
    monkeypatch.delenv(SWITCH, raising=False)
    return TritonBackend(device, {})


def test_backend_hooks_run_the_kernels(backend: TritonBackend, launched: Counter, device) -> None:
    assert SWITCH not in backend.detail and backend.fused_env == SWITCH
    check_add_rms_norm(backend.add_rms_norm, F16, 576, device)
    check_silu_mul(lambda gate_up: backend.act_mul(gate_up, "silu"), BF16, 1500, device)

    def rotary(qk, v, rope, layer, slots):
        return backend.rotary_kv_write(qk, v, rope, layer, slots)

    check_rotary_kv_write(rotary, ROTARY_CASES[4], torch.int32, device)
    assert launched == {"add_rms_norm": 2, "silu_mul": 1, "rotary_kv_write": 1}, launched


HOOKS = ("add_rms_norm", "act_mul", "rotary_kv_write")


def torch_ops(backend: Backend) -> SimpleNamespace:
    """The base class's hooks bound to ``backend``: torch's ops (and the backend's own KV
    write), what the hooks run unfused."""
    return SimpleNamespace(**{name: MethodType(getattr(Backend, name), backend) for name in HOOKS})


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a view whose last dimension is not contiguous."""
    return torch.stack((t, t), dim=-1)[..., 0]


def pool(layer) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (layer.k, layer.v, layer.k_scale, layer.k_zero) if t is not None)


def _fallback_calls(device: torch.device) -> list[tuple[str, Callable]]:
    """Calls of the hooks that the kernels do not take, as the cuda backend's: another
    activation, mixed dtypes, fp32 (not this backend's), rows whose last dimension is strided,
    not 2-D."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, 64, generator=gen).to(device, F16)
    w = torch.randn(64, generator=gen).to(device, F16)
    spec, qk, v, rope, slots = rotary_inputs(ROTARY_CASES[3], device)

    def rotary(qk=qk, v=v, rope=rope):
        def call(ops):
            layer = KVCache(spec, 3, device).layer(0)
            return ops.rotary_kv_write(qk, v, rope, layer, slots.to(device)), *pool(layer)

        return call

    return [
        ("gelu", lambda ops: ops.act_mul(x, "gelu")),
        ("strided gate_up", lambda ops: ops.act_mul(strided(x), "silu")),
        ("3-D gate_up", lambda ops: ops.act_mul(x[None], "silu")),
        ("mixed norm", lambda ops: ops.add_rms_norm(x, x, w.float(), 1e-5)),
        ("fp32 norm", lambda ops: ops.add_rms_norm(x.float(), None, w.float(), 1e-5)),
        ("strided norm", lambda ops: ops.add_rms_norm(strided(x), x, w, 1e-5)),
        ("3-D norm", lambda ops: ops.add_rms_norm(x[None], None, w, 1e-5)),
        ("mixed rope", rotary(rope=tuple(t.float() for t in rope))),
        ("strided v", rotary(v=strided(v))),
        ("strided qk", rotary(qk=strided(qk))),
    ]


def assert_same(a: tuple | torch.Tensor, b: tuple | torch.Tensor) -> None:
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own
def test_fallbacks_run_torchs_ops(backend: TritonBackend, launched: Counter, device) -> None:
    """As in the cuda backend: what the kernels do not take runs the base class's torch ops,
    with the same results, and no kernel."""
    for name, call in _fallback_calls(device):
        assert_same(call(backend), call(torch_ops(backend)))
        assert not launched, (name, launched)


def test_switch_runs_torchs_ops(device, launched: Counter, monkeypatch) -> None:
    """LITESERVE_TRITON_FUSED=0 (the A/B switch of the GPU check): none of the three kernels,
    torch's results, and the backend says so."""
    monkeypatch.setenv(SWITCH, "0")
    unfused = TritonBackend(device, {})
    assert f"torch's pointwise ops ({SWITCH}=0)" in unfused.detail
    ops = torch_ops(unfused)
    x, delta, weight = norm_inputs(F16, 576, device)
    want = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert_same(unfused.add_rms_norm(x, delta, weight, 1e-5), want)
    gate_up = torch.randn(TOKENS, 64).to(device, BF16)
    assert_same(unfused.act_mul(gate_up, "silu"), ops.act_mul(gate_up, "silu"))
    spec, qk, v, rope, slots = rotary_inputs(ROTARY_CASES[6], device)
    got = []
    for hook in (unfused.rotary_kv_write, ops.rotary_kv_write):
        layer = KVCache(spec, 3, device).layer(0)
        got.append((hook(qk, v, rope, layer, slots.to(device)), *pool(layer)))
    assert_same(*got)
    assert not launched, launched


# --- bad inputs ------------------------------------------------------------------------------


def _bad_calls(device: torch.device) -> list[tuple[Callable, str]]:
    x = torch.ones(3, 8, dtype=F16, device=device)
    w = torch.ones(8, dtype=F16, device=device)
    meta = torch.ones(3, 8, dtype=F16, device="meta")
    spec, qk, v, rope, slots = rotary_inputs(ROTARY_CASES[3], device)
    layer = KVCache(spec, 3, device).layer(0)
    slots = slots.to(device)

    def rotary(qk=qk, v=v, rope=rope, slots=slots):
        return lambda: rotary_kv_write(layer, qk, v, rope, slots)

    return [
        (
            lambda: pointwise.add_rms_norm(x, torch.ones(3, 7, dtype=F16, device=device), w, 1e-5),
            r"delta \[3, 7\]",
        ),
        (
            lambda: pointwise.add_rms_norm(x, None, torch.ones(9, dtype=F16, device=device), 1e-5),
            r"weight \[9\]",
        ),
        (lambda: pointwise.add_rms_norm(x.float(), None, w.float(), 1e-5), "float16 or bfloat16"),
        (lambda: pointwise.add_rms_norm(x, None, w.bfloat16(), 1e-5), "like the others"),
        (lambda: pointwise.add_rms_norm(x, meta, w, 1e-5), "different devices"),
        (lambda: pointwise.add_rms_norm(x.t(), None, w, 1e-5), "last dimension must be contiguous"),
        (
            lambda: pointwise.silu_mul(torch.ones(3, 7, dtype=F16, device=device)),
            "gate and up halves",
        ),
        (lambda: pointwise.silu_mul(torch.ones(3, 8, device=device)), "float16 or bfloat16"),
        (rotary(v=v[:, :2]), r"kv_write expects k, v \[7, 3, 64\]"),
        (rotary(qk=qk[:, :KV_HEADS]), "H >= 1"),
        (rotary(slots=slots[:-1]), r"for slot_mapping \[6\]"),
        (rotary(rope=tuple(t[:, :, :-1] for t in rope)), r"cos \[7, 1, 32\]"),
        (rotary(rope=(rope[0].float(), rope[1])), "one dtype"),
        (rotary(slots=slots.float()), "slot_mapping must be int32 or int64"),
        (rotary(rope=(rope[0].to("meta"), rope[1])), "cos is on meta"),
    ]


def test_bad_inputs_are_refused(device: torch.device) -> None:
    """Shapes, dtypes and devices the kernels would misread are refused before any launch,
    naming what is wrong."""
    for call, match in _bad_calls(device):
        with pytest.raises(ValueError, match=match):
            call()


# --- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_quant", ["none", "int4"])
def test_engine_with_and_without_the_kernels(
    rtn_artifact: Path, kv_quant: str, monkeypatch: pytest.MonkeyPatch, launched: Counter
) -> None:
    params = SamplingParams(
        temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(SWITCH, switch)
        launched.clear()
        engine = Engine(rtn_artifact, engine_config("triton", kv_quant=kv_quant))
        seqs = engine.generate(mixed_prompts(), params)
        runs[switch] = ([s.output_ids for s in seqs], logprobs(seqs))
        kernels = {"add_rms_norm", "silu_mul", "rotary_kv_write"}
        assert set(launched) == (kernels if switch == "1" else set()), launched
    (fused, fused_lp), (unfused, unfused_lp) = runs.values()
    assert fused == unfused
    for a, b in zip(fused_lp, unfused_lp, strict=True):
        assert torch.allclose(a, b, atol=ENGINE_TOL[kv_quant]), float((a - b).abs().max())
