"""The CPU kernels on every ISA path this host can run (LITESERVE_CPU_ISA), the int8-activation
kernels against a torch emulation of their quantization, and the measured dispatch table."""

from __future__ import annotations

import json
import os

import pytest
import torch

from runtime.kernels import cpu, cpu_dispatch, isa, native
from runtime.kernels.cpu_dispatch import Choice

# the path each ISA's build reports; native reports the host's best
EXPECTED_PATH = {"avx2": "avx2", "generic": "scalar", "avx512": "avx512-vnni"}


def _runnable() -> list[str]:
    names = []
    for name in isa.ISAS:
        os.environ[isa.ENV] = name
        try:
            isa.selected()
            names.append(name)
        except ValueError:
            pass
        finally:
            del os.environ[isa.ENV]
    return names


RUNNABLE = _runnable()


@pytest.fixture(params=RUNNABLE)
def isa_lib(request, monkeypatch):
    """The CPU kernel library built for one ISA path (cached per host like the default one)."""
    monkeypatch.setenv(isa.ENV, request.param)
    lib = native.load_native(native.SOURCES, native._SIGNATURES)
    return request.param, lib


def test_every_x86_host_runs_at_least_the_generic_and_native_paths() -> None:
    assert "native" in RUNNABLE and "generic" in RUNNABLE


def test_each_build_reports_its_path(isa_lib) -> None:
    name, lib = isa_lib
    path = native.isa_path(lib)
    assert path == EXPECTED_PATH.get(name, path)
    assert path in {"avx512-vnni", "avx-vnni", "avx2", "neon-dotprod", "neon", "scalar"}


