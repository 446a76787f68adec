"""The CPU kernels on every ISA path this host can run (LITESERVE_CPU_ISA), the int8-activation
kernels against a torch emulation of their quantization, and the measured dispatch table."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from runtime.kernels import cpu, cpu_dispatch, isa, native, omp_threads
from runtime.kernels.cpu_dispatch import Choice

# the path each ISA's build reports; native reports the host's best, and the compiler's default
# target has NEON on 64-bit ARM
EXPECTED_PATH = {
    "avx2": "avx2",
    "generic": "neon" if platform.machine() in ("aarch64", "arm64") else "scalar",
    "avx512": "avx512-vnni",
    "avx512-emulated": "avx512-vnni-emulated",
}


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
    assert path in {*EXPECTED_PATH.values(), "avx-vnni", "avx512-vnni-amx", "neon-dotprod"}
    if name == "native" and "amx_int8" in isa.host_flags():
        assert path == "avx512-vnni-amx"


def test_the_loaded_kernels_are_the_selected_build() -> None:
    """What the whole-file runs below rely on: native.library() follows LITESERVE_CPU_ISA."""
    name, _ = isa.selected()
    path = native.isa_path(native.library())
    assert path == EXPECTED_PATH.get(name, path)


def _builds_beside_native() -> list[str]:
    """The builds whose kernels run other code than the native one that the suite tests: portable
    C (NEON's 4-lane vectors on x86), AVX2 where native has AVX-512 or AVX-VNNI, and AVX-512's
    code emulated where the host cannot run it."""
    covered = {"native", "avx512"}  # avx512 runs only where it is what native builds
    if "avx512" in RUNNABLE:
        covered.add("avx512-emulated")
    if not isa.host_flags() & {"avx512f", "avx_vnni"}:
        covered.add("avx2")
    return [name for name in RUNNABLE if name not in covered]


KERNEL_TESTS = ("test_native_kernels.py", "test_cpu_kernels.py", "test_cpu_layer.py")


@pytest.mark.parametrize("name", _builds_beside_native())
def test_kernel_test_files_pass_on_every_other_build(name: str) -> None:
    """The C kernels' own test files (attention, KV write, norms, linears, the fused layer: every
    vector width and tile the build compiles) in a child process with LITESERVE_CPU_ISA set,
    since the library is chosen once per process; not the build machinery's tests (fresh
    compiles in empty caches, whatever the ISA: the native run has them)."""
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not build",
         *(str(here / f) for f in KERNEL_TESTS),
         f"{here / Path(__file__).name}::test_the_loaded_kernels_are_the_selected_build"],
        capture_output=True, text=True, cwd=here.parent, env={**os.environ, isa.ENV: name},
    )  # fmt: skip
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def _emulated(x: torch.Tensor, gs: int) -> torch.Tensor:
    """quantize_row in torch: per row and group, step = max|x| / 127, q = round-half-even(x /
    step); returns the dequantized activations q * step in fp64."""
    m, k = x.shape
    g = x.float().view(m, k // gs, gs)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv).double() * (amax / 127).double()).view(m, k)


@pytest.mark.parametrize("unpack", [0, 1])
@pytest.mark.parametrize(
    ("m", "n", "k", "gs"),
    [(1, 70, 128, 32), (5, 33, 192, 64), (6, 40, 96, 32), (9, 64, 256, 128), (70, 24, 2048, 128)],
)
def test_int4_int8_kernel_matches_its_emulation(
    isa_lib, m: int, n: int, k: int, gs: int, unpack: int
) -> None:
    """The integer dots are exact; only the fp32 sums of group partials differ in order from
    the fp64 emulation: 1e-5 of the largest output. Rows cover the 1-row tile, the 3 x 8 (x86)
    and 4 x 2 tiles and leftovers, with column tiles read packed or unpacked once (on x86 the
    4 x 16 panels, n = 33, 40 and 24 ending in a panel's first tile); n odd covers the last
    columns; 70 rows of k = 2048 take several passes over the weights on x86."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(m * n)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // gs, generator=g) / 50 + 1e-3
    offset = -8 * scale * (1 + 0.2 * torch.randn(n, k // gs, generator=g))
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4  # uneven channels
    out, nibbles = torch.empty(m, n), cpu.tile_codes(q, gs)  # named: alive through the call
    tiled = cpu.tile_params(scale), cpu.tile_params(offset)
    lib.int4_int8_linear(
        x.data_ptr(), k, 0, nibbles.data_ptr(), tiled[0].data_ptr(), tiled[1].data_ptr(), 0,
        out.data_ptr(), m, n, k, gs, unpack,
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
    out, tiled = torch.empty(m, n), cpu.tile_head(codes, scales)
    lib.int8_int8_linear(
        x.data_ptr(), k, 0, tiled[0].data_ptr(), tiled[1].data_ptr(), out.data_ptr(), m, n, k
    )
    w = (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k)
    want = _emulated(x, 32) @ w.T
    assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-5


def _int4_kernel(
    lib, g: torch.Generator, n: int, k: int, gs: int
) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The C int4 x int8 linear on a random weight in its tiles: (rows, unpack) -> outputs."""
    nibbles = cpu.tile_codes(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), gs)
    scale, offset = (
        cpu.tile_params(t)
        for t in (torch.rand(n, k // gs, generator=g) / 50, -torch.rand(n, k // gs, generator=g))
    )

    def int4(rows: torch.Tensor, unpack: int = 0) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        lib.int4_int8_linear(
            rows.data_ptr(), k, 0, nibbles.data_ptr(), scale.data_ptr(), offset.data_ptr(), 0,
            out.data_ptr(), rows.shape[0], n, k, gs, unpack,
        )  # fmt: skip
        return out

    return int4


def _int8_head_kernel(
    lib, g: torch.Generator, n: int, k: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The C int8 x int8 linear on a random int8 head in its tiles: rows -> logits."""
    codes, scales = cpu.tile_head(
        torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        torch.rand(n, k // 32, generator=g) / 100,
    )

    def head(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        lib.int8_int8_linear(
            rows.data_ptr(), k, 0, codes.data_ptr(), scales.data_ptr(), out.data_ptr(),
            rows.shape[0], n, k,
        )  # fmt: skip
        return out

    return head


def test_int8_kernels_give_a_row_the_same_bits_in_any_batch(isa_lib) -> None:
    """A row alone (the decode tile) and at every position of batches of 2-9 rows (the 3 x 8
    and 4 x 2 tiles and the leftovers, int4 column tiles read packed or unpacked): bit-identical
    outputs, for int4 and int8 weights, so a sequence's tokens do not depend on the batch it
    shares nor on the dispatch's choice between the two int8 paths."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(5)
    n, k = 37, 192
    int4 = _int4_kernel(lib, g, n, k, 64)
    int8 = _int8_head_kernel(lib, g, n, k)
    x = torch.randn(9, k, generator=g)

    def int4_unpacked(rows: torch.Tensor) -> torch.Tensor:
        return int4(rows, 1)

    alone_int4 = torch.cat([int4(x[i : i + 1]) for i in range(9)])
    for kernel in (int4, int4_unpacked, int8):
        alone = torch.cat([kernel(x[i : i + 1]) for i in range(9)])
        if kernel is int4_unpacked:
            assert torch.equal(alone, alone_int4)
        for m in range(2, 10):
            for start in range(0, 10 - m):
                assert torch.equal(
                    kernel(x[start : start + m].contiguous()), alone[start : start + m]
                )


@pytest.mark.parametrize(
    ("n", "k", "gs"), [(37, 192, 32), (37, 192, 64), (50, 384, 96), (50, 384, 128)]
)
def test_prefill_panels_give_each_row_its_bits_alone_at_any_row_count(
    isa_lib, n: int, k: int, gs: int
) -> None:
    """The unpacked int4 panels at a prefill's row counts (on AMX hosts, blocks of 16 rows on
    the tile unit and the rest in 4-row panels): each row's outputs are those of the row alone
    in the decode tile, bit for bit, for every group size and a last panel short of columns."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(6)
    int4 = _int4_kernel(lib, g, n, k, gs)
    x = torch.randn(40, k, generator=g)
    alone = torch.cat([int4(x[i : i + 1], 0) for i in range(40)])
    for m, start in ((16, 0), (17, 3), (33, 0), (40, 0)):
        assert torch.equal(int4(x[start : start + m].contiguous(), 1), alone[start : start + m])


@pytest.mark.parametrize(("n", "k"), [(37, 192), (64, 576)])
def test_int8_head_gives_each_row_its_bits_alone_at_any_row_count(isa_lib, n: int, k: int) -> None:
    """The int8 lm_head at many rows (on AMX hosts, its full 16-column panels in blocks of 16
    rows on the tile unit, the other columns and rows in its own tiles): each row's logits are
    those of the row alone, bit for bit."""
    _, lib = isa_lib
    g = torch.Generator().manual_seed(7)
    head = _int8_head_kernel(lib, g, n, k)
    x = torch.randn(40, k, generator=g)
    alone = torch.cat([head(x[i : i + 1]) for i in range(40)])
    for m, start in ((16, 0), (17, 3), (33, 0), (40, 0)):
        assert torch.equal(head(x[start : start + m].contiguous()), alone[start : start + m])


def test_unknown_or_unrunnable_isa_is_refused_with_the_choices(monkeypatch) -> None:
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(ValueError, match=r"LITESERVE_CPU_ISA='sse9'.*one of \['native'"):
        isa.selected()
    monkeypatch.setenv(isa.ENV, "avx512")
    monkeypatch.setattr(isa, "host_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(isa, "X86", True)
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

    def best_times(runs) -> dict[str, float]:
        keys = {path: run() for path, run in runs.items()}
        calls.extend(keys.values())
        return {path: times[key] for path, key in keys.items()}

    monkeypatch.setattr(cpu_dispatch, "_best_times", best_times)
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
    timings = cpu_dispatch.measure(_candidates("a", "b", "slow"), points)
    assert ("slow", 8) not in calls and "slow" not in timings[8]  # 10x the fastest: dropped
    choice = cpu_dispatch.choose(timings)
    assert choice.points == ((1, "a"), (8, "a"), (64, "b"), (256, "a"))
    assert [choice.pick(r) for r in (1, 2, 8, 9, 64, 65, 256, 10_000)] == list("aaabbaaa")
    assert choice.paths() == {"a", "b"}
    assert choice.describe() == "a up to 8 rows, b up to 64 rows, a above"
    assert Choice(((1, "x"), (8, "x"))).describe() == "x always"


def test_an_op_never_mixes_int8_and_float_paths(monkeypatch) -> None:
    """int8 wins at one row, dense at 256: the table keeps int8 throughout (a switch would make
    tokens depend on the batch); when a float path wins at one row, int8 is left out."""
    times = {(p, r): 1.0 for p in cpu.INT4_PATHS + cpu.LOGITS_PATHS for r in (1, 2, 4, 8, 16, 32)}
    times |= {(p, r): 1.0 for p in cpu.INT4_PATHS for r in (64, 128, 256)}
    times |= {("int8", 1): 0.1, ("dense", 256): 0.01, ("int8", 256): 1.0}
    times |= {("c", 1): 0.05, ("int8", 4): 0.01}  # logits: c at one row, int8 faster at 4
    calls = _fake_times(monkeypatch, times)
    monkeypatch.setattr(cpu, "_int4_candidates", lambda lib, dtype: _candidates(*cpu.INT4_PATHS))
    monkeypatch.setattr(
        cpu, "_logits_candidates", lambda lib, dtype: _candidates(*cpu.LOGITS_PATHS)
    )
    table = cpu.measure_dispatch(None, torch.float32)
    assert table["int4"].paths() == {"int8"} and "int8" not in table["logits"].paths()
    assert calls
    assert cpu.measure_dispatch(None, torch.float32, int8=False)["int4"].pick(256) == "dense"


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
    path.write_text("{not json")  # damaged: measured again and replaced, with a warning
    assert cpu_dispatch.cached_choices("host-key", measure_all) == table
    assert measured == [1, 1]
    assert json.loads(path.read_text())["int4"] == [[1, "int8"], [256, "dense"]]
    # valid JSON of another shape failed every start (AttributeError, KeyError, IndexError)
    wrong = [
        [],
        {"int4": [[1, "int8"]]},
        {"int4": [], "logits": [[1, "c"]]},
        {"int4": [[1, "int8"]], "logits": [[1, "renamed"]]},
        {"int4": [[8, "int8"], [1, "dense"]], "logits": [[1, "c"]]},
        {"int4": [[1, "int8", 3]], "logits": [[1, "c"]]},
        {"int4": [1], "logits": [[1, "c"]]},
        {"int4": [["1", "int8"]], "logits": [[1, "c"]]},
    ]
    for n, bad in enumerate(wrong, start=3):
        path.write_text(json.dumps(bad))
        assert cpu_dispatch.cached_choices("host-key", measure_all) == table, bad
        assert len(measured) == n, bad


def test_contention_counts_only_what_other_work_took_from_the_threads() -> None:
    # (busy seconds on this process's CPUs, this process's seconds, CPUs): 4 CPUs, 2 threads
    before = (100.0, 10.0, 4)
    assert cpu_dispatch.contention(before, (104.0, 12.0, 4), 1.0, 2) == 0  # others fit on 2
    assert cpu_dispatch.contention(before, (104.5, 12.0, 4), 1.0, 2) == pytest.approx(0.25)
    assert cpu_dispatch.contention(before, (102.0, 11.0, 2), 1.0, 2) == pytest.approx(0.5)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads the CPU time in /proc/stat")
def test_a_table_measured_beside_other_work_is_used_but_not_kept(
    tmp_path, monkeypatch, caplog
) -> None:
    """A busy loop in another process on the one CPU this test pins itself to: the table is
    used, not written. Then a measurement the CPU readings show undisturbed is kept: read as
    the machine gives them, nothing here can promise that (the suite's own nvcc build runs in
    the background on both of CI's cores), so those readings say the CPUs did only this
    process's work."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    table = {"int4": Choice(((1, "int8"),)), "logits": Choice(((1, "int8"),))}
    spin = "import time\nend = time.time() + 3\nwhile time.time() < end: pass"

    def measure_beside_a_busy_loop() -> dict[str, Choice]:
        busy = subprocess.Popen([sys.executable, "-c", spin])  # on the same CPU as this test
        time.sleep(1.0)
        busy.kill()
        busy.wait()
        return table

    def measure_quietly() -> dict[str, Choice]:
        time.sleep(cpu_dispatch.MIN_JUDGED_S + 0.1)
        return table

    def readings_of_a_quiet_host() -> Iterator[tuple[float, float, int]]:
        own = 10.0
        while True:  # this process busy all along, nothing else on its 2 CPUs
            yield 100.0 + own, own, 2
            own += cpu_dispatch.MIN_JUDGED_S + 0.1

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert cpu_dispatch.cached_choices("busy-key", measure_beside_a_busy_loop) == table
        assert not list((tmp_path / "dispatch").glob("busy-key-*.json"))
        assert "the next start measures again" in caplog.text
    finally:
        os.sched_setaffinity(0, allowed)
    readings = readings_of_a_quiet_host()
    monkeypatch.setattr(cpu_dispatch, "cpu_time", lambda: next(readings))
    assert cpu_dispatch.cached_choices("busy-key", measure_quietly) == table
    assert len(list((tmp_path / "dispatch").glob("busy-key-*.json"))) == 1


def test_backend_builds_only_the_forms_its_table_uses(tmp_path, monkeypatch, caplog) -> None:
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
            ref = x @ cpu.dequantize_dense(weight, torch.float32).T
            assert torch.allclose(
                backend.int4_linear(x, weight), ref, rtol=0.02, atol=0.02 * float(ref.abs().max())
            )
        # kept unless measured beside other work (then used, not kept, and a warning says so)
        kept = len(list((tmp_path / "dispatch").glob("*.json")))
        assert kept + caplog.text.count("the next start measures again") == 2
    finally:
        native.library.cache_clear()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_a_single_threaded_load_measures_the_table_with_the_steps_threads(
    tmp_path, monkeypatch
) -> None:
    """`runtime serve` loads with one OpenMP thread and steps with all of them: the table the
    load measures is the steps' one (measured with their count, named for it), and measuring
    it leaves the loader single-threaded and no second OpenMP team behind."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path))
    seen: list[int] = []
    real = cpu.measure_dispatch

    def counting(*args, **kwargs) -> dict[str, Choice]:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu, "measure_dispatch", counting)
    steps = 3  # more than the suite's 2, so that it cannot be the count by chance
    torch.set_num_threads(steps)
    with omp_threads.openmp_left_to_the_engine_thread():
        loader_threads = len(os.listdir("/proc/self/task"))
        backend = cpu.CpuBackend()
        backend.dispatch(torch.float32)
        assert torch.get_num_threads() == 1
        for _ in range(100):  # the measuring team ends with its thread, promptly
            if len(os.listdir("/proc/self/task")) <= loader_threads:
                break
            time.sleep(0.02)
        assert len(os.listdir("/proc/self/task")) <= loader_threads
    assert seen == [steps]
    assert torch.get_num_threads() == steps
    assert f"({steps} threads)" in backend.detail
    assert [p.name.split("-float32-")[1] for p in (tmp_path / "dispatch").glob("*.json")] in (
        [f"{steps}t-v{cpu_dispatch.TABLE_VERSION}.json"],
        [],  # measured beside other work: used, not kept
    )


def test_work_run_with_other_threads_raises_in_the_caller() -> None:
    def fails() -> None:
        raise ValueError("from the measuring thread")

    with pytest.raises(ValueError, match="from the measuring thread"):
        omp_threads.with_threads(torch.get_num_threads() + 1, fails)
    assert omp_threads.with_threads(torch.get_num_threads() + 1, torch.get_num_threads) == (
        torch.get_num_threads() + 1
    )


@pytest.mark.skipif(
    not isa.X86 or shutil.which("objdump") is None,
    reason="x86 targets, read back with binutils' objdump",
)
@pytest.mark.parametrize(
    ("flags", "path", "encoding"),
    [
        (isa.ISAS["avx512"].flags, "avx512-vnni", "EVEX"),
        (("-march=alderlake",), "avx-vnni", "VEX"),
        (("-march=sapphirerapids",), "avx512-vnni-amx", None),  # with AVX-VNNI: either
    ],
)
def test_vnni_builds_compile_to_their_dot_product(
    tmp_path, flags: tuple[str, ...], path: str, encoding: str | None
) -> None:
    """The VNNI builds, compiled here even where this CPU cannot run them (their code runs in
    the avx512-emulated build): the library names its path and its tiles are `vpdpbusd` in the
    path's encoding (objdump marks AVX-VNNI's VEX form `{vex}`; where the target has both, GCC
    takes VEX where the registers allow); with AMX the prefill panels are the tile unit's
    `tdpbsud` as well."""
    lib = tmp_path / "kernels.so"
    build = subprocess.run(
        [*native._compiler(), *native.FLAGS, *flags, *map(str, native.SOURCES),
         "-o", str(lib), "-lm"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    assert f"{path}\0".encode() in lib.read_bytes()
    code = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    dots = [line for line in code.splitlines() if "vpdpbusd" in line]
    assert dots
    if encoding is not None:
        assert all(("{vex}" in line) == (encoding == "VEX") for line in dots), dots[:4]
    assert ("tdpbsud" in code) == path.endswith("amx")


ARM_TOOLS = ("aarch64-linux-gnu-gcc", "qemu-aarch64")


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ARM_TOOLS),
    reason="the ARM paths need a cross compiler and an emulator to run here: "
    "apt install gcc-aarch64-linux-gnu qemu-user",
)
@pytest.mark.parametrize(
    ("march", "path"), [("armv8.2-a+dotprod", "neon-dotprod"), ("armv8-a", "neon")]
)
def test_arm_paths_match_their_reference_under_qemu(tmp_path, march: str, path: str) -> None:
    """The NEON kernels (sdot, and the widening multiplies without it), cross-compiled with both
    C files and run under qemu-user by tests/native/qlinear_check.c, which checks them against
    a double-precision reference of the same quantization (1e-5 of the largest output)."""
    here = Path(__file__).parent
    binary = tmp_path / "check"
    sources = [here / "native" / "qlinear_check.c", *native.SOURCES]
    build = subprocess.run(
        [ARM_TOOLS[0], "-O3", f"-march={march}", "-fno-math-errno", "-fopenmp", "-static",
         *map(str, sources), "-o", str(binary), "-lm"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([ARM_TOOLS[1], "-cpu", "max", str(binary)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.split() == [path, "ok"], run.stdout + run.stderr


def test_candidates_are_timed_in_interleaved_rounds() -> None:
    """One call of each per round, so a disturbance lasting a while slows every candidate
    alike instead of deciding the table (best-of-N of one, then the other, once did)."""
    order: list[str] = []
    best = cpu_dispatch._best_times({p: (lambda p=p: order.append(p)) for p in ("a", "b", "c")})
    assert set(best) == {"a", "b", "c"} and all(t >= 0 for t in best.values())
    rounds = len(order) // 3
    assert rounds > cpu_dispatch.MIN_RUNS and order == ["a", "b", "c"] * rounds
