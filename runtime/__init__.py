"""runtime: loads liteserve artifacts and serves them. Never imports lite.

The public names load on first use (PEP 562): `lite convert`, `runtime verify` and the CLIs'
--help need the artifact modules only, and the engine's imports (llguidance pulls in
torch._dynamo) cost seconds at every start.
"""

import importlib
import importlib.metadata

from runtime.kernels.isa import limit_torch

limit_torch()  # before anything imports torch: LITESERVE_CPU_ISA limits torch's kernels too

try:  # pyproject.toml's, the one place it is written (manifests and /version report it)
    __version__ = importlib.metadata.version("liteserve")
except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
    __version__ = "0+unknown"

_LAZY = {
    "EngineConfig": "runtime.config",
    "GenerationConfig": "runtime.api",
    "pipeline": "runtime.api",
}

__all__ = ["EngineConfig", "GenerationConfig", "__version__", "pipeline"]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
