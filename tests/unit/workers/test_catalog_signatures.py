"""A multiplexed worker's catalog read in a child process (workers/catalog_signatures.py):
a model whose load ends its process is named, the rest are read, the worker survives."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from workers.catalog_signatures import read_catalog
from workers.models import ModelSpec, load_model
from workers.multiplexed import MultiplexSpec, Shelf

pytestmark = pytest.mark.timeout(60)

TYPED = """
class Model:
    signature = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, %d]}], "outputs": []}

    def __call__(self, inputs):
        return inputs


model = Model()
"""


def targets(tmp_path: Path, **sources: str) -> dict[str, ModelSpec]:
    out = {}
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
        out[name] = ModelSpec.parse(f"{name}=pyfile:{tmp_path / name}.py:model")
    return out


def test_a_model_that_ends_its_reader_is_named_and_the_rest_are_read(tmp_path: Path) -> None:
    found = read_catalog(
        targets(
            tmp_path,
            a=TYPED % 2,
            killer="import os\nos._exit(7)\n",
            raising="raise RuntimeError('no weights')\n",
            exiting="import sys\nsys.exit(2)\n",
            b=TYPED % 3,
        ),
        functools.partial(load_model, gpu=None),
    )
    assert found.fatal == {"killer": "its load ended the process that loaded it (exit code 7)"}
    assert {k: v["inputs"][0]["shape"] for k, v in found.signatures.items()} == {"a": [-1, 2], "b": [-1, 3]}


def test_a_catalog_of_killers_is_read_to_its_end(tmp_path: Path) -> None:
    found = read_catalog(
        targets(tmp_path, k1="import os\nos._exit(1)\n", k2="import os\nos._exit(2)\n"),
        functools.partial(load_model, gpu=None),
    )
    assert sorted(found.fatal) == ["k1", "k2"] and found.signatures == {}


def test_the_shelf_never_loads_a_model_that_ended_its_reader() -> None:
    loaded: list[str] = []

    def load(spec: ModelSpec) -> object:
        loaded.append(spec.name)
        return lambda inputs: inputs

    entry = {"target": "echo", "memory_mb": 1}
    shelf = Shelf(MultiplexSpec.parse(json.dumps({"budget_mb": 2, "models": {"a": entry, "k": entry}})), load)
    shelf.fatal = {"k": "its load ended the process that loaded it (exit code 7)"}
    model, load_info = shelf.model_for("k")
    with pytest.raises(Exception, match=r"ended the process that loaded it \(exit code 7\)"):
        model([1])
    assert load_info is not None and load_info[2] == []  # it holds nothing
    assert loaded == [] and shelf.model_for("a")[0]([1]) == [1] and loaded == ["a"]
