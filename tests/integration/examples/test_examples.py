"""The example clients of docs/protocol.md (examples/c, examples/node) against a real broker,
and docs/protocol.md naming every file under examples/.

Each client is built or loaded first; when its toolchain is missing (a C compiler,
make and the libzmq and msgpack-c headers; or node with `npm install` done in
examples/node) its tests are skipped with the reason, never failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

import pytest

from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import ServeProcess, free_tcp_address
from batcher.transport.security import generate_keys

#: The tests that start a broker; the documentation checks need none.
integration = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
C_DIR = EXAMPLES / "c"
NODE_DIR = EXAMPLES / "node"
PROTOCOL_MD = ROOT / "docs" / "protocol.md"
#: Never examples themselves: installed packages and Python's caches.
SKIPPED_DIRS = {"node_modules", "__pycache__"}

#: Bounds on every subprocess this module runs (seconds).
BUILD_TIMEOUT_S = 120
RUN_TIMEOUT_S = 30

LINE = re.compile(r"^id=(?P<id>\S+) ok=(?P<ok>true|false) (?P<rest>.*)$")
SUMMARY = re.compile(r"^summary: sent=(\d+) replies=(\d+) ok=(\d+) errors=(\d+)$")


def _run(
    cmd: list[str], cwd: Path | None = None, timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )


def _tail(text: str) -> str:
    """The telling line of a tool's error output: the first error line, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() or "cannot find" in line.lower():
            return line
    return lines[-1] if lines else "(no output)"


def _c_dependency_flags() -> list[str]:
    """Compiler flags for libzmq and msgpack-c from pkg-config, when it knows them."""
    if shutil.which("pkg-config") is None:
        return []
    for msgpack_pc in ("msgpack-c", "msgpack"):
        res = _run(["pkg-config", "--cflags", "libzmq", msgpack_pc])
        if res.returncode == 0:
            return res.stdout.split()
    return []


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """examples/c/client built out of the tree with its Makefile; skips without a toolchain."""
    cc = os.environ.get("CC", "cc")
    for tool in (cc, "make"):
        if shutil.which(tool) is None:
            pytest.skip(f"C example: no `{tool}` on PATH")
    # Headers present? Preprocess only, so a real error in client.c still fails the build below.
    probe = subprocess.run(
        [cc, *_c_dependency_flags(), "-E", "-x", "c", "-", "-o", os.devnull],
        input="#include <zmq.h>\n#include <msgpack.h>\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(
            "C example: zmq.h or msgpack.h not found (apt-get install libzmq3-dev libmsgpack-dev): "
            + _tail(probe.stderr)
        )
    out = tmp_path_factory.mktemp("c-client") / "client"
    build = _run(["make", "-C", str(C_DIR), f"OUT={out}"], timeout_s=BUILD_TIMEOUT_S)
    assert build.returncode == 0, f"make failed:\n{build.stdout}\n{build.stderr}"
    return [str(out)]


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    """`node examples/node/client.js`; skips without node or without its node_modules."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node example: no `node` on PATH")
    check = _run([node, "-e", "require('zeromq'); require('@msgpack/msgpack')"], cwd=NODE_DIR, timeout_s=60)
    if check.returncode != 0:
        pytest.skip(
            "Node example: zeromq or @msgpack/msgpack not installed (run `npm install` in "
            f"examples/node): {_tail(check.stderr)}"
        )
    return [node, str(NODE_DIR / "client.js")]


@pytest.fixture(params=["c", "node"])
def example(request: pytest.FixtureRequest) -> list[str]:
    """The command that runs one example client (its options follow)."""
    fixture = "c_client" if request.param == "c" else "node_client"
    command: list[str] = request.getfixturevalue(fixture)
    return command


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ServeProcess]:
    """`batcher serve` with one `echo` worker on free loopback ports, stopped at teardown;
    its stderr is shown if it does not become ready."""
    log_path = tmp_path / "serve.stderr"
    with log_path.open("wb") as log:
        serve = ServeProcess(["--workers", "1", "--model", "echo"], log_level="INFO", stderr=log)
        serve.start()
        try:
            try:
                serve.wait_ready(1, timeout_s=20.0)
            except (TimeoutError, RuntimeError) as exc:
                pytest.fail(f"batcher serve not ready: {exc}\n{log_path.read_text(errors='replace')}")
            yield serve
        finally:
            serve.stop()


@pytest.fixture
def curve_broker(tmp_path: Path) -> Iterator[tuple[ServeProcess, dict[str, str]]]:
    """A `serve` with CURVE on and an allow-list holding one client key; yields it with
    the key files: broker_public, client_secret."""
    broker_public, broker_secret = generate_keys(str(tmp_path / "broker"), "broker")
    _, client_secret = generate_keys(str(tmp_path / "clients"), "client")
    keys = {"broker_public": broker_public, "client_secret": client_secret}
    log_path = tmp_path / "serve.stderr"
    args = ["--workers", "1", "--model", "echo", "--curve-secret-key", broker_secret]
    args += ["--curve-clients", str(tmp_path / "clients")]
    with log_path.open("wb") as log:
        serve = ServeProcess(args, log_level="INFO", stderr=log)
        serve.start()
        try:
            # ServeProcess.wait_ready speaks plain TCP: ask with the client's keys instead.
            deadline = time.monotonic() + 20.0
            with Client(
                serve.frontend, timeout_s=1.0, curve_server_key=broker_public, curve_secret_key=client_secret
            ) as client:
                while True:
                    assert serve.process is not None and serve.process.poll() is None, log_path.read_text()
                    try:
                        if client.control("stats")["models"]["echo"]["workers"] >= 1:
                            break
                    except BatcherError:
                        pass  # not up yet
                    if time.monotonic() > deadline:
                        pytest.fail(f"CURVE broker not ready:\n{log_path.read_text(errors='replace')}")
                    time.sleep(0.05)
            yield serve, keys
        finally:
            serve.stop()


def _parse(stdout: str) -> tuple[list[dict[str, str]], tuple[int, ...]]:
    """The reply lines (id, ok, rest) and the summary counts of a client's output."""
    replies, summary = [], None
    for line in stdout.splitlines():
        if m := LINE.match(line):
            replies.append(m.groupdict())
        elif m := SUMMARY.match(line):
            summary = tuple(int(x) for x in m.groups())
        else:
            pytest.fail(f"unexpected output line {line!r}")
    assert summary is not None, f"no summary line in:\n{stdout}"
    return replies, summary


