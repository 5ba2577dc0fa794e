"""The TOML configuration file given with --config.

Top-level keys are option defaults, named like the flags with underscores
(`max_wait_ms = 5`); `[models.NAME]` tables hold one model's batching settings and
placement (`gpus`, `workers`), which override the file's top level for that model. A
value given on the command line or in the environment beats the whole file, tables
included. See docs/batcher.example.toml.

Values are type-checked as strictly as flags are parsed: TOML has booleans, floats and
strings that Python would quietly turn into ints (`true` into 1, `2.0` into 2), and one
such value reaching the broker fails every batch of its size, not the start-up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from batcher.core.scheduler import BatchSettings
from batcher.errors import BatcherError

#: Keys of a [models.NAME] table for the model's workers (`serve` only): the devices it
#: is pinned to, how many workers it gets, and the file of the input its warm-up runs
#: on (workers/warmup.py). Not batching settings.
PLACEMENT_KEYS = ("gpus", "workers", "warmup_sample", "cache")
#: Keys a [models.NAME] table may hold: the fields of BatchSettings, then placement.
MODEL_KEYS = (*(f.name for f in dataclasses.fields(BatchSettings)), *PLACEMENT_KEYS)


class ConfigError(BatcherError, ValueError):
    """The file is unreadable, not TOML, names an unknown setting or has a value of the
    wrong type."""


class Kind(Enum):
    """The TOML type a setting takes (its value is what error messages call it)."""

    INT = "an integer"
    NUMBER = "a number"
    STR = "a string"
    BOOL = "a boolean"
    INT_LIST = "a list of integers like [1, 2, 4, 8]"
    STR_OR_LIST = "a string or a list of strings"


#: Options whose flag takes a comma-separated list and whose file value is a TOML list.
COMMA_LIST_OPTIONS = ("batch_sizes", "gpus", "length_buckets")

#: The type of each [models.NAME] key (a key missing here is left to BatchSettings).
MODEL_KINDS = {
    "max_batch_size": Kind.INT,
    "max_wait_ms": Kind.NUMBER,
    "batch_sizes": Kind.INT_LIST,
    "max_queue": Kind.INT,
    "max_batch_cost": Kind.NUMBER,
    "priority_aging_ms": Kind.NUMBER,
    "policy": Kind.STR,
    "bucket_by": Kind.STR,
    "length_buckets": Kind.INT_LIST,
    "gpus": Kind.INT_LIST,
    "workers": Kind.INT,
    "warmup_sample": Kind.STR,
    "cache": Kind.BOOL,
}


def toml_repr(value: Any) -> str:
    """`value` written as in the TOML file, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_repr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_repr(v)}" for k, v in value.items()) + "}"
    return str(value)


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    for python, name in ((int, "an integer"), (float, "a float"), (str, "a string"), (list, "an array")):
        if isinstance(value, python):
            return name
    return "a table" if isinstance(value, dict) else "a date or time"


def _is(value: Any, kind: Kind) -> bool:
    if kind is Kind.BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):  # a bool is an int to Python, never to us
        return False
    if kind is Kind.INT:
        return isinstance(value, int)
    if kind is Kind.NUMBER:
        return isinstance(value, int | float)
    if kind is Kind.STR:
        return isinstance(value, str)
    if kind is Kind.INT_LIST:
        return isinstance(value, list) and all(_is(v, Kind.INT) for v in value)
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def type_problem(value: Any, kinds: Iterable[Kind]) -> str | None:
    """Why `value` is none of `kinds`, or None when it is one of them."""
    kinds = list(kinds)
    if not kinds or any(_is(value, k) for k in kinds):
        return None
    expected = " or ".join(k.value for k in kinds)
    list_kinds = [k for k in kinds if k in (Kind.INT_LIST, Kind.STR_OR_LIST)]
    if isinstance(value, list) and list_kinds:  # name the element that is wrong
        wrong = next((v for v in value if not any(_is([v], k) for k in list_kinds)), None)
        if wrong is not None:
            return f"expected {expected}, got {toml_repr(wrong)} ({_toml_type(wrong)}) in {toml_repr(value)}"
    return f"expected {expected}, got {toml_repr(value)} ({_toml_type(value)})"


