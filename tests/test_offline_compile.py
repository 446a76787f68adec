"""Every Triton launch the runtime makes compiles for sm_80 and sm_90, on any machine: no
errors, no register spills, shared memory within the smallest budget of the architecture's
GPUs, tensor cores in the GEMM and attention (``tests/triton_compile.py`` says how, and why the
interpreted kernel tests cannot see these)."""

from __future__ import annotations

import pytest

from runtime.kernels.triton import attention, gemm, kv_write, pointwise
from tests import triton_compile
from tests.cuda_lib import find_cuobjdump
from tests.triton_compile import ARCHS, SHARED_LIMIT, Launch

DOT_KERNELS = ("_w4a16_kernel", "_decode_partition_kernel", "_prefill_kernel")


@pytest.fixture(scope="module")
def launches() -> dict[int, list[Launch]]:
    cuobjdump = find_cuobjdump()
    assert cuobjdump, "cuobjdump not found (PATH, nvcc's directory, or the one triton ships)"
    return triton_compile.results(cuobjdump)


def _report(bad: list[Launch], what: str) -> str:
    lines = [f"{len(bad)} launch(es) {what}:"]
    lines += [f"  {x.kernel} [{x.case}] {x.error or x}" for x in bad[:10]]
    return "\n".join(lines)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles(launches: dict[int, list[Launch]], arch: int) -> None:
    failed = [x for x in launches[arch] if x.error]
    assert not failed, _report(failed, f"failed to compile for sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
def test_no_register_spills(launches: dict[int, list[Launch]], arch: int) -> None:
    spilled = [x for x in launches[arch] if x.stack]
    assert not spilled, _report(spilled, f"spill registers at sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_memory_fits(launches: dict[int, list[Launch]], arch: int) -> None:
    over = [x for x in launches[arch] if x.shared > SHARED_LIMIT[arch]]
    assert not over, _report(over, f"need more than {SHARED_LIMIT[arch]} bytes of shared memory")


@pytest.mark.parametrize("arch", ARCHS)
def test_dots_run_on_tensor_cores(launches: dict[int, list[Launch]], arch: int) -> None:
    scalar = [x for x in launches[arch] if x.kernel in DOT_KERNELS and not x.tensor_cores]
    assert not scalar, _report(scalar, f"issue no tensor-core instruction at sm_{arch}")


@pytest.mark.parametrize("arch", ARCHS)
def test_one_row_gemm_keeps_subnormals(launches: dict[int, list[Launch]], arch: int) -> None:
    """The one-row GEMM reads its codes as fp32 subnormals (``gemm._subnormal_code``): an
    instruction that flushes them to zero would zero every weight."""
    gemv = [x for x in launches[arch] if x.kernel == "_w4a16_gemv_kernel"]
    flushed = [x for x in gemv if x.flush_to_zero]
    assert gemv and not flushed, _report(flushed, f"flush subnormals at sm_{arch}")


def test_programmatic_launch_waits_before_reading(launches: dict[int, list[Launch]]) -> None:
    """With ``LITESERVE_TRITON_PDL=1`` (sm_90) every kernel that takes the PDL constexpr waits
    for the kernels before it (ACQBULK) before it touches global memory (the one-row GEMM's L2
    prefetch of its weights may come first) and lets the next one launch (PREEXIT)."""
    takes_pdl = {
        name
        for module in (gemm, attention, kv_write, pointwise)
        for name, fn in vars(module).items()
        if name.endswith("_kernel") and "PDL" in getattr(fn, "arg_names", ())
    }
    pdl = [x for x in launches[90] if x.pdl]
    assert {x.kernel for x in pdl} == takes_pdl and "_w4a16_gemv_kernel" in takes_pdl
    early = [x for x in pdl if not x.waits_first]
    assert not early, _report(early, "touch global memory before griddepcontrol.wait")
    assert not any(x.pdl for x in launches[80])


def test_every_kernel_is_compiled(launches: dict[int, list[Launch]]) -> None:
    """The cases reach every kernel the modules launch: a new kernel cannot go unchecked."""
    kernels = {
        name
        for module in (gemm, attention, kv_write, pointwise)
        for name in vars(module)
        if name.endswith("_kernel") and hasattr(getattr(module, name), "fn")
    }
    assert kernels >= set(DOT_KERNELS), kernels
    for arch in ARCHS:
        assert {x.kernel for x in launches[arch]} == kernels
