"""A multiplexed worker's models (workers/multiplexed.py): its catalog from the command
line, and the shelf that loads and unloads them as batches name them."""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

from batcher.errors import ModelLoadError, SettingsError
from batcher.wire import protocol
from workers.models import ModelSpec, SimLM, load_model, release_model
from workers.multiplexed import MultiplexSpec, Shelf, batch_model, not_served, version_of


def spec_text(budget_mb: Any = 200, **models: Any) -> str:
    return json.dumps({"budget_mb": budget_mb, "models": models})


def test_a_catalog_on_the_command_line_names_what_each_model_loads() -> None:
    spec = MultiplexSpec.parse(
        spec_text(a={"target": "echo", "memory_mb": 100}, b={"target": "sim", "memory_mb": 50})
    )
    assert spec.catalog.sizes_mb == {"a": 100, "b": 50} and spec.catalog.budget_mb == 200
    assert spec.targets == {"a": ModelSpec("a", "echo"), "b": ModelSpec("b", "sim")}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "--multiplex must be JSON"),
        ("[]", "--multiplex must be a JSON object of budget_mb and models"),
        (spec_text(), "--multiplex models must be a non-empty object"),
        (spec_text(a={"target": "echo"}), "--multiplex model 'a' must be an object of target and memory_mb"),
        (spec_text(a={"target": 1, "memory_mb": 1}), "--multiplex model 'a': target must be a string"),
        (spec_text(a={"target": "nope", "memory_mb": 1}), "unknown model 'nope'"),
        (spec_text(50, a={"target": "echo", "memory_mb": 100}), "model 'a' needs 100 MB"),
        (spec_text("x", a={"target": "echo", "memory_mb": 1}), "multiplex budget_mb must be an int"),
    ],
)
def test_a_bad_catalog_is_refused_saying_why(text: str, message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        MultiplexSpec.parse(text)


def test_the_shelf_loads_on_first_use_unloads_the_least_recent_and_retries_a_failed_load() -> None:
    loaded: list[str] = []
    broken = {"c"}

    def load(spec: ModelSpec) -> Any:
        loaded.append(spec.name)
        if spec.name in broken:
            raise OSError("disk gone")
        return lambda inputs: [f"{spec.name}:{x}" for x in inputs]

    entry = {"target": "echo", "memory_mb": 100}
    shelf = Shelf(MultiplexSpec.parse(spec_text(200, a=entry, b=entry, c=entry)), load)
    model, cost = shelf.model_for("a")
    assert model([1]) == ["a:1"] and cost is not None and cost[1:] == ([], ["a"])
    assert shelf.model_for("a")[1] is None  # held: no load
    assert shelf.model_for("b")[1] is not None
    model, cost = shelf.model_for("c")  # unloads a, then fails
    assert cost is not None and cost[1:] == (["a"], ["b"])
    with pytest.raises(ModelLoadError, match="model 'c' could not be loaded: OSError: disk gone"):
        model([1])
    broken.clear()
    model, cost = shelf.model_for("c")  # tried again
    assert model([2]) == ["c:2"] and cost is not None and cost[2] == ["b", "c"]
    assert loaded == ["a", "b", "c", "c"] and (shelf.loads, shelf.unloads) == (3, 1)


def test_a_step_level_model_cannot_be_multiplexed() -> None:
    entry = {"target": "simlm", "memory_mb": 1}
    shelf = Shelf(MultiplexSpec.parse(spec_text(10, lm=entry)), lambda spec: SimLM())
    model, _ = shelf.model_for("lm")
    with pytest.raises(ModelLoadError, match="a step-level model cannot be multiplexed"):
        model([1])


def test_a_batch_names_its_model_in_the_header_5th_element() -> None:
    assert batch_model(protocol.batch_frames(1, [0.0], [b"x"], None, "a/2")[2]) == "a/2"
    assert batch_model(protocol.batch_frames(1, [0.0], [b"x"], "00-tp")[2]) is None
    assert batch_model(b"\xc1") is None
    assert (version_of("a/2"), version_of("plain")) == ("2", None)


def test_a_batch_naming_none_of_the_models_says_so_in_a_bounded_message() -> None:
    """The name is the broker's: one of 8 MB must not make an 8 MB log line."""
    assert not_served(None) == "a multiplexed worker's BATCH must name one of its models, got None"
    huge = batch_model(protocol.batch_frames(1, [0.0], [b"x"], None, "z" * 2**23)[2])
    assert huge is not None and len(not_served(huge)) == 300


def test_the_shelf_reads_each_signature_once_at_start_and_holds_nothing_after() -> None:
    sig = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}], "outputs": []}

    class Declared:
        signature = sig

        def __call__(self, inputs: list[Any]) -> list[Any]:
            return inputs

    def load(spec: ModelSpec) -> Any:
        if spec.name == "broken":
            raise OSError("gone")
        return Declared() if spec.name == "typed" else (lambda inputs: inputs)

    entry = {"target": "echo", "memory_mb": 1}
    shelf = Shelf(MultiplexSpec.parse(spec_text(1, typed=entry, plain=entry, broken=entry)), load)
    signatures = shelf.signatures()
    assert list(signatures) == ["typed"] and signatures["typed"]["inputs"] == sig["inputs"]
    assert len(shelf.resident) == 0 and shelf.loads == 0  # the first batch still loads


PY_MODEL = """
class Weights:
    pass


WEIGHTS = Weights()


def model(inputs):
    return [{name!r} for _ in inputs]
"""


def test_an_unloaded_python_model_file_is_freed_and_so_is_each_one_read_for_its_signature(
    tmp_path: Path,
) -> None:
    """Its module leaves sys.modules: what it holds (its weights) goes back, whatever the
    budget; a budget of one model here."""
    entries = {}
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text(PY_MODEL.format(name=name))
        entries[name] = {"target": f"pyfile:{tmp_path / name}.py:model", "memory_mb": 10}
    catalog = MultiplexSpec.parse(json.dumps({"budget_mb": 10, "models": entries}))
    shelf = Shelf(catalog, lambda spec: load_model(spec, None), release_model)
    shelf.signatures()
    assert not [m for m in sys.modules if m.startswith("batcher_model_") and str(tmp_path.name) in m]
    model, _ = shelf.model_for("a")
    assert model([1]) == ["a"]
    weights = weakref.ref(model.__globals__["WEIGHTS"])  # type: ignore[attr-defined]
    del model
    shelf.model_for("b")  # unloads a
    gc.collect()
    assert weights() is None
    assert shelf.model_for("a")[0]([2]) == ["a"]  # and it loads again from its file


def test_a_model_whose_import_calls_sys_exit_fails_its_batches_not_the_worker() -> None:
    """SystemExit is no Exception: caught all the same, at start (its signature) and at
    its batches, so one such model does not stop the worker and every model with it."""

    def load(spec: ModelSpec) -> Any:
        if spec.name == "bad":
            raise SystemExit(1)
        return lambda inputs: inputs

    entry = {"target": "echo", "memory_mb": 1}
    shelf = Shelf(MultiplexSpec.parse(spec_text(2, bad=entry, good=entry)), load)
    assert shelf.signatures() == {}
    model, cost = shelf.model_for("bad")
    assert cost is not None and cost[2] == []
    with pytest.raises(ModelLoadError, match="model 'bad' could not be loaded: SystemExit: 1"):
        model([1])
    assert shelf.model_for("good")[0]([3]) == [3]
