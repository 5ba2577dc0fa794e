"""Operations issue, the worker's side, through real processes where it matters:

1. `batcher worker` imports a user model from the directory it runs in, as `serve`'s
   workers (`python -m batcher worker`) do, and says where it looked when it cannot.
2. A worker whose handshake the broker refuses (a CURVE key not listed, plaintext
   against CURVE) keeps retrying with back-off, says why at a bounded rate, and joins
   once its key is admitted.
3. A model may fail single items by returning an exception in place of their output.
4. The wait of a prefetched batch inside the worker counts in its queue time.
6. The README's Doubler runs on the CPU when the worker has no GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.client.sync import BadRequest, Client, ModelError
from batcher.serve.launcher import ServeProcess, free_tcp_address
from batcher.wire import protocol
from tests.conftest import kill_group
from tests.helpers import broker_stats, curve_broker_stats, start_broker, wait_until
from workers.exit_codes import EXIT_MODEL_LOAD_FAILED
from workers.models import ModelSpec, import_user_module, load_model
from workers.worker import run_batch

#: Every test here runs the CLI or a worker as a process of its own.
pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_MODELS = ROOT / "examples" / "python" / "mymodels.py"
#: The console script, which (unlike `python -m`) does not put the current directory on sys.path.
BATCHER = Path(sys.executable).parent / "batcher"
WORKER = "host/gpu0/1234"


# --- models the workers of these tests load ------------------------------------------------


def fail_odd(inputs: list[Any]) -> list[Any]:
    """Each input back, except odd numbers: an exception (raised, so it has a traceback)."""
    outputs: list[Any] = []
    for x in inputs:
        try:
            if x % 2:
                raise ValueError(f"odd input {x}")
            outputs.append(x)
        except ValueError as exc:
            outputs.append(exc)
    return outputs


def sleepy(inputs: list[Any]) -> list[Any]:
    """Sleeps the largest input in seconds, then returns the inputs."""
    time.sleep(max(inputs))
    return list(inputs)


# --- processes started with a working directory of their own ----------------------------------


@dataclass
class Started:
    process: subprocess.Popen[bytes]
    stderr_path: Path

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@pytest.fixture
def run_batcher(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Started]]:
    """Factory: `run_batcher(cwd, *args)` starts the `batcher` console script in `cwd`, in a
    session of its own, with only this checkout on PYTHONPATH; teardown kills its group."""
    started: list[tuple[Started, Any]] = []

    def start(cwd: Path, *args: str) -> Started:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        path = tmp_path / f"batcher-{len(started)}.stderr"
        stderr = path.open("wb")
        proc = subprocess.Popen(
            [str(BATCHER), *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
        s = Started(proc, path)
        started.append((s, stderr))
        return s

    yield start
    for s, stderr in reversed(started):
        try:
            kill_group(s.process.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.process.wait(5)
        finally:
            stderr.close()
    if any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call")):
        for s, _ in started:
            print(f"----- stderr of {' '.join(map(str, s.process.args))}")
            print(s.log())


def workers_of(frontend: str, model: str, ctx: zmq.Context[Any], curve_server_key: str) -> int | None:
    """How many workers the CURVE broker has for `model` (None: no answer)."""
    stats = curve_broker_stats(frontend, ctx, curve_server_key)
    return int(stats["models"].get(model, {}).get("workers", 0)) if stats else None


# --- 1. the model's module is looked for in the current directory ----------------------------------


def test_batcher_worker_imports_a_model_from_its_directory(spawn, run_batcher, tmp_path, zctx):
    models_dir = tmp_path / "app"
    models_dir.mkdir()
    shutil.copy(EXAMPLE_MODELS, models_dir / "mymodels.py")
    frontend, backend = start_broker(spawn, zctx, "--model", "double", "--no-worker-timeout-ms", "0")
    worker = run_batcher(models_dir, "worker", "--connect", backend, "--model", "double=mymodels:Doubler")
    with Client(frontend, timeout_s=20, context=zctx) as c:
        replies = [p.wait() for p in [c.submit(x, model="double") for x in (1, 2.5, "ab")]]
    assert [r.get("output") for r in replies] == [2, 5.0, "abab"], (replies, worker.log())
    assert all(r["worker"].endswith(f"/{worker.process.pid}") for r in replies), replies
    assert worker.process.poll() is None


def test_the_generative_example_streams_its_words_from_a_worker_in_its_directory(
    spawn, run_batcher, tmp_path, zctx
):
    models_dir = tmp_path / "app"
    models_dir.mkdir()
    shutil.copy(EXAMPLE_MODELS.with_name("generative.py"), models_dir / "generative.py")
    frontend, backend = start_broker(spawn, zctx, "--model", "typewriter", "--no-worker-timeout-ms", "0")
    worker = run_batcher(
        models_dir, "worker", "--connect", backend, "--model", "typewriter=generative:Typewriter"
    )
    with Client(frontend, timeout_s=20, context=zctx) as c:
        with c.stream("continuous batching streams words", model="typewriter") as words:
            replies = list(words.replies())
        assert [r["output"] for r in replies] == ["continuous", "batching", "streams", "words"], worker.log()
        assert [r["more"] for r in replies] == [True, True, True, False]
        assert c.request("two words", model="typewriter") == ["two", "words"]  # not streamed: one reply
        with pytest.raises(BadRequest, match="the input must be a string of at least one word"):
            list(c.stream(42, model="typewriter"))


def test_a_model_that_cannot_be_found_says_where_it_was_looked_for(run_batcher, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    worker = run_batcher(empty, "worker", "--connect", free_tcp_address(), "--model", "net=mymodels:Net")
    assert worker.process.wait(20) == EXIT_MODEL_LOAD_FAILED
    log = worker.log()
    assert "cannot load model 'net=mymodels:Net': ModuleNotFoundError: no module named 'mymodels'" in log
    assert f"the current directory {empty}" in log, log
    assert str(ROOT) in log, log  # PYTHONPATH's entry: searched too
    assert "run the worker from the directory that holds mymodels.py" in log, log
    assert "PYTHONPATH" in log, log
    assert "Traceback" not in log, log


@pytest.fixture
def clean_import_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh directory as the current one, and sys.path without it (restored after)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def test_loader_finds_the_current_directory_first(clean_import_path: Path, monkeypatch) -> None:
    (clean_import_path / "ops_cwd_model.py").write_text("def f(xs):\n    return [x + 1 for x in xs]\n")
    monkeypatch.delitem(sys.modules, "ops_cwd_model", raising=False)
    model = load_model(ModelSpec.parse("ops_cwd_model:f"), None)
    assert model([1, 2]) == [2, 3]
    assert sys.path[0] == str(clean_import_path)
    sys.modules.pop("ops_cwd_model", None)


def test_loader_reraises_a_missing_dependency_of_a_found_module(clean_import_path: Path) -> None:
    (clean_import_path / "ops_needs_dep.py").write_text("import ops_no_such_dependency\n")
    with pytest.raises(ModuleNotFoundError) as err:
        import_user_module("ops_needs_dep")
    assert err.value.name == "ops_no_such_dependency"
    assert "current directory" not in str(err.value)  # found: the hint would mislead


# --- 2. refused handshakes ----------------------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path, cli: Callable[..., Any]) -> Path:
    """Key pairs made by `batcher keygen` in secrets/NAME/ for broker, gpuhost, stranger."""
    for name in ("broker", "gpuhost", "stranger"):
        result = cli("keygen", str(tmp_path / "secrets" / name), "--name", name)
        assert result.returncode == 0, result.stderr
    return tmp_path / "secrets"


def allow(directory: Path, keys: Path, *names: str) -> Path:
    directory.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(keys / name / f"{name}.key", directory)
    return directory


def curve_broker(spawn: Any, keys: Path, frontend: str, backend: str, workers_dir: Path) -> Any:
    return spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", "echo",
        "--heartbeat-ms", "200", "--curve-secret-key", str(keys / "broker" / "broker.key_secret"),
        "--curve-workers", str(workers_dir),
    )  # fmt: skip


def lines(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines() if all(n in line for n in needles)]


def test_refused_worker_retries_logs_at_a_bounded_rate_and_joins_once_listed(spawn, keys, tmp_path, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    listed = allow(tmp_path / "workers", keys, "gpuhost")
    broker = curve_broker(spawn, keys, frontend, backend, listed)
    curve = {"curve_server_key": str(keys / "broker" / "broker.key")}
    worker = spawn(
        "worker", "--connect", backend, "--model", "echo", "--heartbeat-ms", "200", "--log-level", "DEBUG",
        "--curve-server-key", str(keys / "broker" / "broker.key"),
        "--curve-secret-key", str(keys / "stranger" / "stranger.key_secret"),
    )  # fmt: skip
    why = "the broker refused our CURVE key"

    def attempts() -> list[str]:
        return lines(worker.stderr_path.read_text(errors="replace"), "cannot join the broker", why)

    wait_until(lambda: len(attempts()) >= 3, 15, "three refused handshakes, retried")
    log = worker.stderr_path.read_text(errors="replace")
    warnings = [line for line in attempts() if " WARNING " in line]
    assert len(warnings) == 1, attempts()  # once, then at DEBUG
    assert "in its --curve-workers directory" in warnings[0], warnings[0]
    assert all(" DEBUG " in line for line in attempts()[1:]), attempts()
    assert len(lines(log, " INFO ", "ready for model")) == 1, log  # the retries are quiet too
    assert "Traceback" not in log, log
    assert worker.process.poll() is None, "the refused worker exited"
    assert workers_of(frontend, "echo", zctx, **curve) == 0

    # The broker reads its allow-list at start: list the key and restart it.
    broker.process.send_signal(signal.SIGTERM)
    assert broker.process.wait(10) == 0
    allow(listed, keys, "stranger")
    curve_broker(spawn, keys, frontend, backend, listed)
    wait_until(lambda: workers_of(frontend, "echo", zctx, **curve) == 1, 20, "the worker joining once listed")
    with Client(frontend, timeout_s=10, context=zctx, **curve) as c:
        reply = c.submit("hi", model="echo").wait()
    assert reply["ok"] and reply["worker"].endswith(f"/{worker.pid}"), reply
    assert lines(worker.stderr_path.read_text(errors="replace"), "accepted us after")
    assert worker.process.poll() is None


def test_listed_worker_joins_after_a_refused_one_which_keeps_running(spawn, keys, tmp_path, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    curve_broker(spawn, keys, frontend, backend, allow(tmp_path / "workers", keys, "gpuhost"))

    def worker(name: str) -> Any:
        return spawn(
            "worker", "--connect", backend, "--model", "echo", "--heartbeat-ms", "200",
            "--curve-server-key", str(keys / "broker" / "broker.key"),
            "--curve-secret-key", str(keys / name / f"{name}.key_secret"),
        )  # fmt: skip

    refused = worker("stranger")
    wait_until(lambda: "refused our CURVE key" in refused.stderr_path.read_text(), 15, "the refusal logged")
    worker("gpuhost")
    curve = {"curve_server_key": str(keys / "broker" / "broker.key")}
    wait_until(lambda: workers_of(frontend, "echo", zctx, **curve) == 1, 20, "the listed worker joining")
    assert refused.process.poll() is None, refused.stderr_path.read_text()


def test_plaintext_worker_against_a_curve_broker_retries_and_says_why(spawn, keys, tmp_path, zctx):
    frontend, backend = free_tcp_address(), free_tcp_address()
    curve_broker(spawn, keys, frontend, backend, allow(tmp_path / "workers", keys, "gpuhost"))
    worker = spawn("worker", "--connect", backend, "--model", "echo", "--log-level", "DEBUG")

    def attempts() -> list[str]:
        return lines(worker.stderr_path.read_text(errors="replace"), "cannot join the broker")

    wait_until(lambda: len(attempts()) >= 2, 15, "two failed handshakes, retried")
    assert "plaintext vs CURVE mismatch" in attempts()[0], attempts()
    assert "does the broker use CURVE (--curve-server-key)?" in attempts()[0], attempts()
    log = worker.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log and "zmq.error" not in log, log
    assert worker.process.poll() is None, log


# --- 3. per-item failure --------------------------------------------------------------------------


def run(model: Any, inputs: list[Any], arrived_at: float | None = None) -> tuple[list[Any], list[Any]]:
    """(REPLY header, decoded replies) of `inputs` run as one BATCH with queue_ms 1.5 each."""
    bodies = [protocol.pack({"id": i, "input": x}) for i, x in enumerate(inputs)]
    frames = protocol.batch_frames(9, [1.5] * len(inputs), bodies)
    out = run_batch(model, frames[2], frames[3:], WORKER, arrived_at)
    header = protocol.unpack(out[2])
    return header, [protocol.unpack(r) for r in protocol.split_bodies(header[2], out[3:])]


def test_an_exception_in_place_of_an_output_fails_that_item_alone(caplog) -> None:
    unraised = KeyError("never raised")

    def model(inputs: list[Any]) -> list[Any]:
        out = fail_odd(inputs)
        out[0] = unraised
        return out

    with caplog.at_level(logging.DEBUG, logger="batcher.worker"):
        header, replies = run(model, [0, 1, 2, 3])
    assert header[3] == 3  # errors: the broker counts outcomes from it
    assert replies[0] == {
        "id": 0,
        "ok": False,
        "error": {"code": "model_error", "message": "KeyError: 'never raised'"},
    }
    assert [r["error"]["message"] for r in (replies[1], replies[3])] == [
        "ValueError: odd input 1",
        "ValueError: odd input 3",
    ]
    assert replies[2]["ok"] and replies[2]["output"] == 2 and replies[2]["batch_size"] == 4
    failed = [r for r in caplog.records if "the model failed item" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.DEBUG] * 3
    assert failed[0].exc_info is None  # never raised: no traceback to show
    assert failed[1].exc_info is not None and failed[1].exc_info[1] is not None
    assert "in fail_odd" in logging.Formatter().formatException(failed[1].exc_info)


def test_a_raising_model_logs_its_traceback_at_debug(caplog) -> None:
    def broken(inputs: list[Any]) -> list[Any]:
        raise RuntimeError("CUDA out of memory")

    with caplog.at_level(logging.DEBUG, logger="batcher.worker"):
        header, replies = run(broken, [1, 2])
    assert header[3] == 2
    assert all(r["error"]["message"] == "RuntimeError: CUDA out of memory" for r in replies)
    traced = [r for r in caplog.records if r.exc_info and r.levelno == logging.DEBUG]
    assert len(traced) == 1, caplog.records
    assert "in broken" in logging.Formatter().formatException(traced[0].exc_info)  # type: ignore[arg-type]


def test_model_that_fails_odd_items_through_serve(serve, client, zctx) -> None:
    sp: ServeProcess = serve(
        "--workers", "1", "--model", "odd=tests.integration.workers.test_worker_command:fail_odd",
        "--max-batch-size", "8",
        "--max-wait-ms", "5000", "--policy", "window",
        workers=1,
    )  # fmt: skip
    c = client(sp.frontend)
    replies = [p.wait() for p in [c.submit(i, model="odd") for i in range(8)]]
    assert [r["output"] for r in replies[0::2]] == [0, 2, 4, 6], replies
    assert {r["batch_size"] for r in replies[0::2]} == {8}  # served in the batch the others failed in
    assert [r["error"] for r in replies[1::2]] == [
        {"code": "model_error", "message": f"ValueError: odd input {i}"} for i in (1, 3, 5, 7)
    ]
    results = c.request_many(range(8), model="odd", return_exceptions=True)
    assert results[0::2] == [0, 2, 4, 6]
    assert all(isinstance(e, ModelError) for e in results[1::2]), results
    outcomes = broker_stats(sp.frontend, zctx)["models"]["odd"]["outcomes"]
    assert outcomes == {"ok": 8, "model_error": 8}, outcomes  # from the REPLY's errors count


# --- 4. the wait inside the worker --------------------------------------------------------------


def test_worker_wait_is_added_to_queue_ms_and_sent_in_the_header() -> None:
    header, replies = run(lambda xs: list(xs), [10, 11], arrived_at=time.monotonic() - 0.05)
    wait_ms = header[4]
    assert len(header) == 5 and isinstance(wait_ms, float) and 50.0 <= wait_ms < 5000.0, header
    for r in replies:
        assert r["worker_wait_ms"] == wait_ms
        assert r["queue_ms"] == round(1.5 + wait_ms, 3)


def test_without_an_arrival_time_the_reply_is_as_before() -> None:
    header, replies = run(lambda xs: list(xs), [10])
    assert len(header) == 4
    assert replies[0]["queue_ms"] == 1.5 and "worker_wait_ms" not in replies[0]


def test_a_prefetched_batch_reports_its_wait_in_the_worker(serve, client, zctx) -> None:
    # While the model runs, the worker reads its socket only at its heartbeat thread's
    # ticks: at the default 500 ms a tick fell inside the first batch's 0.4 s once in four
    # or five runs, and the second batch was read only after it (a wait of 0). At 100 ms
    # the first tick reads it within 0.1 s of the model's start (liveness 20: a 2 s expiry).
    sp: ServeProcess = serve(
        "--workers", "1", "--model", "sleepy=tests.integration.workers.test_worker_command:sleepy",
        "--max-batch-size", "1",
        "--max-wait-ms", "0", "--worker-prefetch", "2", "--heartbeat-ms", "100",
        "--heartbeat-liveness", "20",
        workers=1,
    )  # fmt: skip
    c = client(sp.frontend)
    first, second = [c.submit(0.4, model="sleepy") for _ in range(2)]
    a, b = first.wait(), second.wait()
    assert a["ok"] and b["ok"], (a, b)
    # The second batch reached the worker while the first ran (prefetch), and waited for
    # it: the broker's stats count that wait; the reply's own `worker_wait_ms` starts when
    # the worker read the batch, which it may do only once the first is done.
    st = broker_stats(sp.frontend, zctx)
    assert st["models"]["sleepy"]["worker_wait_ms_p99"] >= 250, st["models"]["sleepy"]
    assert a["worker_wait_ms"] < 250, a
    for r in (a, b):
        assert r["queue_ms"] >= r["worker_wait_ms"] >= 0, r


# --- 6. the README's Doubler ----------------------------------------------------------------------


def test_example_doubler_uses_the_cpu_without_a_gpu(monkeypatch, clean_import_path: Path) -> None:
    shutil.copy(EXAMPLE_MODELS, clean_import_path / "mymodels.py")
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    try:
        assert load_model(ModelSpec.parse("mymodels:Doubler"), None).device == "cpu"  # type: ignore[attr-defined]
        assert load_model(ModelSpec.parse("mymodels:Doubler"), 3).device == "cuda:0"  # type: ignore[attr-defined]
        reciprocal = load_model(ModelSpec.parse("mymodels:reciprocal"), None)
        out = reciprocal([2, 0, "x"])
    finally:
        sys.modules.pop("mymodels", None)
    assert out[0] == 0.5 and isinstance(out[1], ZeroDivisionError) and isinstance(out[2], TypeError)


# --- heartbeat settings come from the broker ------------------------------------------------------


def test_a_worker_started_with_another_heartbeat_adopts_the_brokers(spawn, zctx):
    """Broker 200 ms x 3; worker started with 5 s: without agreeing it would beat every 5 s
    and be taken for dead after 0.6 s. It adopts the broker's at once and stays."""
    frontend, backend = start_broker(spawn, zctx, "--model", "echo", "--heartbeat-ms", "200")
    worker = spawn("worker", "--connect", backend, "--model", "echo", "--heartbeat-ms", "5000")
    adopted = "using the broker's heartbeat, 200 ms x 3 (was 5000 ms x 3)"
    wait_until(lambda: adopted in worker.stderr_path.read_text(), 20, "the worker adopting it")
    # Idle (no batch, whose reply would count as a sign of life too) for over 3 times the
    # broker's 0.6 s expiry: only its heartbeats keep it; the broker is watched throughout.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        stats = broker_stats(frontend, zctx, timeout_s=5)
        assert stats["workers_lost"] == 0 and stats["models"]["echo"]["workers"] == 1, stats
    with Client(frontend, timeout_s=10, context=zctx) as c:
        assert c.request("x", model="echo") == "x"
