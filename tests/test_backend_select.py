"""Which backend runs, and why: named backends are refused with the reason, auto says what it
passed over (logs, /health and `runtime check` show the backend's detail line)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from runtime.cli import main
from runtime.kernels import ops
from runtime.kernels.cuda import library
from runtime.kernels.ops import BackendError, select_backend

# What a simulated nvcc writes first into its output ("$2"): a 64-bit little-endian ELF header
# with no tables, the least that the cache takes for a whole library.
FAKE_ELF = 'printf "\\177ELF\\2\\1\\1" > "$2"; head -c 57 /dev/zero >> "$2"\n'
FAKE_ELF_BYTES = b"\x7fELF\x02\x01\x01" + bytes(57)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_without_a_gpu_is_the_cpu_and_says_so(no_gpu) -> None:
    backend = select_backend("auto", {})
    assert backend.name == "cpu" and backend.detail.endswith("(auto: no CUDA GPU)")
    assert select_backend("auto", {}, "cpu").detail == select_backend("cpu", {}).detail


def test_named_gpu_backends_are_refused_without_a_gpu(no_gpu, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendError, match="backend 'cuda' needs a CUDA GPU"):
        select_backend("cuda", {})
    with pytest.raises(BackendError, match="backend 'triton' needs a CUDA GPU"):
        select_backend("triton", {})


def test_auto_asked_for_a_gpu_that_is_not_there_says_so_once(no_gpu, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendError, match=r"^device 'cuda:1' needs a CUDA GPU.*--device cpu"):
        select_backend("auto", {}, "cuda:1")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(BackendError, match="expected one of auto, cpu, triton, cuda"):
        select_backend("tpu", {})


def test_build_kernels_without_nvcc_says_how_to_get_it(monkeypatch, tmp_path) -> None:
    # an empty cache: a library built earlier on this machine (`runtime build-kernels`) would
    # rightly be served without nvcc
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    result = CliRunner().invoke(main, ["build-kernels"])
    assert result.exit_code == 1
    assert "nvcc is not installed" in result.output and "NVCC" in result.output
    assert "building" not in result.output  # no promise of a build that cannot start
    with pytest.raises(library.BuildUnavailable, match="nvcc is not installed"):
        library.build()
    monkeypatch.setenv("NVCC", str(tmp_path / "absent"))  # a typo is not passed over silently
    with pytest.raises(library.BuildUnavailable, match=r"NVCC=.*absent is not a file"):
        library.build()


def test_a_cuda_library_that_cannot_run_here_says_why_and_what_to_do(tmp_path) -> None:
    """The reasons auto passes over cuda for (and `--backend cuda` is refused with), from the
    library's probe of the device: on the GPU machines this project meets, not simulable here."""
    path = tmp_path / "liteserve_cuda-0123.so"
    ok = library.Probe(0, "cudaSuccess", 13000, 13000)
    assert library.unrunnable(ok, (9, 0), path) is None
    assert library.unrunnable(ok, (12, 0), path) is None  # newer GPUs JIT the sm_90 PTX
    old_gpu = library.unrunnable(ok, (7, 5), path)
    assert "compute capability 8.0 or newer" in old_gpu and "this one is sm_75" in old_gpu
    assert "--backend triton or cpu" in old_gpu
    old_driver = library.Probe(35, "cudaErrorInsufficientDriver", 13000, 12080)
    why = library.unrunnable(old_driver, (9, 0), path)
    assert "links the CUDA 13.0 runtime" in why and "driver supports CUDA 12.8" in why
    assert "update the driver" in why and f"remove {path}" in why and "build-kernels" in why
    no_image = library.Probe(209, "cudaErrorNoKernelImageForDevice", 13000, 13000)
    why = library.unrunnable(no_image, (8, 0), path)
    assert why.endswith("do not load on this GPU: cudaErrorNoKernelImageForDevice (209)")
    assert old_driver.versions() == "CUDA 13.0 runtime, driver 12.8"
    no_driver = library.Probe(35, "cudaErrorInsufficientDriver", 13000, 0)
    assert no_driver.versions() == "CUDA 13.0 runtime, driver none"
    assert "no NVIDIA driver answers" in library.unrunnable(no_driver, (9, 0), path)


class _Made:
    def __init__(self, name: str) -> None:
        self.name, self.detail = name, f"{name} detail"


def test_auto_on_a_gpu_tries_cuda_then_triton(monkeypatch) -> None:
    """The order --backend auto promises (docs/runtime.md), checked on the CPU: the GPU and the
    backends' constructors are simulated, each failing with its reason or not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tried, failing = [], set()

    def make(name: str, pinned: dict, device: str, int8_activations: bool) -> _Made:
        tried.append((name, device))
        if name in failing:
            raise BackendError(f"{name} cannot here")
        return _Made(name)

    monkeypatch.setattr(ops, "_make", make)
    assert select_backend("auto", {}, "cuda:1").name == "cuda"
    assert tried == [("cuda", "cuda:1")]
    failing.add("cuda")
    backend = select_backend("auto", {})
    assert backend.name == "triton"
    assert backend.detail == "triton detail (auto passed over cuda: cuda cannot here)"
    failing.add("triton")
    with pytest.raises(BackendError, match=r"\(cuda: cuda cannot here; triton: triton cannot"):
        select_backend("auto", {})
    tried.clear()
    assert select_backend("auto", {}, "cpu").name == "cpu" and tried == [("cpu", "auto")]


def test_first_build_of_the_cuda_library_says_so(monkeypatch, tmp_path, caplog) -> None:
    """Compiling csrc/ takes minutes: start-up must not look hung. The build is simulated by a
    compiler that writes its output; the second call finds it cached and says nothing."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n' + FAKE_ELF)
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    with caplog.at_level("WARNING", logger="liteserve"):
        path = library.build()
        assert path.read_bytes() == FAKE_ELF_BYTES
        assert f"building the CUDA kernels with {fake} for 80, 86, 89, 90" in caplog.text
        caplog.clear()
        assert library.build() == path and caplog.text == ""


