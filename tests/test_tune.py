"""`lite tune`'s choices that need no GPU: which backend ``auto`` tunes without one, and that
its pins go into the manifest as it is when written, beside any other backend's."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lite.tune import pin_kernels, tuner_for
from runtime.artifact.reader import Artifact


def test_auto_without_a_cuda_device_tunes_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreted, ``auto`` took the emulated cuda backend: minutes of nvcc building its
    library, and pins under cuda/interpreter while the message said Triton ran interpreted."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tuner = tuner_for("auto", torch.device("cpu"), torch.float16, 1)
    assert tuner.kernels_key == "interpreter"


def test_concurrent_pins_of_different_backends_all_land(rtn_artifact: Path, tmp_path: Path) -> None:
    """Two tunes (say cuda and triton) pinning into one artifact at once: each reads the
    manifest, sets its own key and writes it back under the lock, so no pin is lost."""
    art = Path(shutil.copytree(rtn_artifact, tmp_path / "art"))
    pins = {
        f"{backend}/sm_{i}": {"w4a16/N96xK96/m1": {"dequant": 1}}
        for backend in ("cuda", "x")
        for i in range(12)
    }

    def pin(backend: str) -> None:
        for key, winners in pins.items():
            if key.startswith(backend):
                pin_kernels(art, key, winners)

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(pin, b) for b in ("cuda", "x")]:
            done.result()
    assert Artifact(art).manifest.launch.kernels == pins
    assert json.loads((art / "manifest.json").read_text())["launch"]["kernels"] == pins