@integration
def test_every_request_answered_with_its_output(example: list[str], broker: ServeProcess) -> None:
    res = _run([*example, "-e", broker.frontend, "-n", "5", "-t", "10000"])
    assert res.returncode == 0, res.stderr
    replies, summary = _parse(res.stdout)
    assert summary == (5, 5, 5, 0)
    assert sorted(int(r["id"]) for r in replies) == [1, 2, 3, 4, 5]
    for r in replies:
        assert r["ok"] == "true"
        assert re.fullmatch(rf'output="hello {r["id"]}" batch_size=[1-5]', r["rest"]), r["rest"]


@integration
def test_a_tensor_is_sent_and_read_back(example: list[str], broker: ServeProcess) -> None:
    """-T: each request's input is FP32 [2] holding (id, id + 0.5); echo sends it back and
    the client prints it in its JSON form (docs/protocol.md 3.1)."""
    res = _run([*example, "-e", broker.frontend, "-n", "3", "-T"])
    assert res.returncode == 0, res.stderr
    replies, summary = _parse(res.stdout)
    assert summary == (3, 3, 3, 0)
    for r in replies:
        output = re.fullmatch(r"output=(\{.*\}) batch_size=[1-3]", r["rest"])
        assert output, r["rest"]
        i = int(r["id"])
        assert json.loads(output.group(1)) == {"datatype": "FP32", "shape": [2], "data": [i, i + 0.5]}


@integration
def test_model_named_explicitly(example: list[str], broker: ServeProcess) -> None:
    res = _run([*example, "-e", broker.frontend, "-n", "1", "-m", "echo"])
    assert res.returncode == 0, res.stderr
    replies, summary = _parse(res.stdout)
    assert summary == (1, 1, 1, 0)
    assert replies[0]["id"] == "1"
    assert replies[0]["rest"].startswith('output="hello 1"')


