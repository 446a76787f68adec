"""Per-model recipes: small YAML files of calibration and serving settings.

Explicit command-line flags override a recipe; the recipe's serving part becomes the
artifact's launch config, so `runtime serve` starts with what the recipe's author measured.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from lite.quantizer import SUPPORTED_BITS
from runtime.artifact.layout import GROUP_SIZES
from runtime.artifact.manifest import LaunchConfig
from runtime.validation import validation_message


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    model: str | None = None
    calib_dataset: str | None = None
    calib_samples: int | None = Field(None, ge=0)  # 0: RTN
    calib_seqlen: int | None = Field(None, ge=2)
    w_bits: int | None = None
    w_group_size: int | None = None
    w_sym: bool | None = Field(None, strict=True)  # true or false, not "yes"
    launch: LaunchConfig = LaunchConfig()

    @field_validator("w_bits", "w_group_size")
    @classmethod
    def _supported(cls, v: int | None, info: ValidationInfo) -> int | None:
        """Named as the recipe's key: the flag's message (--w-group-size 100 is not supported)
        blamed a flag the user never passed."""
        allowed = SUPPORTED_BITS if info.field_name == "w_bits" else GROUP_SIZES
        if v is not None and v not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
        return v

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
