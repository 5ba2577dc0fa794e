"""Models a worker can serve: the built-in `sim` and `echo`, or any user callable.

A model is a callable that takes the list of a batch's inputs and returns a list of
outputs of the same length; an output may be an exception instance, which fails that
input alone. A user model is named `package.module:attr` (optionally
`name=package.module:attr` to announce it under a shorter name); when `attr` is a
class it is instantiated once per worker with the worker's GPU id. Its module is
looked for in the current directory first, as `python -m` would.
"""

from __future__ import annotations

import importlib
import inspect
import operator
import os
import site
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

from batcher.errors import SettingsError
from batcher.settings import MAX_MS, Bounds, check, setting, setting_of

ModelFn = Callable[[list[Any]], list[Any]]

BUILTIN_MODELS = ("sim", "echo", "simlm")
#: The `--model` prefix of an ONNX file (workers/onnx_model.py).
ONNX_PREFIX = "onnx:"
#: The `--model` prefix of a Python model file, `pyfile:PATH:ATTR` (a model repository's
#: version directory holds one: batcher/serve/repository.py).
PYFILE_PREFIX = "pyfile:"


@dataclass(frozen=True)
class SimSettings:
    """The simulated GPU's cost: a batch of n takes base_ms + per_item_ms * n; a step of
    `simlm` over n sequences takes step_base_ms + step_per_seq_ms * n."""

    base_ms: float = setting(
        20.0,
        min=0,
        max=MAX_MS,
        noun="a finite number",
        label="sim base_ms",
        help="sim model: fixed cost of one batch.",
    )
    per_item_ms: float = setting(
        2.5,
        min=0,
        max=MAX_MS,
        noun="a finite number",
        label="sim per_item_ms",
        help="sim model: added cost per request in a batch.",
    )
    step_base_ms: float = setting(
        15.0,
        min=0,
        max=MAX_MS,
        noun="a finite number",
        label="sim step_base_ms",
        help="simlm model: fixed cost of one step (one token for every active sequence).",
    )
    step_per_seq_ms: float = setting(
        0.5,
        min=0,
        max=MAX_MS,
        noun="a finite number",
        label="sim step_per_seq_ms",
        help="simlm model: added cost per active sequence in a step.",
    )

    def __post_init__(self) -> None:
        check(self)

    def step_ms(self, n: int) -> float:
        """How long a simlm step over n sequences takes."""
        return self.step_base_ms + self.step_per_seq_ms * n

    def batch_ms(self, n: int) -> float:
        """How long a batch of n takes on the simulated GPU."""
        return self.base_ms + self.per_item_ms * n


class SimModel:
    """A simulated GPU: batching pays because the fixed cost is shared by the batch."""

    def __init__(self, settings: SimSettings | None = None) -> None:
        self.settings = settings or SimSettings()

    def __call__(self, inputs: list[Any]) -> list[Any]:
        n = len(inputs)
        batch_ms = self.settings.batch_ms(n)
        time.sleep(batch_ms / 1000.0)  # sleeping, not spinning: 8 workers share 2 cores
        amortized_ms = batch_ms / n if n else 0.0
        return [{"echo": x, "amortized_ms": amortized_ms, "batch_size": n} for x in inputs]


#: The most tokens one simlm request may ask for.
SIMLM_MAX_TOKENS = 1_000_000


class SimLM:
    """A simulated generative model, step-level (workers/steps.py): a request
    `{"tokens": k}` (or just k) yields k chunks, the token indices 0..k-1, one per step; a
    step over n sequences sleeps step_base_ms + step_per_seq_ms * n. With `"prompt": p`
    (p > 0), admitting it costs a prefill step too: one step's time over the admitted
    sequences that carry a prompt."""

    step_level = True

    def __init__(self, settings: SimSettings | None = None) -> None:
        self.settings = settings or SimSettings()
        self.remaining: dict[int, list[int]] = {}  # key -> [tokens made, tokens wanted]

    def start(self, items: list[tuple[int, Any]]) -> list[BaseException | None]:
        from workers.steps import BadInput

        verdicts: list[BaseException | None] = []
        prefill = 0
        for key, given in items:
            try:
                tokens, prompt = _simlm_input(given)
            except ValueError as exc:
                verdicts.append(BadInput(str(exc)))
                continue
            self.remaining[key] = [0, tokens]
            prefill += prompt > 0
            verdicts.append(None)
        if prefill:
            time.sleep(self.settings.step_ms(prefill) / 1000.0)
        return verdicts

    def step(self) -> list[tuple[int, Any, bool]]:
        time.sleep(self.settings.step_ms(len(self.remaining)) / 1000.0)
        out = []
        for key, progress in list(self.remaining.items()):
            made, wanted = progress
            progress[0] = made + 1
            done = made + 1 >= wanted
            if done:
                del self.remaining[key]
            out.append((key, made, done))
        return out

    def stop(self, key: int) -> None:
        self.remaining.pop(key, None)


