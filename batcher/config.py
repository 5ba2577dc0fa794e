"""The TOML configuration file given with --config.

Top-level keys are option defaults, named like the flags with underscores
(`max_wait_ms = 5`); `[models.NAME]` tables hold one model's batching settings,
which override the flags for that model only. See docs/batcher.example.toml.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from typing import Any

from batcher.scheduler import BatchSettings

#: Keys a [models.NAME] table may hold: the fields of BatchSettings.
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(BatchSettings))


class ConfigError(ValueError):
    """The file is unreadable, not TOML, or names an unknown setting."""


@dataclass(frozen=True)
class Config:
    """A parsed configuration file."""

    path: str
    options: dict[str, Any]
    models: dict[str, dict[str, Any]]

    def model_settings(self, default: BatchSettings) -> dict[str, BatchSettings]:
        """Per-model BatchSettings: `default` with each model's table applied on top."""
        out = {}
        for name, table in self.models.items():
            values = dict(table)
            if "batch_sizes" in values and values["batch_sizes"] is not None:
                values["batch_sizes"] = tuple(values["batch_sizes"])
            try:
                out[name] = dataclasses.replace(default, **values)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{self.path}: [models.{name}]: {exc}") from None
        return out


def load_config(path: str) -> Config:
    """Read and check a configuration file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    models = data.pop("models", {})
    if not isinstance(models, dict) or not all(isinstance(t, dict) for t in models.values()):
        raise ConfigError(f"{path}: 'models' must hold tables like [models.sim]")
    for name, table in models.items():
        unknown = sorted(set(table) - set(MODEL_KEYS))
        if unknown:
            raise ConfigError(
                f"{path}: [models.{name}] has unknown keys {unknown}; allowed: {', '.join(MODEL_KEYS)}"
            )
    options = {k.replace("-", "_"): v for k, v in data.items()}
    if "model" in options:  # the --model option's parameter is named `models` (repeatable)
        value = options.pop("model")
        options["models"] = [value] if isinstance(value, str) else list(value)
    if "batch_sizes" in options and isinstance(options["batch_sizes"], list):
        options["batch_sizes"] = ",".join(str(v) for v in options["batch_sizes"])
    return Config(path, options, models)
