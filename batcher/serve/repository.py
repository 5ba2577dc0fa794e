"""A model repository on disk, laid out as Triton lays it out (docs/models.md):

    DIR/NAME/config.toml          optional: batching keys, kind, version_policy, traffic, workers
    DIR/NAME/<version>/model.onnx an ONNX model (kind "onnx", the default when it is there)
    DIR/NAME/<version>/model.py   a Python model module (kind "python": its `callable`)

`scan(DIR)` reads it into RepoModel values and the reasons of the models it cannot use;
a broken model is reported and skipped, never stopping the others. Only reading here:
batcher.serve.repository_control acts on what changed.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from batcher.core.limits import BatchSettings
from batcher.core.multiplex import MAX_MB
from batcher.core.versions import VersionPolicy, parse_traffic, version_key
from batcher.errors import SettingsError

#: The file of a model's settings, beside its version directories.
CONFIG_FILE = "config.toml"
#: The file a version directory holds, by the model's kind.
MODEL_FILES = {"onnx": "model.onnx", "python": "model.py"}
BATCH_KEYS = tuple(f.name for f in dataclasses.fields(BatchSettings))
#: The keys a model's config.toml may hold.
CONFIG_KEYS = (
    *BATCH_KEYS, "kind", "callable", "version_policy", "traffic", "workers", "multiplexed", "memory_mb"
)  # fmt: skip
#: A multiplexed model's memory_mb when its config gives none: its file's size, at least this.
MIN_MEMORY_MB = 1


@dataclass(frozen=True)
class RepoModel:
    """One model of the repository: its versions (version -> the worker's model target),
    its settings, and what is wrong with any of its versions."""

    name: str
    versions: dict[int, str]
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    traffic: dict[int, int] | None = None
    batch: dict[str, Any] = field(default_factory=dict)  # BatchSettings keys over serve's defaults
    workers: int | None = None
    problems: dict[int, str] = field(default_factory=dict)  # version -> why it cannot be served
    #: version -> the model file's modification time (a changed file is tried again).
    stamps: dict[int, float] = field(default_factory=dict)
    config_stamp: float | None = None
    #: Served by the pool of multiplexed workers (batcher.core.multiplex), not workers of its own.
    multiplexed: bool = False
    #: version -> what one version holds in memory, in MB (a multiplexed model's budget share).
    memory_mb: dict[int, int] = field(default_factory=dict)

    def target(self, version: int) -> str:
        """What a worker loads for this version (`spec` without the name)."""
        return self.versions[version]

    def spec(self, version: int) -> str:
        """The `--model` value of this version's workers: `NAME/V=TARGET`."""
        return f"{version_key(self.name, version)}={self.versions[version]}"

    def batch_settings(self, default: BatchSettings) -> BatchSettings:
        """`default` with this model's batching keys on top."""
        values = dict(self.batch)
        for key in ("batch_sizes", "length_buckets"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        if isinstance(values.get("max_wait_ms"), int):
            values["max_wait_ms"] = float(values["max_wait_ms"])
        return dataclasses.replace(default, **values)


def scan(root: str, default: BatchSettings | None = None) -> tuple[dict[str, RepoModel], dict[str, str]]:
    """The models of the repository at `root` and, by name, why each broken one is
    skipped (an unreadable or invalid config.toml, no version holding a model)."""
    models: dict[str, RepoModel] = {}
    broken: dict[str, str] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        return {}, {"": f"cannot read the model repository {root}: {exc.strerror}"}
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        try:
            models[name] = read_model(path, name, default or BatchSettings())
        except (SettingsError, OSError, ValueError, TypeError) as exc:
            broken[name] = str(exc)
    return models, broken


def read_model(path: str, name: str, default: BatchSettings) -> RepoModel:
    """One model directory; SettingsError saying what is wrong when it cannot be served."""
    if "/" in name or "=" in name or not name.strip():
        raise SettingsError(f"model directory name {name!r} cannot be a model name")
    config, config_stamp = _read_config(os.path.join(path, CONFIG_FILE))
    kind = config.get("kind")
    if kind is not None and kind not in MODEL_FILES:
        raise SettingsError(f"{CONFIG_FILE}: kind must be one of {', '.join(MODEL_FILES)}, got {kind!r}")
    attr = config.get("callable", "model")
    if not isinstance(attr, str) or not attr.isidentifier():
        raise SettingsError(f"{CONFIG_FILE}: callable must be a Python name, got {attr!r}")
    versions: dict[int, str] = {}
    problems: dict[int, str] = {}
    stamps: dict[int, float] = {}
    for entry in os.listdir(path):
        vdir = os.path.join(path, entry)
        if not entry.isdigit() or int(entry) < 1 or not os.path.isdir(vdir):
            continue  # as Triton: only directories named by a version number count
        v = int(entry)
        found = _model_file(vdir, kind)
        if found is None:
            wanted = MODEL_FILES[kind] if kind else " or ".join(MODEL_FILES.values())
            problems[v] = f"version {v} holds no {wanted}"
            continue
        file_kind, file_path = found
        stamps[v] = os.stat(file_path).st_mtime
        versions[v] = f"onnx:{file_path}" if file_kind == "onnx" else f"pyfile:{file_path}:{attr}"
    if not versions:
        raise SettingsError(
            f"no version directory holds a model ({'; '.join(problems.values()) or 'none found'})"
        )
    policy = VersionPolicy.parse(config.get("version_policy", "latest:1"))
    traffic = parse_traffic(config["traffic"]) if "traffic" in config else None
    workers = config.get("workers")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise SettingsError(f"{CONFIG_FILE}: workers must be an int >= 0, got {workers!r}")
    batch = {k: v for k, v in config.items() if k in BATCH_KEYS}
    multiplexed = config.get("multiplexed", False)
    if type(multiplexed) is not bool:
        raise SettingsError(f"{CONFIG_FILE}: multiplexed must be true or false, got {multiplexed!r}")
    memory = config.get("memory_mb")
    if memory is not None and (type(memory) is not int or not 1 <= memory <= MAX_MB):
        raise SettingsError(f"{CONFIG_FILE}: memory_mb must be an int in [1, {MAX_MB}], got {memory!r}")
    if multiplexed and workers is not None:
        raise SettingsError(
            f"{CONFIG_FILE}: a multiplexed model has no workers of its own (--multiplex-workers)"
        )
    memory_mb = {v: memory or _file_mb(versions[v]) for v in versions}
    model = RepoModel(
        name,
        versions,
        policy,
        traffic,
        batch,
        workers,
        problems,
        stamps,
        config_stamp,
        multiplexed,
        memory_mb,
    )
    try:
        model.batch_settings(default)
    except (SettingsError, TypeError, ValueError) as exc:
        raise SettingsError(f"{CONFIG_FILE}: {exc}") from None
    return model


def _read_config(path: str) -> tuple[dict[str, Any], float | None]:
    """The config.toml's keys ({} without one) and its modification time."""
    try:
        stamp = os.stat(path).st_mtime
        with open(path, "rb") as f:
            config = tomllib.load(f)
    except FileNotFoundError:
        return {}, None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{CONFIG_FILE} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"{CONFIG_FILE} is not valid TOML: not UTF-8 text") from None
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise SettingsError(f"{CONFIG_FILE} has unknown keys {unknown}; allowed: {', '.join(CONFIG_KEYS)}")
    return config, stamp


def _model_file(vdir: str, kind: str | None) -> tuple[str, str] | None:
    """(kind, path) of the model file a version directory holds, or None."""
    for file_kind, filename in MODEL_FILES.items():
        if kind in (None, file_kind) and os.path.isfile(os.path.join(vdir, filename)):
            return file_kind, os.path.abspath(os.path.join(vdir, filename))
    return None


def _file_mb(target: str) -> int:
    """A model file's size in MB, rounded up (at least MIN_MEMORY_MB): what a version
    without memory_mb is taken to hold."""
    if target.startswith("pyfile:"):
        path = target.removeprefix("pyfile:").rpartition(":")[0]
    else:
        path = target.removeprefix("onnx:")
    try:
        size = os.stat(path).st_size
    except OSError:
        return MIN_MEMORY_MB
    return max(MIN_MEMORY_MB, -(-size // 2**20))