def _simlm_input(given: Any) -> tuple[int, int]:
    """(tokens, prompt length) of a simlm input; ValueError with the reason otherwise."""
    if isinstance(given, dict):
        tokens, prompt = given.get("tokens"), given.get("prompt", 0)
        unknown = set(given) - {"tokens", "prompt"}
        if unknown:
            raise ValueError(f"simlm input takes tokens and prompt, got {sorted(map(str, unknown))}")
    else:
        tokens, prompt = given, 0
    return _count_of("tokens", tokens, 1), _count_of("prompt", prompt, 0)


def _count_of(name: str, value: Any, least: int) -> int:
    """An int in [least, SIMLM_MAX_TOKENS] from a plain int, a numpy integer or a tensor of
    one integer (as the HTTP/gRPC gateway sends a row: docs/gateway.md); ValueError else."""
    size = getattr(value, "size", None)
    if size == 1 and getattr(value, "dtype", None) is not None and value.dtype.kind in "iu":
        value = value.reshape(()).item()  # a tensor of one integer
    try:
        count = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        count = None
    if count is None or not least <= count <= SIMLM_MAX_TOKENS:
        shown = value.tolist() if hasattr(value, "tolist") else value
        bounds = f"[{least}, {SIMLM_MAX_TOKENS}]"
        raise SettingsError(f"simlm {name} must be an integer in {bounds}, got {shown!r}"[:200])
    return count


def echo(inputs: list[Any]) -> list[Any]:
    """No work at all: what is left of a round trip is the broker's own cost."""
    return list(inputs)


@dataclass(frozen=True)
class ModelSpec:
    """A parsed `--model` value: the name announced to the broker and what to load."""

    name: str
    target: str

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """`sim`, `echo`, `pkg.mod:attr`, `onnx:PATH` (named after the file), or
        `name=<any of those>`."""
        if text.strip().startswith(ONNX_PREFIX):  # a path may hold '=': no NAME= to split off
            path = text.strip()[len(ONNX_PREFIX) :].strip()
            name, sep, target = os.path.splitext(os.path.basename(path))[0], "=", ONNX_PREFIX + path
        else:
            name, sep, target = text.partition("=")
        if not sep:
            name, target = text, text
        name, target = name.strip(), target.strip()
        if target.startswith(ONNX_PREFIX):
            path = target[len(ONNX_PREFIX) :].strip()
            if not name or not path:
                raise SettingsError(f"an ONNX model is onnx:PATH or NAME=onnx:PATH, got {text!r}")
            return cls(name, ONNX_PREFIX + path)
        if not name or not target:
            raise SettingsError(f"model must be NAME, NAME=SPEC or pkg.module:attr, got {text!r}")
        module, _, attr = target.partition(":")
        if target not in BUILTIN_MODELS and not (module.strip() and attr.strip()):
            raise SettingsError(
                f"unknown model {target!r}: use one of {', '.join(BUILTIN_MODELS)} "
                "or a user model as package.module:attr"
            )
        return cls(name, target)


#: The most elements a stacked batch may hold by default (--max-padded-elements): 2**26,
#: 256 MiB of FP32, twice what a full batch of 8 requests of 16 MiB of FP32 (the default
#: --max-message-bytes) holds.
MAX_PADDED_ELEMENTS = 2**26


#: The largest --max-padded-elements: far above any memory, within an int64.
MAX_PADDED_BUDGET = 2**62
#: The bounds of a budget of padded elements (WorkerSettings', PoolSettings', a Stacked's).
PADDED_ELEMENTS = Bounds(
    int,
    1,
    MAX_PADDED_BUDGET,
    label="max_padded_elements",
    noun="an int",
    help="The most elements a stacked model's batch may hold once padded (n x the longest "
    "shape, summed over its inputs): requests that would pad past it are run in separate "
    "model calls, and one over it alone is answered bad_request.",
)


