"""Which instruction set the CPU kernels target: the host's own by default, or a lower one
chosen with ``LITESERVE_CPU_ISA`` so that every code path can be built, tested and measured on
one machine (an AVX-512 host runs the AVX2 path as an AVX2-only machine would; an AVX2 host
runs the AVX-512 path's code with its wide instructions emulated, for its results only).

A lower ISA limits torch too (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), so the whole
engine behaves as on such a machine: torch reads those once, when it is imported, so
``runtime/__init__.py`` applies them before anything imports torch. Nothing here imports torch.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV = "LITESERVE_CPU_ISA"
X86 = platform.machine() in ("x86_64", "AMD64")  # the host runs x86 targets


@dataclass(frozen=True)
class Isa:
    flags: tuple[str, ...]  # the C compiler's target flags
    requires: tuple[str, ...]  # /proc/cpuinfo flags the host must have to run it
    torch_env: tuple[tuple[str, str], ...] = ()  # torch's matching limits


ISAS = {
    "native": Isa(("-march=native",), ()),
    "avx512": Isa(
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=native"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"),),
    ),
    # the AVX-512 build's code (16-lane vectors, the VNNI tiles) on an AVX2 machine, the wide
    # instructions emulated: its results are tested everywhere, its speed means nothing
    "avx512-emulated": Isa(
        ("-march=x86-64-v3", "-mtune=native", "-DLITESERVE_EMULATE_AVX512"), ("avx2", "fma", "f16c")
    ),
    "avx2": Isa(
        ("-march=x86-64-v3", "-mtune=native"),
        ("avx2", "fma", "f16c"),
        (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")),
    ),
    # the compiler's default target: no ISA-specific path, the kernels' portable C
    "generic": Isa((), (), (("ATEN_CPU_CAPABILITY", "default"), ("ONEDNN_MAX_CPU_ISA", "SSE41"))),
}


def host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def selected() -> tuple[str, Isa]:
    """The ISA asked for by the environment (native when unset), checked against the host:
    an unknown name or one this CPU cannot run is refused with the choices."""
    name = os.environ.get(ENV, "native").strip().lower() or "native"
    if name not in ISAS:
        raise ValueError(
            f"{ENV}={name!r} is not a CPU ISA the kernels know: use one of {list(ISAS)}"
        )
    isa = ISAS[name]
    if isa.requires and not X86:
        raise ValueError(f"{ENV}={name} is an x86 target; this is {platform.machine()}: use native")
    missing = [f for f in isa.requires if f not in host_flags()]
    if missing:
        raise ValueError(
            f"{ENV}={name} needs CPU features this machine lacks ({', '.join(missing)}): "
            f"use native or a lower one of {list(ISAS)}"
        )
    return name, isa


def limit_torch() -> None:
    """Give torch the limits of a lower ISA, if one is asked for and torch is not loaded yet
    (later they would have no effect). Explicit torch settings win."""
    name = os.environ.get(ENV, "").strip().lower()
    for key, value in ISAS[name].torch_env if name in ISAS else ():
        os.environ.setdefault(key, value)