def _emulated(x: torch.Tensor, gs: int) -> torch.Tensor:
    """quantize_rows in torch: per row and group, step = max|x| / 127, q = round-half-even(x /
    step); returns the dequantized activations q * step in fp64."""
    m, k = x.shape
    g = x.float().view(m, k // gs, gs)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv).double() * (amax / 127).double()).view(m, k)


@pytest.mark.parametrize(
    ("m", "n", "k", "gs"), [(1, 70, 128, 32), (5, 33, 192, 64), (9, 64, 256, 128)]
)
def test_int4_int8_kernel_matches_its_emulation(isa_lib, m: int, n: int, k: int, gs: int) -> None:
    """The integer dots are exact; only the fp32 sums of group partials differ in order from
    the fp64 emulation: 1e-5 of the largest output. Rows cover the 1-row tile, the 4 x 2 tile
    and leftovers; n odd covers the last columns."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(m * n)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // gs, generator=g) / 50 + 1e-3
    offset = -8 * scale * (1 + 0.2 * torch.randn(n, k // gs, generator=g))
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven channels
    out, nibbles = torch.empty(m, n), cpu._nibbles(q, gs)  # named: alive through the call
    lib.int4_int8_linear(
        x.data_ptr(), k, 0, nibbles.data_ptr(), scale.data_ptr(), offset.data_ptr(), 0,
        out.data_ptr(), m, n, k, gs,
    )  # fmt: skip
    w = q.double().view(n, -1, gs) * scale.double()[..., None] + offset.double()[..., None]
    want = _emulated(x, gs) @ w.view(n, k).T
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize(("m", "n", "k"), [(1, 50, 64), (6, 77, 160)])
def test_int8_int8_kernel_matches_its_emulation(isa_lib, m: int, n: int, k: int) -> None:
    """Signed weights at both extremes (-127 and 127), so the x86 |w| x sign(x, w) trick is
    exercised where it could overflow; tolerance as above."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(m + n)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :32], codes[-1, :32] = 127, -127
    scales = torch.rand(n, k // 32, generator=g) / 100
    x = torch.randn(m, k, generator=g)
    x[0, :32] = torch.linspace(-3, 3, 32)
    out = torch.empty(m, n)
    lib.int8_int8_linear(
        x.data_ptr(), k, 0, codes.data_ptr(), scales.data_ptr(), out.data_ptr(), m, n, k
    )
    w = (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k)
    want = _emulated(x, 32) @ w.T
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_unknown_or_unrunnable_isa_is_refused_with_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(ValueError, match=r"LITESERVE_CPU_ISA='sse9'.*one of \['native'"):
        isa.selected()
    monkeypatch.setenv(isa.ENV, "avx512")
    monkeypatch.setattr(isa, "_host_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match="lacks .*avx512f.*use native or a lower one"):
        isa.selected()


def test_lower_isa_limits_torch_unless_told_otherwise(monkeypatch) -> None:
    monkeypatch.setenv(isa.ENV, "avx2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # the user's own setting wins
    isa.limit_torch()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"


def _fake_times(monkeypatch, times: dict[tuple[str, int], float]) -> list[tuple[str, int]]:
    """measure() with given timings: no clock involved, so the choice logic is what is tested."""
    calls: list[tuple[str, int]] = []

    def best_time(run) -> float:
        key = run()
        calls.append(key)
        return times[key]

    monkeypatch.setattr(cpu_dispatch, "_best_time", best_time)
    return calls


def _candidates(*paths: str) -> cpu_dispatch.Candidates:
    return {p: (lambda rows, p=p: lambda: (p, rows)) for p in paths}


def test_measure_picks_the_fastest_keeps_near_ties_and_drops_losers(monkeypatch) -> None:
    points = (1, 8, 64, 256)
    times = {
        ("a", 1): 1.0, ("b", 1): 2.0, ("slow", 1): 10.0,
        ("a", 8): 1.05, ("b", 8): 1.0,  # within 10%: a stays
        ("a", 64): 3.0, ("b", 64): 1.0,
        ("a", 256): 2.0, ("b", 256): 4.0,
    }  # fmt: skip
    calls = _fake_times(monkeypatch, times)
    choice = cpu_dispatch.measure(_candidates("a", "b", "slow"), points)
    assert choice.points == ((1, "a"), (8, "a"), (64, "b"), (256, "a"))
    assert ("slow", 8) not in calls  # 10x the fastest at 1 row: not timed again
    assert [choice.pick(r) for r in (1, 2, 8, 9, 64, 65, 256, 10_000)] == list("aaabbaaa")
    assert choice.paths() == {"a", "b"}
    assert choice.describe() == "a up to 8 rows, b up to 64 rows, a above"
    assert Choice(((1, "x"), (8, "x"))).describe() == "x always"


def test_table_is_measured_once_per_host_and_read_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    table = {"int4": Choice(((1, "int8"), (256, "dense"))), "logits": Choice(((4, "c"),))}
    measured = []

    def measure_all() -> dict[str, Choice]:
        measured.append(1)
        return table

    assert cpu_dispatch.cached_choices("host-key", measure_all) == table
    assert cpu_dispatch.cached_choices("host-key", measure_all) == table
    assert measured == [1]
    (path,) = (tmp_path / "dispatch").glob("host-key-*.json")
    assert json.loads(path.read_text())["int4"] == [[1, "int8"], [256, "dense"]]
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match=r"host-key.*unreadable.*delete it to measure again"):
        cpu_dispatch.cached_choices("host-key", measure_all)


def test_backend_builds_only_the_forms_its_table_uses(tmp_path, monkeypatch) -> None:
    """A fresh cache: the backend measures this host, logs the table, and repacks weights only
    into the forms of the paths it chose; LITESERVE_CPU_INT8=0 leaves the int8 paths out."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        for int8 in ("1", "0"):
            monkeypatch.setenv("LITESERVE_CPU_INT8", int8)
            backend = cpu.CpuBackend()
            table = backend.dispatch(torch.float32)
            assert table["int4"].paths() <= set(cpu.INT4_PATHS)
            assert table["logits"].paths() <= set(cpu.LOGITS_PATHS)
            if int8 == "0":
                assert not (table["int4"].paths() | table["logits"].paths()) & cpu.INT8_PATHS
                assert "LITESERVE_CPU_INT8=0" in backend.detail
            w = torch.randn(48, 128)
            qw = cpu.pack_qweight(torch.randint(0, 16, (48, 128), dtype=torch.uint8), 64)
            scale, zero = torch.rand(48, 2) / 10, torch.randint(0, 16, (48, 2))
            weight = backend.prepare_int4(
                [(qw, cpu.pack_qparams(scale, zero, 64, 128), 48)], 128, 64, torch.float32
            )
            assert (weight.packed is not None) == ("torch-int4" in table["int4"].paths())
            head = backend.prepare_logits(w)
            assert (head.codes is not None) == ("int8" in table["logits"].paths())
            x = torch.randn(3, 128)
            ref = x @ cpu.dequantize_dense(weight).T
            assert torch.allclose(
                backend.int4_linear(x, weight), ref, rtol=0.02, atol=0.02 * float(ref.abs().max())
            )
        assert len(list((tmp_path / "dispatch").glob("*.json"))) == 2
    finally:
        native.library.cache_clear()
