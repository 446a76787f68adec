"""runtime: loads liteserve artifacts and serves them. Never imports lite."""

__version__ = "0.1.0"

from runtime.config import EngineConfig  # noqa: E402
from runtime.pipeline import GenerationConfig, pipeline  # noqa: E402

__all__ = ["EngineConfig", "GenerationConfig", "__version__", "pipeline"]
