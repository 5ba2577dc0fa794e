"""Model versions side by side: which versions a policy serves, the internal model key of
each (`NAME/2`, its own queue and workers), which key a request goes to, and canary
splits between versions (docs/models.md).

Pure: no I/O and no clock. A request naming a version goes to that version if it is
served; one naming none goes by the model's traffic split if it has one, else to the
newest served version. The split is a smooth weighted round robin (the rule nginx uses):
deterministic, and over any run of `sum(weights)` picks each version gets exactly its
weight, spread out rather than in runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from batcher.errors import SettingsError
from batcher.wire.codes import ErrorCode

#: The separator of a model's internal key: version 2 of `digits` is `digits/2`.
KEY_SEPARATOR = "/"
#: The most weight one version may have in a split (weights are relative).
MAX_WEIGHT = 1_000_000


def version_key(name: str, version: int) -> str:
    """The internal model key of one version: its queue, workers and stats go by it."""
    return f"{name}{KEY_SEPARATOR}{version}"


def split_key(key: str) -> tuple[str, int] | None:
    """(name, version) of an internal key `NAME/V`, or None for a plain model name."""
    name, sep, version = key.rpartition(KEY_SEPARATOR)
    if not sep or not name or not version.isdigit():
        return None
    return name, int(version)


def parse_version(value: object) -> int:
    """A version as the protocol or a path gives it (an int >= 1, or its digits);
    SettingsError otherwise."""
    if isinstance(value, bool):
        raise SettingsError(f"version must be an integer >= 1, got {value!r}")
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if not isinstance(value, int) or value < 1:
        raise SettingsError(f"version must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions are served: the newest `count` ("latest:N"), all of
    them ("all"), or the ones named ("specific:1,3")."""

    kind: str = "latest"
    count: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("latest", "all", "specific"):
            raise SettingsError(f"version_policy must be latest:N, all or specific:V,..., got {self.kind!r}")
        if self.kind == "latest" and self.count < 1:
            raise SettingsError(f"version_policy latest:N needs N >= 1, got {self.count}")
        if self.kind == "specific" and not self.versions:
            raise SettingsError("version_policy specific: names no version")

    @classmethod
    def parse(cls, text: object) -> VersionPolicy:
        """`latest:N`, `all` or `specific:1,3`; SettingsError with the reason otherwise."""
        if not isinstance(text, str):
            raise SettingsError(f"version_policy must be a string, got {text!r}")
        kind, _, rest = text.strip().partition(":")
        if kind == "all" and not rest:
            return cls("all")
        try:
            if kind == "latest":
                return cls("latest", parse_version(rest or "1"))
            if kind == "specific":
                return cls("specific", versions=tuple(sorted({parse_version(v) for v in rest.split(",")})))
        except SettingsError as exc:
            raise SettingsError(f"version_policy {text!r}: {exc}") from None
        raise SettingsError(f"version_policy must be latest:N, all or specific:V,..., got {text!r}")

    def select(self, available: Iterable[int]) -> tuple[int, ...]:
        """The versions served out of those `available`, oldest first."""
        have = sorted(set(available))
        if self.kind == "all":
            return tuple(have)
        if self.kind == "latest":
            return tuple(have[-self.count :])
        return tuple(v for v in have if v in self.versions)


def parse_traffic(weights: object) -> dict[int, int]:
    """A split `{"2": 90, "3": 10}` (versions as ints or digits, weights ints >= 0, at
    least one above 0); SettingsError naming what is wrong otherwise."""
    if not isinstance(weights, Mapping) or not weights:
        raise SettingsError(
            f"traffic must map versions to weights, like {{'2': 90, '3': 10}}, got {weights!r}"
        )
    out: dict[int, int] = {}
    for version, weight in weights.items():
        v = parse_version(version)
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
            raise SettingsError(
                f"traffic weight of version {v} must be an integer in [0, {MAX_WEIGHT}], got {weight!r}"
            )
        out[v] = weight
    if not any(out.values()):
        raise SettingsError("traffic weights must not all be 0")
    return out


