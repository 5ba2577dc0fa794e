"""docs/architecture.md names real code: every dotted name it gives resolves, and the
layout it describes is the one on disk."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from batcher.moved_modules import MOVED

ROOT = Path(__file__).resolve().parents[3]
PAGE = (ROOT / "docs" / "architecture.md").read_text()
DOTTED = sorted(set(re.findall(r"`((?:batcher|workers)(?:\.\w+)+)`", PAGE)))


def resolve(name: str) -> object:
    """Import the longest module prefix of `name`, then walk the attributes after it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_page_names_code() -> None:
    assert len(DOTTED) >= 15, DOTTED  # the request path and the places to add things


@pytest.mark.parametrize("name", DOTTED)
def test_every_name_on_the_page_exists(name: str) -> None:
    resolve(name)


def test_every_folder_on_the_page_exists() -> None:
    folders = set(re.findall(r"`((?:batcher|workers)/(?:\w+/)*)`", PAGE))
    assert {"batcher/wire/", "batcher/core/", "batcher/cli/"} <= folders
    for folder in folders:
        assert (ROOT / folder / "__init__.py").is_file(), folder


def test_importing_the_package_or_its_core_loads_no_zmq() -> None:
    code = (
        "import sys, batcher, batcher.core.scheduler, batcher.core.pool, batcher.core.streams, "
        "batcher.wire.protocol, batcher.wire.tensor, batcher.wire.signature; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'asyncio', 'numpy')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_old_client_imports_keep_working() -> None:
    from batcher import AsyncClient, BatcherError, Client, ClientTimeout, MultiClient
    from batcher.client import AsyncClient as AsyncClient2
    from batcher.client import ClientClosed, Forbidden, Overloaded, Unreachable

    assert AsyncClient is AsyncClient2
    assert issubclass(Overloaded, BatcherError) and issubclass(Forbidden, BatcherError)
    assert issubclass(Unreachable, ClientTimeout) and issubclass(ClientClosed, BatcherError)
    assert Client.__module__ == "batcher.client.sync" and MultiClient.__module__ == "batcher.client.multi"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_flat_module_path_of_before_the_layout_still_imports_with_a_warning(old: str) -> None:
    """Code written for the flat layout (`from batcher.aio import AsyncClient`) runs on,
    told where the module lives now."""
    code = (
        "import importlib, warnings, sys\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module('batcher.{old}')\n"
        f"new = importlib.import_module('{MOVED[old]}')\n"
        "print(old is new, [str(w.message) for w in seen if w.category is DeprecationWarning])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"True ['batcher.{old} moved to {MOVED[old]}: import it from there']"


def test_a_name_that_never_was_a_module_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("batcher.no_such_module")


def test_the_old_broker_module_s_names_are_found_in_its_package_with_a_warning() -> None:
    """`from batcher.broker import Broker, BrokerSettings`, as the flat layout had them."""
    import batcher.broker
    from batcher.broker.loop import Broker

    with pytest.warns(DeprecationWarning, match=r"batcher.broker.Broker moved to batcher.broker.loop"):
        assert batcher.broker.Broker is Broker
    with pytest.raises(AttributeError):
        batcher.broker.no_such_name  # noqa: B018
