"""The wheel carries every source the runtime compiles on first use.

A user who installs liteserve with pip, not from a checkout, still builds the CPU C kernels
(runtime/kernels/*.c) and the CUDA library (csrc/, reached through the link
runtime/kernels/cuda/csrc) on first use. Built with setuptools, as `pip install .` builds it,
from a copy of the files a build reads, so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from runtime.kernels import native, repack
from runtime.kernels.cuda import library

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_kernel_sources(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("lite", "runtime", "csrc"):
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("liteserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    cuda = {f"runtime/kernels/cuda/csrc/{p.name}" for p in library.CSRC.glob("*.cu*")}
    c = {f"runtime/kernels/{p.name}" for p in (*native.SOURCES, repack.SOURCE)}
    assert len(cuda) >= 4 and c, (cuda, c)  # the globs found the sources
    assert cuda | c <= names, sorted((cuda | c) - names)