@integration
def test_error_replies_are_printed_and_exit_1(example: list[str], broker: ServeProcess) -> None:
    res = _run([*example, "-e", broker.frontend, "-n", "2", "-m", "nope"])
    assert res.returncode == 1, res.stderr
    replies, summary = _parse(res.stdout)
    assert summary == (2, 2, 0, 2)
    assert sorted(r["id"] for r in replies) == ["1", "2"]
    for r in replies:
        assert r["ok"] == "false"
        assert r["rest"] == "error=unknown_model message=\"no worker serves model 'nope' (models: echo)\""


@integration
def test_curve_with_an_allowed_key(
    example: list[str], curve_broker: tuple[ServeProcess, dict[str, str]]
) -> None:
    serve, keys = curve_broker
    cmd = [
        *example,
        "-e",
        serve.frontend,
        "-n",
        "3",
        "-k",
        keys["broker_public"],
        "-s",
        keys["client_secret"],
    ]
    res = _run(cmd)
    assert res.returncode == 0, res.stderr
    replies, summary = _parse(res.stdout)
    assert summary == (3, 3, 3, 0)
    assert sorted(r["rest"].split(" batch_size=")[0] for r in replies) == [
        f'output="hello {i}"' for i in (1, 2, 3)
    ]


@integration
def test_curve_refuses_keys_off_the_allow_list(
    example: list[str], curve_broker: tuple[ServeProcess, dict[str, str]]
) -> None:
    serve, keys = curve_broker
    for extra in (["-k", keys["broker_public"]], []):  # a throwaway key pair; no CURVE at all
        res = _run([*example, "-e", serve.frontend, "-n", "1", "-t", "500", *extra])
        assert res.returncode == 2, (extra, res.stdout, res.stderr)
        sent, replies, ok, errors = _parse(res.stdout)[1]
        # A refused CURVE handshake can leave the socket unwritable: then nothing is sent.
        assert sent in (0, 1) and (replies, ok, errors) == (0, 0, 0)


@integration
def test_no_broker_is_a_timeout_exit_2(example: list[str]) -> None:
    res = _run([*example, "-e", free_tcp_address(), "-n", "2", "-t", "300"])
    assert res.returncode == 2
    _, summary = _parse(res.stdout)
    assert summary == (2, 0, 0, 0)
    assert "timeout" in res.stderr


@integration
def test_bad_usage_exits_2(example: list[str]) -> None:
    res = _run([*example, "-n", "0"])
    assert res.returncode == 2
    assert res.stdout == ""


# --- docs/protocol.md names every example -----------------------------------------------------------


def _ignored_by(gitignore: Path) -> list[tuple[PurePosixPath, str]]:
    """The patterns of an examples/ .gitignore (build outputs such as examples/c/client,
    node_modules/, package-lock.json), each with the folder it applies under."""
    base = PurePosixPath(gitignore.parent.relative_to(ROOT).as_posix())
    lines = (line.strip() for line in gitignore.read_text().splitlines())
    return [(base, line) for line in lines if line and not line.startswith(("#", "!"))]


def _is_ignored(path: PurePosixPath, patterns: list[tuple[PurePosixPath, str]]) -> bool:
    """Whether a .gitignore pattern covers `path` or a folder it is in: "/x" only right
    under the .gitignore's folder, "x/" only a folder, "x" a name at any depth."""
    for base, pattern in patterns:
        if not path.is_relative_to(base):
            continue
        parts = path.relative_to(base).parts  # folders, then the file's name
        indices = range(len(parts) - 1 if pattern.endswith("/") else len(parts))
        if pattern.startswith("/"):
            indices = indices[:1]
        if any(fnmatchcase(parts[i], pattern.strip("/")) for i in indices):
            return True
    return False


def example_files() -> list[str]:
    """Every file under examples/ that a reader should find in docs/protocol.md, as a path
    from the repository's root: no dotfiles (.gitignore), nothing under node_modules or
    __pycache__, nothing an examples/ .gitignore names (build outputs)."""
    patterns = [p for g in sorted(EXAMPLES.rglob(".gitignore")) for p in _ignored_by(g)]
    out = []
    for path in sorted(EXAMPLES.rglob("*")):
        rel = PurePosixPath(path.relative_to(ROOT).as_posix())
        if not path.is_file() or any(part.startswith(".") or part in SKIPPED_DIRS for part in rel.parts):
            continue
        if not _is_ignored(rel, patterns):
            out.append(str(rel))
    return out


