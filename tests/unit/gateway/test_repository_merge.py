"""The gateway's repository calls over many brokers, without processes
(batcher/gateway/repository.py): the merged index, and which brokers' answers count."""

from __future__ import annotations

from typing import Any

import pytest

from batcher.gateway import oip
from batcher.gateway.names import names_of_meta
from batcher.gateway.repository import _NOT_HERE, _outputs, merge_indexes


def entry(name: str, version: str, state: str, reason: str = "") -> dict[str, Any]:
    return {"name": name, "version": version, "state": state, "reason": reason}


def test_the_merged_index_has_one_entry_per_version_in_its_most_served_state() -> None:
    a = [
        entry("lin", "1", "UNAVAILABLE", "not selected"),
        entry("lin", "2", "READY"),
        entry("a", "1", "READY"),
    ]
    b = [entry("lin", "1", "READY"), entry("lin", "2", "LOADING"), entry("lin", "10", "UNLOADING")]
    merged = merge_indexes([a, b])
    assert [(m["name"], m["version"], m["state"]) for m in merged] == [
        ("a", "1", "READY"),
        ("lin", "1", "READY"),
        ("lin", "2", "READY"),
        ("lin", "10", "UNLOADING"),  # versions in number order
    ]
    assert merge_indexes([[entry("x", "", "UNAVAILABLE", "bad")], []]) == [
        entry("x", "", "UNAVAILABLE", "bad")
    ]


def test_brokers_without_the_model_are_left_out_and_any_other_error_raised() -> None:
    unknown = oip.OipError("unknown_model", "no model 'm' in the repository")
    no_repo = oip.OipError("bad_request", "load needs `batcher serve --model-repository`")
    assert _outputs([{"ok": 1}, unknown, no_repo], _NOT_HERE) == [{"ok": 1}]
    with pytest.raises(oip.OipError) as raised:
        _outputs([no_repo, unknown], _NOT_HERE)  # none holds it: the unknown_model is said
    assert raised.value.code == "unknown_model"
    failed = oip.OipError("worker_failed", "lin/3's workers did not start")
    with pytest.raises(oip.OipError, match="did not start"):
        _outputs([{"ok": 1}, failed], _NOT_HERE)
    with pytest.raises(oip.OipError) as raised:
        _outputs([{"models": []}, unknown])  # the index: only a broker without a repository is left out
    assert raised.value.code == "unknown_model"


def test_a_model_serving_several_versions_has_no_input_names_for_a_request_naming_none() -> None:
    meta = {"versions": ["1", "2"], "inputs": [{"name": "z"}], "outputs": [{"name": "y"}]}
    assert names_of_meta(meta, "") == (None, ["y"])
    assert names_of_meta(meta, "2") == (["z"], ["y"])
    assert names_of_meta({**meta, "versions": ["2"]}, "") == (["z"], ["y"])
