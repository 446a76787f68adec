"""One device identity: `cuda` and `cuda:N` are resolved and compared through runtime.device.

The first GPU release failed every step with `k is on cuda:0, the cache on cuda`: the backend
made `torch.device("cuda")` and the kernel checks compared it with tensors on `cuda:0`. These
tests run on the CPU by standing in for the CUDA runtime's answers (which GPU is current, how
many there are), which is all the helper asks of it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.device import check_devices, make_current, resolve_device, same_device
from runtime.engine import engine as engine_module
from runtime.engine.engine import Engine
from runtime.engine.sampler import SamplingParams
from runtime.kernels.ops import BackendError, select_backend


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA runtime of a machine with two GPUs whose current one is cuda:1."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_unindexed_cuda_is_the_current_gpu(two_gpus) -> None:
    assert same_device("cuda", "cuda:1")
    assert same_device(torch.device("cuda:1"), torch.device("cuda"))
    assert not same_device("cuda", "cuda:0")
    assert not same_device("cuda:0", "cpu")
    assert same_device("cpu", torch.device("cpu", 0))


def test_resolve_gives_an_explicit_index(two_gpus) -> None:
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"2 GPU\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_resolve_refuses_cuda_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_device("cuda")


def test_check_devices_names_the_tensor_on_another_device() -> None:
    here = torch.zeros(2)
    check_devices(torch.device("cpu"), k=here, v=here)  # the same device passes
    with pytest.raises(ValueError, match="v is on meta, the KV cache on cpu"):
        check_devices(torch.device("cpu"), k=here, v=torch.zeros(2, device="meta"))


def test_engine_config_refuses_an_unknown_device() -> None:
    EngineConfig(device="cuda:3").validate()
    for bad in ("gpu", "cuda:x", "cuda:", "tpu:0"):
        with pytest.raises(ValueError, match="device="):
            EngineConfig(device=bad).validate()


def test_cpu_backend_refuses_a_gpu_device() -> None:
    with pytest.raises(BackendError, match="runs on the CPU"):
        select_backend("cpu", {}, "cuda:0")


def test_make_current_sets_the_gpu_and_leaves_the_cpu_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    make_current(torch.device("cpu"))
    make_current(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_engine_makes_its_device_current_on_the_thread_that_steps_it(
    rtn_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's current GPU is per thread and the server steps on its own thread: on
    --device cuda:1 every step launched its kernels on cuda:0 unless the stepping thread makes
    cuda:1 current (simulated: the call is recorded with its thread)."""
    engine = Engine(rtn_artifact, EngineConfig(backend="cpu", num_blocks=16, session_len=128))
    calls = []
    record = lambda d: calls.append((d, threading.current_thread().name))  # noqa: E731
    monkeypatch.setattr(engine_module, "make_current", record)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=2))
    stepper = threading.Thread(target=engine.step, name="stepper")
    stepper.start()
    stepper.join()
    assert calls and calls[0] == (engine.ops.device, "stepper")


def test_lite_refuses_devices_it_cannot_calibrate_on() -> None:
    """`cpu:1` was taken silently as the CPU; the others named what torch makes of them."""
    from lite.compute import pick_device

    assert pick_device("cpu") == torch.device("cpu")
    for bad in ("cpu:1", "gpu", "mps", "cuda:x"):
        with pytest.raises(ValueError, match=f"--device '{bad}': use"):
            pick_device(bad)
