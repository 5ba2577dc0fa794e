"""A model repository served by `batcher serve --model-repository` (docs/models.md): each
version side by side with its own weights, the version policy, a broken version skipped,
versions copied in while it runs, canary splits, load and unload."""

from __future__ import annotations

import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from tests import onnx_models
from tests.helpers import wait_until

ROW = np.arange(4, dtype=np.float32)


def version(root: Path, name: str, v: int, seed: int) -> Path:
    """DIR/NAME/V/model.onnx, a linear model whose weights come from `seed`; written in a
    directory beside and renamed in, as a deployment copies one in whole."""
    staging = root / f".{name}-{v}-staging"
    staging.mkdir(parents=True)
    onnx_models.linear(staging / "model.onnx", inputs=4, outputs=3, seed=seed)
    (root / name).mkdir(parents=True, exist_ok=True)
    target = root / name / str(v)
    staging.rename(target)
    return target / "model.onnx"


def expected(path: Path, row: np.ndarray = ROW) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": row[None]})[0][0]  # type: ignore[no-any-return]


def ask(c: Any, model: str, v: int | str | None = None, row: Any = ROW) -> dict[str, Any]:
    """The whole reply to one request for `model`, naming version `v` when given."""
    fields: dict[str, Any] = {"input": row, "model": model}
    if v is not None:
        fields["version"] = v
    try:
        return {"ok": True, "output": c.start(fields, c.timeout_s).result()}
    except Exception as exc:  # the typed reply error
        return {"ok": False, "code": getattr(exc, "code", None), "message": str(exc)}


def config(root: Path, name: str, text: str) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "config.toml").write_text(text)