def max_padded_elements_setting() -> Any:
    """The max_padded_elements field of a settings dataclass: PADDED_ELEMENTS' bounds."""
    return setting_of(MAX_PADDED_ELEMENTS, PADDED_ELEMENTS)


def check_max_padded_elements(value: object) -> int:
    """`value` if it is a budget of padded elements (an int >= 1), else ValueError."""
    problem = PADDED_ELEMENTS.problem(value)
    if problem is not None:
        raise SettingsError(problem)
    assert isinstance(value, int)
    return value


def load_model(
    spec: ModelSpec,
    gpu: int | None,
    sim: SimSettings | None = None,
    threads: int | None = None,
    max_padded_elements: int = MAX_PADDED_ELEMENTS,
) -> ModelFn:
    """Import and build the model named by `spec`, once, in the worker process; an ONNX
    model's session uses `threads` intra-op threads (None: all cores); a stacked model's
    batches hold at most `max_padded_elements` elements (workers/stacking.py)."""
    if spec.target == "sim":
        return SimModel(sim)
    if spec.target == "echo":
        return echo
    if spec.target == "simlm":
        return SimLM(sim)  # type: ignore[return-value]  # step-level: workers/steps.py
    if spec.target.startswith(ONNX_PREFIX):
        from workers.onnx_model import load_onnx

        return load_onnx(spec.target[len(ONNX_PREFIX) :], gpu, threads)
    if spec.target.startswith(PYFILE_PREFIX):
        path, _, attr = spec.target[len(PYFILE_PREFIX) :].rpartition(":")
        module = import_model_file(path)
    else:
        module_name, _, attr = spec.target.partition(":")
        module = import_user_module(module_name)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        obj = obj(gpu)
    if getattr(obj, "step_level", False) is True:  # a generative model: workers/steps.py
        return cast(ModelFn, obj)
    if not callable(obj):
        raise TypeError(f"{spec.target} is not callable")
    if getattr(obj, "stack", None) not in (None, False):  # it wants batched arrays (numpy)
        from workers import stacking

        declared = stacking.stacking_of(obj)
        assert declared is not None
        return stacking.wrap(obj, declared, max_padded_elements)
    return obj


def import_model_file(path: str) -> ModuleType:
    """Import the Python model module at `path` under a name of its own (two versions'
    model.py files never share one)."""
    import importlib.util

    name = model_file_module(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"cannot import a model module from {path}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def model_file_module(path: str) -> str:
    """The name in sys.modules of the Python model file at `path` (import_model_file)."""
    return "batcher_model_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(path))


def release_model(spec: ModelSpec) -> None:
    """Forget what loading `spec` keeps beyond the model itself: a Python model file's
    module in sys.modules. A multiplexed worker calls it when it unloads the model, so
    that dropping the model frees its module and all it holds (its weights); without it,
    every model ever loaded stays in memory, whatever the budget."""
    if spec.target.startswith(PYFILE_PREFIX):
        path = spec.target[len(PYFILE_PREFIX) :].rpartition(":")[0]
        sys.modules.pop(model_file_module(path), None)


def import_user_module(name: str) -> ModuleType:
    """Import a user model's module with the current directory first on the import path,
    as `python -m` has it: `serve`'s workers (`python -m batcher worker`) find a
    mymodels.py next to them, and the `batcher` console script, whose path starts with
    its own bin directory, must find it too. A module that is not found says where it
    was looked for and how to fix that."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or not (name == missing or name.startswith(missing + ".")):
            raise  # the module was found: something it imports was not, and says so itself
        top = missing.split(".")[0]
        others = [d for d in _searched_dirs() if d != cwd]
        where = f"the current directory {cwd}" + (f", {', '.join(others)}" if others else "")
        raise ModuleNotFoundError(
            f"no module named {missing!r} in {where} or the installed packages: run the worker "
            f"from the directory that holds {top}.py (or the {top}/ package), or add that "
            "directory to PYTHONPATH",
            name=missing,
        ) from None


def _searched_dirs() -> list[str]:
    """sys.path without the standard library and site-packages: the entries a user's
    module can be expected in (the current directory, PYTHONPATH, a script's directory)."""
    installed = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    installed.update(site.getsitepackages())
    installed.add(site.getusersitepackages())
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or ".")
        is_installed = any(path == d or path.startswith(d + os.sep) for d in installed if d)
        if not is_installed and not path.endswith(".zip") and path not in out:
            out.append(path)
    return out