class WeightedChooser:
    """Smooth weighted round robin over versions: each pick adds every version's weight
    to its credit and takes the one with the most credit, which then pays the total."""

    def __init__(self, weights: Mapping[int, int]) -> None:
        self.weights = {v: w for v, w in sorted(weights.items()) if w > 0}
        if not self.weights:
            raise SettingsError("a split needs a version with a weight above 0")
        self._total = sum(self.weights.values())
        self._credit = dict.fromkeys(self.weights, 0)

    def pick(self) -> int:
        """The next version."""
        credit = self._credit
        for v, w in self.weights.items():
            credit[v] += w
        best = max(credit, key=lambda v: (credit[v], v))  # ties: the newer version
        credit[best] -= self._total
        return best


@dataclass
class ModelVersions:
    """One repository model's served versions, its split, and the requests routed to each."""

    served: tuple[int, ...] = ()
    traffic: dict[int, int] | None = None
    routed: dict[int, int] = field(default_factory=dict)
    chooser: WeightedChooser | None = None

    def rebuild(self) -> None:
        """The chooser over the split's versions that are served (none: the newest)."""
        live = {v: w for v, w in (self.traffic or {}).items() if v in self.served and w > 0}
        self.chooser = WeightedChooser(live) if live else None


class VersionTable:
    """The broker's versioned models: which key a request goes to (`resolve`), what is
    served, and each version's share of the requests that named none."""

    def __init__(self) -> None:
        self.models: dict[str, ModelVersions] = {}

    def __bool__(self) -> bool:
        return bool(self.models)

    def set_served(self, name: str, versions: Iterable[int]) -> None:
        """Serve these versions of `name` from now on (none: requests for it are refused)."""
        m = self.models.setdefault(name, ModelVersions())
        m.served = tuple(sorted(set(versions)))
        m.rebuild()

    def set_traffic(self, name: str, weights: Mapping[int, int] | None) -> None:
        """Split the requests naming no version of `name` by `weights` from the next one
        on (None: all to the newest); SettingsError when no weighted version is served."""
        m = self.models.get(name)
        if m is None:
            raise SettingsError(f"no versioned model {name!r}")
        if weights is not None:
            unserved = sorted(v for v in weights if v not in m.served)
            if unserved:
                served = ", ".join(map(str, m.served)) or "none"
                raise SettingsError(f"model {name!r} does not serve version {unserved[0]} (served: {served})")
        m.traffic = dict(weights) if weights is not None else None
        m.routed = {}
        m.rebuild()

    def remove(self, name: str) -> None:
        """`name` is no longer served at all."""
        self.models.pop(name, None)

    def resolve(self, model: str, version: object, count: bool = True) -> str | tuple[ErrorCode, str]:
        """The key a request for `model` (naming `version`, or None) goes to, or the
        refusal (code, message). A model that is not versioned goes as it is named (its
        one version is 1). `count`: a request naming no version counts in its share and
        moves the split on (not so for a metadata lookup)."""
        m = self.models.get(model)
        if m is None:
            parts = split_key(model)
            if parts is not None and parts[0] in self.models:  # the key itself: NAME/2
                model, version = parts
                m = self.models[model]
            elif version is None or version in (1, "1"):  # an unversioned model's one version
                return model
            else:
                return (
                    ErrorCode.UNKNOWN_MODEL,
                    f"model {model!r} has one version, 1 (it is not in a repository)",
                )
        if not m.served:
            return ErrorCode.UNKNOWN_MODEL, f"model {model!r} serves no version now"
        if version is None:
            if not count:
                return version_key(model, m.served[-1])
            v = m.chooser.pick() if m.chooser is not None else m.served[-1]
            m.routed[v] = m.routed.get(v, 0) + 1
            return version_key(model, v)
        try:
            v = parse_version(version)
        except SettingsError as exc:
            return ErrorCode.BAD_REQUEST, str(exc)
        if v not in m.served:
            served = ", ".join(map(str, m.served))
            return ErrorCode.UNKNOWN_MODEL, f"model {model!r} does not serve version {v} (served: {served})"
        return version_key(model, v)

    def wire(self) -> dict[str, dict[str, object]]:
        """What `stats` shows under `versions`: each model's served versions, its split,
        and the requests naming no version routed to each, with their shares."""
        out: dict[str, dict[str, object]] = {}
        for name, m in self.models.items():
            total = sum(m.routed.values())
            out[name] = {
                "served": list(m.served),
                "newest": m.served[-1] if m.served else None,
                "traffic": {str(v): w for v, w in m.traffic.items()} if m.traffic is not None else None,
                "routed": {str(v): n for v, n in sorted(m.routed.items())},
                "share": {str(v): n / total for v, n in sorted(m.routed.items())} if total else {},
            }
        return out
