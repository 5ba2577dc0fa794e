"""Settings declared once: a settings dataclass's numeric field carries its bounds, its
default and its help as field metadata (`setting`), its `__post_init__` calls `check`,
and the CLI builds the option's click type, default and help from the same field
(`batcher.cli.options.setting_option`), so a bound is written in one place.

The upper bounds (the MAX_* below) are finite, far above any useful setting, and small
enough for where the value ends up: poll timeouts in whole milliseconds, libzmq's int64
options, msgpack's 32-bit lengths, one process per worker. A leaf: it imports only
batcher.errors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from batcher.errors import SettingsError

MAX_MS = 60_000.0  # simulated batch and step costs (and the heartbeat option): one minute
MAX_TIMEOUT_MS = 86_400_000.0  # request deadlines, batch windows, priority aging: one day
MAX_BATCH_COST = 1e15  # a batch's summed request costs (tokens, pixels, bytes)
MAX_BATCH_SIZE = 4096
#: The most intra-op threads one worker's session may get (--threads-per-worker).
MAX_THREADS = 1024
MAX_QUEUE = 10_000_000  # requests per model
MAX_WORKERS = 256  # worker processes per model
MAX_WORKERS_PER_GPU = 64
MAX_GPU = 65_535  # serve numbers its workers' GPUs across models: up to MAX_WORKERS each
MAX_PREFETCH = 64
MAX_RETRIES = 100
MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: bigger inputs belong in shared storage, not a message
MAX_PORT = 65_535
MAX_PID = 2**31 - 1
#: `batcher bench`'s load: seconds of it, arrivals per second, requests in flight or in
#: all, load generator processes.
MAX_BENCH_S = 86_400.0
MAX_RATE = 1_000_000.0
MAX_CONCURRENCY = 100_000
MAX_REQUESTS = 1_000_000_000
MAX_PROCESSES = 256

#: The metadata key of a field made by `setting`.
KEY = "batcher.setting"


@dataclass(frozen=True)
class Bounds:
    """What a numeric setting accepts: an int or a number (never a bool), within
    [min, max] (min excluded with `min_exclusive`), None too if `optional`; and what a
    refusal says. `label` names the setting in messages (the field's name unless told);
    `noun` words the lower bound's message ("a finite number": "x must be a finite number
    >= 0, got -1"); `int_message` says "x must be an int" of a value that is none;
    `message`, when given, is the one message of every refusal (formatted with label, min,
    max and value); `not_finite`, when given, that of a NaN or an infinity."""

    kind: type
    min: float | None
    max: float | None
    min_exclusive: bool = False
    optional: bool = False
    label: str = ""
    noun: str = ""
    int_message: bool = False
    message: str | None = None
    help: str = ""
    not_finite: str | None = None

    def _say(self, template: str, value: Any) -> str:
        return template.format(label=self.label, min=self.min, max=self.max, value=value)

    def below(self, value: Any) -> str:
        """The message of a value under the lower bound (or of no number at all)."""
        if self.message is not None:
            return self._say(self.message, value)
        words = f"{self.noun} " if self.noun else ""
        sign = ">" if self.min_exclusive else ">="
        return f"{self.label} must be {words}{sign} {self.min}, got {value!r}"

    def above(self, value: Any) -> str:
        """The message of a value over the upper bound."""
        if self.message is not None:
            return self._say(self.message, value)
        return f"{self.label} must be <= {self.max}, got {value!r}"

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused, or None if it is accepted."""
        if value is None and self.optional:
            return None
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if self.int_message and self.message is None:
                    return f"{self.label} must be an int, got {value!r}"
                return self.below(value)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            return self.below(value)
        elif not math.isfinite(value):
            return self.below(value) if self.not_finite is None else self._say(self.not_finite, value)
        if self.min is not None and (value <= self.min if self.min_exclusive else value < self.min):
            return self.below(value)
        if self.max is not None and value > self.max:
            return self.above(value)
        return None


def setting(
    default: Any,
    *,
    kind: type = float,
    min: float | None = None,
    max: float | None = None,
    min_exclusive: bool = False,
    optional: bool = False,
    label: str = "",
    noun: str = "",
    int_message: bool = False,
    message: str | None = None,
    help: str = "",
    not_finite: str | None = None,
) -> Any:
    """A dataclass field with default `default` whose value `check` holds to the bounds
    (Bounds says what each argument means); `help` is the CLI option's help text."""
    return setting_of(
        default,
        Bounds(kind, min, max, min_exclusive, optional, label, noun, int_message, message, help, not_finite),
    )


def port(help: str) -> Any:
    """A setting of a TCP port to listen on, 0 for none: "x must be in 0..65535"."""
    return setting(
        0, kind=int, min=0, max=MAX_PORT, message="{label} must be in {min}..{max}, got {value!r}", help=help
    )


def setting_of(default: Any, bounds: Bounds) -> Any:
    """A dataclass field as `setting` makes, of bounds declared once for several fields."""
    return dataclasses.field(default=default, metadata={KEY: bounds})


def _labelled(f: dataclasses.Field[Any]) -> Bounds:
    b: Bounds = f.metadata[KEY]
    return b if b.label else dataclasses.replace(b, label=f.name)


def bounds(cls: Any, name: str) -> Bounds:
    """The Bounds of field `name` of settings dataclass `cls`, its label filled in."""
    for f in dataclasses.fields(cls):
        if f.name == name and KEY in f.metadata:
            return _labelled(f)
    raise LookupError(f"{cls.__name__}.{name} is not a setting")


def default(cls: Any, name: str) -> Any:
    """The default of field `name` of dataclass `cls` (without building one)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    raise LookupError(f"{cls.__name__} has no field {name}")


def check(settings: Any) -> None:
    """Refuse (SettingsError) the first field of `settings` made by `setting` whose value
    is out of its bounds: what every settings dataclass's __post_init__ calls."""
    for f in dataclasses.fields(settings):
        if KEY in f.metadata:
            problem = _labelled(f).problem(getattr(settings, f.name))
            if problem is not None:
                raise SettingsError(problem)
