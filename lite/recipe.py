"""Per-model recipes: small YAML files of calibration and serving settings.

Explicit command-line flags override a recipe; the recipe's serving part becomes the
artifact's launch config, so `runtime serve` starts with what the recipe's author measured.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.artifact.manifest import LaunchConfig
from runtime.validation import validation_message


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    model: str | None = None
    calib_dataset: str | None = None
    calib_samples: int | None = None
    calib_seqlen: int | None = None
    w_bits: int | None = None
    w_group_size: int | None = None
    w_sym: bool | None = None
    launch: LaunchConfig = LaunchConfig()

    def flags(self) -> dict[str, object]:
        """The recipe's values under the names of `lite auto_awq`'s options."""
        names = (
            "calib_dataset",
            "calib_samples",
            "calib_seqlen",
            "w_bits",
            "w_group_size",
            "w_sym",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"recipe {p}: cannot read it ({e.strerror or e})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {p} is not valid YAML: {e}") from e
    try:
        return Recipe.model_validate(data or {})
    except ValidationError as e:
        raise ValueError(f"recipe {p} has invalid settings: {validation_message(e)[0]}") from e