def test_every_example_file_is_named_in_protocol_md() -> None:
    """A new example cannot go undocumented: docs/protocol.md (section 10) names each file
    under examples/ by its path from the repository's root."""
    files = example_files()
    assert "examples/c/client.c" in files and "examples/node/client.js" in files
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    # A name must end there: "examples/node/client" is not named by "examples/node/client.js".
    missing = [f for f in files if not re.search(re.escape(f) + r"(?![\w/-]|\.\w)", text)]
    assert not missing, f"docs/protocol.md does not name {missing}: describe and link them in section 10"


def test_example_links_of_protocol_md_lead_to_files() -> None:
    """Each relative link of docs/protocol.md into examples/ names an existing file, and the
    link's text is the path it leads to."""
    links = re.findall(r"\[([^\]]+)\]\((\.\./examples/[^)#\s]+)\)", PROTOCOL_MD.read_text(encoding="utf-8"))
    assert links, "docs/protocol.md links to no example"
    for text, target in links:
        path = (PROTOCOL_MD.parent / target).resolve()
        assert path.is_file(), f"docs/protocol.md links to {target}, which does not exist"
        assert text == path.relative_to(ROOT).as_posix(), (text, target)


def test_example_file_filter_reads_the_gitignore_patterns() -> None:
    """Build outputs are left out as the examples' .gitignore files say, and nothing else."""
    patterns = [
        (PurePosixPath("examples/c"), "/client"),
        (PurePosixPath("examples/node"), "node_modules/"),
        (PurePosixPath("examples/node"), "package-lock.json"),
    ]
    ignored = ["examples/c/client", "examples/node/package-lock.json", "examples/node/node_modules/x/y.js"]
    kept = [
        "examples/c/client.c",
        "examples/c/sub/client",
        "examples/node/client.js",
        "examples/python/client",
    ]
    for path in ignored:
        assert _is_ignored(PurePosixPath(path), patterns), path
    for path in kept:
        assert not _is_ignored(PurePosixPath(path), patterns), path


# --- the minimal worker of docs/protocol.md 6.9 ------------------------------------------------------


def _minimal_worker_source(backend: str) -> str:
    """The Python block of docs/protocol.md's "6.9 A minimal worker", pointed at `backend`."""
    text = PROTOCOL_MD.read_text()
    section = text[text.index("### 6.9 A minimal worker") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert 'BROKER, MODEL = "tcp://127.0.0.1:5556", "upper"' in code
    return code.replace('"tcp://127.0.0.1:5556"', repr(backend))


@integration
def test_the_minimal_worker_of_protocol_md_serves_small_and_large_bodies(spawn, zctx, tmp_path) -> None:
    from tests.conftest import _GROUPS, kill_group
    from tests.helpers import start_broker

    frontend, backend = start_broker(spawn, zctx, "--model", "upper", "--max-wait-ms", "20")
    script = tmp_path / "minimal_worker.py"
    script.write_text(_minimal_worker_source(backend))
    worker = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    _GROUPS.add(worker.pid)
    try:
        inputs = ["abc", "x" * 70_000, "déjà", "y" * 10]  # one over 64 KiB: the batch comes one frame each
        with Client(frontend, timeout_s=20, context=zctx) as client:
            pending = [client.submit(x, model="upper") for x in inputs]
            outputs = [p.result() for p in pending]
            assert outputs == [x.upper() for x in inputs]
            assert client.request("small", model="upper") == "SMALL"
    finally:
        kill_group(worker.pid)
        worker.wait(5)


@integration
def test_the_digits_example_serves_exactly_the_offline_predictions() -> None:
    for module in ("onnxruntime", "sklearn", "skl2onnx"):
        pytest.importorskip(module, reason=f"{module} is not installed (the test extra has it)")
    result = _run([sys.executable, str(EXAMPLES / "digits" / "digits.py")], cwd=ROOT, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "served predictions (labels and probabilities) equal to offline: 360 of 360" in result.stdout
    accuracy = float(re.search(r"accuracy (\d\.\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9, result.stdout