def where(key: str, model: str | None = None) -> str:
    """How error messages name a key: `[models.NAME] key`, or `key (top level)`."""
    return f"[models.{model}] {key}" if model is not None else f"{key} (top level)"


@dataclass(frozen=True)
class Config:
    """A parsed configuration file."""

    path: str
    options: dict[str, Any]
    models: dict[str, dict[str, Any]]
    #: The file's top-level keys as written (before `model` became `models`).
    raw: dict[str, Any] = dataclasses.field(default_factory=dict)

    def error(self, key: str, model: str | None, problem: str) -> ConfigError:
        """A ConfigError naming this file, the table and the key."""
        return ConfigError(f"{self.path}: {where(key, model)}: {problem}")

    def model_settings(self, default: BatchSettings, fixed: Collection[str] = ()) -> dict[str, BatchSettings]:
        """Per-model BatchSettings: `default` with each model's table applied on top,
        except the keys in `fixed` (set on the command line or in the environment, which
        beat the file everywhere) and the placement keys (see model_gpus, model_workers)."""
        out = {}
        for name, table in self.models.items():
            values = {k: v for k, v in table.items() if k not in fixed and k not in PLACEMENT_KEYS}
            for key in ("batch_sizes", "length_buckets"):
                if values.get(key) is not None:
                    values[key] = tuple(values[key])
            if isinstance(values.get("max_wait_ms"), int):
                values["max_wait_ms"] = float(values["max_wait_ms"])
            try:
                out[name] = dataclasses.replace(default, **values)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{self.path}: [models.{name}]: {exc}") from None
        return out

    def model_gpus(self) -> dict[str, tuple[int, ...]]:
        """The devices each model is pinned to (`gpus = [0]` in its table)."""
        return {name: tuple(t["gpus"]) for name, t in self.models.items() if "gpus" in t}

    def model_warmup_samples(self) -> dict[str, str]:
        """The warm-up sample file of each model whose table names one (`warmup_sample =
        "x.json"`), a relative path taken from the configuration file's directory."""
        here = os.path.dirname(os.path.abspath(self.path))
        return {
            name: os.path.join(here, t["warmup_sample"])
            for name, t in self.models.items()
            if "warmup_sample" in t
        }

    def cached_models(self) -> tuple[str, ...]:
        """The models whose table says `cache = true` (their ok replies are cached)."""
        return tuple(name for name, t in self.models.items() if t.get("cache") is True)

    def model_workers(self) -> dict[str, int]:
        """The workers of each model whose table says (`workers = N`)."""
        return {name: t["workers"] for name, t in self.models.items() if "workers" in t}


def load_config(path: str) -> Config:
    """Read a configuration file and check its structure and its tables' types (the
    top-level keys are checked against the commands' options, by the CLI)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not valid TOML: not UTF-8 text") from None
    models = data.pop("models", {})
    if not isinstance(models, dict) or not all(isinstance(t, dict) for t in models.values()):
        raise ConfigError(f"{path}: 'models' must hold tables like [models.sim]")
    for name, table in models.items():
        unknown = sorted(set(table) - set(MODEL_KEYS))
        if unknown:
            raise ConfigError(
                f"{path}: [models.{name}] has unknown keys {unknown}; allowed: {', '.join(MODEL_KEYS)}"
            )
        for key, value in table.items():
            problem = type_problem(value, [MODEL_KINDS[key]] if key in MODEL_KINDS else [])
            if problem:
                raise ConfigError(f"{path}: {where(key, name)}: {problem}")
    raw = {k.replace("-", "_"): v for k, v in data.items()}
    options = dict(raw)
    if "model" in options:  # the --model option's parameter is named `models` (repeatable)
        value = options.pop("model")
        options["models"] = [value] if isinstance(value, str) else value
    for key in COMMA_LIST_OPTIONS:  # options given on the command line as `1,2,4`
        if key in options and isinstance(options[key], list):
            options[key] = ",".join(str(v) for v in options[key])
    return Config(path, options, models, raw)
