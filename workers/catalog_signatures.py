"""A multiplexed worker's catalog read for its models' signatures in a child process.

A pool worker announces every model's signature when it starts (docs/protocol.md 6.2), which
means loading each model once. A model whose load ends its process (`os._exit` at import, a
crash in native code) would end the worker there, and every respawn the same way: every
model of the pool would go unserved. Loaded in a child, it ends only the child; the worker
learns which model it was loading, reads the rest in a new child, and never loads that one
itself (its batches are answered `model_error`, saying why). The child also leaves the
worker holding none of the models it read.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from batcher.wire.signature import signature_of
from workers.models import ModelFn, ModelSpec
from workers.steps import is_step_model

log = logging.getLogger("batcher.worker")


@dataclass
class CatalogRead:
    """What reading a catalog found: each model's signature in wire form (of those that
    declare one), and why each model whose load ended its reader's process did not load."""

    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)
    fatal: dict[str, str] = field(default_factory=dict)


def read_catalog(targets: dict[str, ModelSpec], load: Callable[[ModelSpec], ModelFn]) -> CatalogRead:
    """Load each of `targets` once, in a child process (`load` must pickle), for its
    signature; a model whose load ends the child is named in `fatal` and the rest are
    read by the next child."""
    found = CatalogRead()
    remaining = list(targets)
    while remaining:
        read_fd, write_fd = os.pipe()
        child = subprocess.Popen(
            [sys.executable, "-c", "from workers.catalog_signatures import main; main()", str(write_fd)],
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)  # the child holds the only write end: its exit ends the pipe
        receive = Connection(read_fd, writable=False)
        assert child.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it ended before reading: said below
            child.stdin.write(pickle.dumps(({k: targets[k] for k in remaining}, load)))
            child.stdin.close()
        done, loading = _follow(receive, found)
        code = child.wait()
        receive.close()
        if loading is not None:
            why = f"its load ended the process that loaded it (exit code {code})"
            log.error("model %s: %s; it is not loaded in this worker", loading, why)
            found.fatal[loading] = why
            done.add(loading)
        elif len(done) < len(remaining):  # ended between two models: read no further
            log.warning("reading the catalog's signatures stopped (exit code %s)", code)
            return found
        remaining = [k for k in remaining if k not in done]
    return found


def main() -> None:
    """The child: the catalog and the loader on stdin, its news on the descriptor named
    by its argument."""
    send = Connection(int(sys.argv[1]), readable=False)
    targets, load = pickle.load(sys.stdin.buffer)
    _read(targets, load, send)


def _follow(receive: Connection, found: CatalogRead) -> tuple[set[str], str | None]:
    """The child's news until it ends: the models it read, and the one it was loading
    when it ended (None: it was not loading one)."""
    done: set[str] = set()
    loading = None
    while True:
        try:
            kind, key, value = receive.recv()
        except EOFError:
            return done, loading
        if kind == "loading":
            loading = key
            continue
        done.add(key)
        loading = None
        if value is not None:
            found.signatures[key] = value


def _read(targets: dict[str, ModelSpec], load: Callable[[ModelSpec], ModelFn], send: Connection) -> None:
    """In the child: load each model in turn and say what it declares (a model that raises,
    a sys.exit() too, declares nothing: its batches say why it does not load)."""
    for key, target in targets.items():
        send.send(("loading", key, None))
        declared = None
        try:
            model = load(target)
            if not is_step_model(model):
                declared = signature_of(model)
            del model
        except (Exception, SystemExit) as exc:
            log.warning("model %s: no signature read (%s: %s)", key, type(exc).__name__, exc)
        send.send(("read", key, None if declared is None else declared.wire()))
        gc.collect()
    send.close()