@pytest.fixture
def fake_nvcc(monkeypatch, tmp_path) -> Path:
    """An empty cache and a compiler that writes its arguments as the library."""
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "nvcc"
    fake.write_text(
        '#!/bin/sh\nargs="$*"\nwhile [ "$1" != "-o" ]; do shift; done\n'
        + FAKE_ELF
        + 'printf "%s" "$args" >> "$2"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    return fake


def test_first_use_builds_for_this_machines_gpus_unless_every_architecture_is_there(
    fake_nvcc: Path, monkeypatch, tmp_path
) -> None:
    """A first start-up waits for nvcc: for the GPU kinds present only (less than half the
    time for one), unless the library for every architecture is cached (`runtime
    build-kernels`, or carried to a machine without nvcc)."""

    def built_for(path) -> list[str]:
        return re.findall(r"code=sm_(\d+)", path.read_text())

    cache = os.environ["LITESERVE_CACHE"]
    monkeypatch.setenv("LITESERVE_CACHE", str(tmp_path / "empty"))
    no_gpu = library.first_use(())  # no GPU, nothing cached: every architecture, built
    assert no_gpu == library.target_path() and built_for(no_gpu) == list(library.ARCHS)
    monkeypatch.setenv("LITESERVE_CACHE", cache)
    h100 = library.first_use(("90",))
    assert h100 == library.target_path(("90",)) and built_for(h100) == ["90"]
    assert "arch=compute_90,code=compute_90" in h100.read_text()  # PTX for newer GPUs
    mixed = library.first_use(("90", "80"))
    assert built_for(mixed) == ["80", "90"]
    assert library.first_use(()) == h100  # no GPU: host code only, which any build has
    newer = library.first_use(("120",))  # none of ARCHS exactly: its driver compiles the PTX
    assert newer == library.target_path() and built_for(newer) == list(library.ARCHS)
    fake_nvcc.unlink()  # with every architecture cached, no compiler is needed
    assert library.first_use(("86",)) == library.target_path()


def test_build_kernels_for_one_architecture_is_the_one_that_machine_uses(
    fake_nvcc: Path,
) -> None:
    """`runtime build-kernels --arch 90`: the library an H100/H200 without nvcc finds, a
    fraction of the every-architecture one's size (57 MiB there, over what a device call
    carries)."""
    result = CliRunner().invoke(main, ["build-kernels", "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    assert str(library.target_path(("90",))) in result.output and "(sm_90;" in result.output
    fake_nvcc.unlink()  # found without a compiler by a machine of that architecture only
    assert library.first_use(("90",)) == library.target_path(("90",))
    # and by one without a GPU, which runs only its host code (the kernels' CPU twins)
    assert library.first_use(()) == library.target_path(("90",))
    with pytest.raises(library.BuildUnavailable):  # not by another GPU's
        library.first_use(("80",))
    bad = CliRunner().invoke(main, ["build-kernels", "--arch", "75"])
    assert bad.exit_code == 2 and "choose from 80,86,89,90" in bad.output


def test_a_gpu_without_pinned_configs_is_told_how_to_pin_them(caplog) -> None:
    from runtime.kernels.gpu import log_pinned

    kernels = {"sm_90": {"w4a16/N64xK64/m1": {}}, "cuda/sm_90": {"w4a16/N64xK64/m1": {}}}
    with caplog.at_level("INFO", logger="runtime.kernels"):
        log_pinned("cuda/sm_80", {}, kernels, "the planner's configs")
        assert (
            "no tuned kernel configs for cuda/sm_80 (tuned for: cuda/sm_90, sm_90)" in caplog.text
        )
        assert "using the planner's configs. `lite tune ARTIFACT`" in caplog.text
        caplog.clear()
        log_pinned("cuda/sm_90", kernels["cuda/sm_90"], kernels, "the planner's configs")
        assert [r.levelname for r in caplog.records] == ["INFO"]


def test_each_backend_names_its_own_default_dtype(monkeypatch) -> None:
    """`--dtype auto` asks the backend, not its name: fp32 where the CPU fuses its layers in C,
    bf16 or fp32 by the host's bf16 support where it does not, fp16 under the interpreter."""
    cpu = select_backend("cpu", {})
    if cpu.fuses_layers:
        assert cpu.default_dtype() == torch.float32
    monkeypatch.setenv("LITESERVE_CPU_INT8", "0")  # no int8 path: no fused layer either
    floats = select_backend("cpu", {})
    assert not floats.fuses_layers
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert floats.default_dtype() == (torch.bfloat16 if native_bf16 else torch.float32)
    if torch.cuda.is_available():
        assert select_backend("triton", {}, "cuda").default_dtype() == torch.bfloat16
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert select_backend("triton", {}, "cpu").default_dtype() == torch.float16


def test_the_cpu_engine_runs_without_triton(rtn_artifact) -> None:
    """triton is a dev extra and the CPU torch wheel does not bring it: a top-level import in
    the GPU backends' shared module made every engine fail on `pip install liteserve`."""
    import subprocess
    import sys

    no_triton = "import sys; sys.modules['triton'] = None; from runtime.cli import main; main()"
    args = ["generate", str(rtn_artifact), "--prompt", "Hi", "--max-new-tokens", "3"]
    done = subprocess.run(
        [sys.executable, "-c", no_triton, *args, "--num-blocks", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