@pytest.mark.integration
def test_each_version_answers_with_its_own_weights_and_a_broken_one_is_skipped(
    serve, client, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    v1 = version(root, "lin", 1, seed=1)
    v2 = version(root, "lin", 2, seed=2)
    config(root, "lin", 'version_policy = "all"\nworkers = 1\nmax_wait_ms = 2\n')
    other = version(root, "other", 1, seed=7)  # no config.toml: the defaults, latest:1
    (root / "broken").mkdir()
    (root / "broken" / "config.toml").write_text("max_batch_size = 0\n")  # refused: reported, skipped
    (root / "broken" / "1").mkdir()
    onnx_models.linear(root / "broken" / "1" / "model.onnx", seed=3)
    (root / "other" / "2").mkdir()  # a version that holds no model: skipped, version 1 served
    s = serve("--model-repository", str(root), "--workers", "1", workers=3)
    c = client(s.frontend)
    assert np.array_equal(ask(c, "lin", 1)["output"], expected(v1))
    assert np.array_equal(ask(c, "lin", "2")["output"], expected(v2))
    assert np.array_equal(ask(c, "lin")["output"], expected(v2))  # none named: the newest
    assert np.array_equal(ask(c, "lin/1")["output"], expected(v1))  # the internal key
    assert np.array_equal(ask(c, "other")["output"], expected(other))
    assert not np.array_equal(expected(v1), expected(v2))
    refused = ask(c, "lin", 3)
    assert refused["code"] == "unknown_model" and "served: 1, 2" in refused["message"]
    assert ask(c, "broken")["code"] == "unknown_model"
    stats = c.control("stats")
    assert {"lin/1", "lin/2", "other/1"} <= set(stats["models"])
    assert stats["models"]["lin/1"]["workers"] == 1 and stats["models"]["lin/2"]["workers"] == 1
    assert stats["versions"]["lin"]["served"] == [1, 2]
    meta = c.control("metadata", model="lin", version=1)
    assert meta["name"] == "lin" and meta["version"] == "1" and meta["versions"] == ["1", "2"]
    assert meta["inputs"][0]["name"] == "x"
    index = {(m["name"], m["version"]): m for m in c.control("repository_index")["models"]}
    assert index[("lin", "1")]["state"] == index[("lin", "2")]["state"] == "READY"
    assert index[("broken", "")]["state"] == "UNAVAILABLE"
    assert "max_batch_size" in index[("broken", "")]["reason"]
    assert index[("other", "2")]["state"] == "UNAVAILABLE" and "no model" in index[("other", "2")]["reason"]


@pytest.mark.integration
def test_latest_1_serves_only_the_newest_and_a_version_that_does_not_load_is_skipped(
    serve, client, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    version(root, "lin", 1, seed=1)
    v2 = version(root, "lin", 2, seed=2)
    good = version(root, "good", 1, seed=5)
    (root / "bad" / "1").mkdir(parents=True)
    (root / "bad" / "1" / "model.onnx").write_bytes(b"not an onnx model")  # found only by its worker
    s = serve("--model-repository", str(root), "--workers", "1", workers=2)
    c = client(s.frontend)
    assert np.array_equal(ask(c, "lin")["output"], expected(v2))
    assert ask(c, "lin", 1)["code"] == "unknown_model"
    assert "lin/1" not in c.control("stats")["models"]
    wait_until(lambda: c.control("stats")["versions"]["bad"]["served"] == [], 20, "bad/1 reported")
    assert ask(c, "bad")["code"] == "unknown_model"
    assert np.array_equal(ask(c, "good")["output"], expected(good))  # undisturbed
    index = {(m["name"], m["version"]): m for m in c.control("repository_index")["models"]}
    assert index[("bad", "1")]["state"] == "UNAVAILABLE" and "loaded" in index[("bad", "1")]["reason"]
    assert s.process is not None and s.process.poll() is None  # serve goes on


def which(outputs: list[Any], by_version: dict[int, np.ndarray]) -> list[int]:
    """The version that computed each output (each version's weights give another row)."""
    found = []
    for out in outputs:
        matches = [v for v, e in by_version.items() if np.allclose(out, e)]
        assert len(matches) == 1, out
        found.append(matches[0])
    return found


@pytest.mark.integration
def test_a_canary_split_routes_by_weight_and_a_split_changed_under_load_loses_nothing(
    serve, client, cli, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    paths = {1: version(root, "lin", 1, seed=1), 2: version(root, "lin", 2, seed=2)}
    config(root, "lin", 'version_policy = "all"\nworkers = 1\ntraffic = {"1" = 90, "2" = 10}\n')
    s = serve("--model-repository", str(root), workers=2)
    c = client(s.frontend, timeout_s=30)
    by_version = {v: expected(p) for v, p in paths.items()}
    n = 2000
    outputs = c.request_many([ROW] * n, model="lin")
    got = which(outputs, by_version)
    sigma = math.sqrt(n * 0.1 * 0.9)
    assert abs(got.count(2) - n * 0.1) <= 4 * sigma, got.count(2)
    share = c.control("stats")["versions"]["lin"]["share"]
    assert abs(share["2"] - 0.1) <= 4 * sigma / n and abs(share["1"] - 0.9) <= 4 * sigma / n
    table = cli("stats", "--connect", s.frontend)
    assert table.returncode == 0 and "lin: versions 1, 2; split 1=90 2=10; routed 1: " in table.stdout

    replies: list[Any] = []
    stop = threading.Event()

    def load() -> None:  # requests without a version, while the split changes
        with client(s.frontend, timeout_s=30) as lc:
            while not stop.is_set():
                replies.extend(lc.request_many([ROW] * 20, model="lin", return_exceptions=True))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_until(lambda: len(replies) >= 100, 20, "load running")
        result = cli("split", "lin", "1=50", "2=50", "--connect", s.frontend)
        assert result.returncode == 0, result.stderr
        assert '"traffic"' in result.stdout
        wait_until(lambda: sum(c.control("stats")["versions"]["lin"]["routed"].values()) >= 400, 30, "after")
    finally:
        stop.set()
        thread.join(30)
    assert replies and all(isinstance(r, np.ndarray) for r in replies), [
        r for r in replies if not isinstance(r, np.ndarray)
    ][:3]
    routed = c.control("stats")["versions"]["lin"]["routed"]  # since the split changed
    total = routed["1"] + routed["2"]
    assert abs(routed["1"] - total / 2) <= 4 * math.sqrt(total * 0.25)
    refused = cli("split", "lin", "3=10", "--connect", s.frontend)
    assert refused.returncode == 1 and "does not serve version 3" in refused.stderr


@pytest.mark.integration
def test_a_version_copied_in_joins_then_retires_the_old_and_a_removed_model_stops(
    serve, client, cli, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    paths = {1: version(root, "lin", 1, seed=1), 2: version(root, "lin", 2, seed=2)}
    config(root, "lin", "workers = 1\n")  # latest:1: version 2
    version(root, "other", 1, seed=7)
    poll_s = 0.5
    s = serve("--model-repository", str(root), "--repository-poll-s", str(poll_s), workers=2)
    c = client(s.frontend, timeout_s=30)
    replies: list[Any] = []
    stop = threading.Event()

    def load() -> None:
        with client(s.frontend, timeout_s=30) as lc:
            while not stop.is_set():
                replies.extend(lc.request_many([ROW] * 10, model="lin", return_exceptions=True))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        wait_until(lambda: len(replies) >= 50, 20, "load running")
        paths[3] = version(root, "lin", 3, seed=3)
        copied = time.monotonic()

        def state(name: str, v: str) -> str | None:
            index = c.control("repository_index")["models"]
            return next((m["state"] for m in index if (m["name"], m["version"]) == (name, v)), None)

        wait_until(lambda: state("lin", "3") in ("LOADING", "READY"), poll_s + 1.0, "version 3 noticed")
        assert time.monotonic() - copied <= poll_s + 1.0
        wait_until(lambda: c.control("stats")["versions"]["lin"]["served"] == [3], 60, "version 3 serving")
        wait_until(lambda: c.control("stats")["models"]["lin/2"]["workers"] == 0, 30, "version 2 retired")
        count_at_switch = len(replies)
        wait_until(lambda: len(replies) >= count_at_switch + 50, 20, "load after the switch")
        ready = cli("ready", "--connect", s.frontend)  # the retired version is not waited for
        assert ready.returncode == 0 and "ready: lin/3 (1 worker)" in ready.stdout, ready
        config(root, "other", "max_batch_size = 0\n")  # a bad edit: reported, what runs serves on
        wait_until(lambda: state("other", "") == "UNAVAILABLE", poll_s + 2.0, "the bad config reported")
        assert state("other", "1") == "READY" and ask(c, "other")["ok"]
        shutil.rmtree(root / "other")
        wait_until(lambda: "other" not in c.control("stats").get("versions", {}), 30, "other removed")
        assert c.control("stats")["models"]["other/1"]["workers"] == 0
    finally:
        stop.set()
        thread.join(30)
    bad = [r for r in replies if not isinstance(r, np.ndarray)]
    assert not bad, bad[:3]
    got = which(replies, {v: expected(p) for v, p in paths.items()})
    assert set(got) <= {2, 3} and got[-1] == 3
    assert got == sorted(got)  # 2 until the switch, 3 after: never back
    assert ask(c, "other")["code"] == "unknown_model"


@pytest.mark.integration
def test_tritonclient_lists_unloads_and_loads_models_through_the_gateway(serve, cli, tmp_path: Path) -> None:
    import tritonclient.http as thttp
    from tritonclient.utils import InferenceServerException

    from batcher.serve.launcher import free_tcp_address

    root = tmp_path / "models"
    v1 = version(root, "lin", 1, seed=1)
    v2 = version(root, "lin", 2, seed=2)
    config(root, "lin", 'version_policy = "all"\nworkers = 1\n')
    http_port, grpc_port = (int(free_tcp_address().rsplit(":", 1)[1]) for _ in range(2))
    s = serve(
        "--model-repository",
        str(root),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        workers=2,
    )
    tc = thttp.InferenceServerClient(f"127.0.0.1:{http_port}")
    wait_until(lambda: _live(tc), 20, "the gateway's port")

    def infer(v: str = "") -> np.ndarray:
        x = thttp.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(ROW[None])
        return tc.infer("lin", [x], model_version=v).as_numpy("y")[0]  # type: ignore[no-any-return]

    assert np.allclose(infer("1"), expected(v1)) and np.allclose(infer("2"), expected(v2))
    assert np.allclose(infer(), expected(v2))
    assert tc.get_model_metadata("lin", "1")["versions"] == ["1", "2"]
    index = tc.get_model_repository_index()
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("lin", "1", "READY"),
        ("lin", "2", "READY"),
    }
    tc.unload_model("lin")
    assert tc.get_model_repository_index() and all(
        m["state"] == "UNAVAILABLE" for m in tc.get_model_repository_index()
    )
    with pytest.raises(InferenceServerException, match="lin"):
        infer()
    tc.load_model("lin")
    assert np.allclose(infer("1"), expected(v1)) and np.allclose(infer(), expected(v2))
    with pytest.raises(InferenceServerException, match="missing"):
        tc.load_model("missing")
    result = cli("unload", "lin", "--connect", s.frontend)
    assert result.returncode == 0, result.stderr
    assert '"versions": []' in result.stdout

    import tritonclient.grpc as tgrpc  # the same calls over gRPC

    gc = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    assert {m.state for m in gc.get_model_repository_index().models} == {"UNAVAILABLE"}
    gc.load_model("lin")
    ready = gc.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["version"], m["state"]) for m in ready} == {
        ("lin", "1", "READY"),
        ("lin", "2", "READY"),
    }
    assert np.allclose(infer("1"), expected(v1))
    gc.unload_model("lin")
    with pytest.raises(InferenceServerException, match="lin"):
        infer()
    with pytest.raises(InferenceServerException, match="missing"):
        gc.load_model("missing")


def _live(tc: Any) -> bool:
    try:
        return bool(tc.is_server_live())
    except Exception:  # not listening yet
        return False


PY_MODEL = '''
FACTOR = {factor}


def model(inputs):
    """Version {factor}: each input times {factor}."""
    return [x * FACTOR for x in inputs]
'''


@pytest.mark.integration
def test_python_model_versions_and_metrics_per_version(serve, client, tmp_path: Path) -> None:
    from batcher.serve.launcher import free_tcp_address
    from tests.helpers import scrape

    root = tmp_path / "models"
    for v in (1, 2):
        (root / "py" / str(v)).mkdir(parents=True)
        (root / "py" / str(v) / "model.py").write_text(PY_MODEL.format(factor=10 * v))
    config(root, "py", 'kind = "python"\nversion_policy = "specific:1,2"\nworkers = 1\n')
    metrics_port = int(free_tcp_address().rsplit(":", 1)[1])
    s = serve("--model-repository", str(root), "--metrics-port", str(metrics_port), workers=2)
    c = client(s.frontend)
    assert [ask(c, "py", v, row=3)["output"] for v in (1, 2, None)] == [30, 60, 60]

    def counted() -> tuple[float, ...] | None:
        samples = scrape(metrics_port)
        keys = [("batcher_requests_total", (("model", f"py/{v}"), ("outcome", "ok"))) for v in (1, 2)]
        return tuple(samples[k] for k in keys) if all(k in samples for k in keys) else None

    wait_until(lambda: counted() == (1, 2), 10, "each version's requests counted under its own key")
