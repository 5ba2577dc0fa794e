"""Every fenced snippet of README.md and docs/deployment.md runs as written (issue 28 item 21),
against real processes on free loopback ports, so that no snippet drifts from the code.

What a fence is, by the HTML comment `<!-- snippet: KIND ... -->` among the comment and blank
lines just above it (other comments, such as `<!-- test-command -->`, may sit between):

- no marker: a `sh` fence runs command by command with bash, each command to exit 0; a
  `python` fence runs as a script with the project's python. Any other fence without a
  marker fails `test_every_fence_is_run_or_marked`, as does an unmarked `sh` fence that
  starts a server or installs packages (pip, venv, apt, npm): a new snippet cannot go
  untested, nor install into the test's environment, by accident.
- `server`: a `sh` fence whose `batcher serve|broker|worker|gateway` commands (a trailing `&`
  dropped) are started in the background, each in a process group of its own, and waited on:
  `serve` with `batcher ready` (and its HTTP port's /v2/health/ready if it has one), `broker`
  until it answers `stats`, `worker` until the broker lists its pid, `gateway` until its
  HTTP port is ready. The fence's other commands run as clients, in order.
- `file NAME`: written to NAME in the snippets' directory (a model module, say).
- `output`: what the last command of the previous fence printed, one JSON value a line: the
  line with the fence's `id` (else the last) has the fence's keys, recursively, and values of
  the same JSON types (not the same values: timings differ); every line has its top-level keys.
- `skip REASON`: not run; `test_skipped_snippet` reports it with its reason.
- `name=N` names a fence; `after=N` on another runs fence N first, in the same directory.

Snippets are run in groups, one test each (so each has the suite's 60 s timeout): a group
is a server fence and the fences that follow it up to the next server fence that comes after
a client (consecutive server fences, such as a broker and then its workers, share a group;
a `file` fence goes with the group of the fence after it). Each group runs in a fresh
directory and ends with its servers' process groups killed.

Addresses are rewritten, mechanically: every `HOST:PORT` whose PORT is one of the docs'
defaults (5555, 5556, 8000, 8001, 9100) becomes `127.0.0.1:P`, P a free port picked per
(HOST, PORT), where 0.0.0.0, 127.0.0.1, localhost, HOST and A (the deployment's host A) are
all one host, and any other host (the deployment's D) gets ports of its own where nothing
listens (so its MultiClient snippet runs with one of its two brokers down, as it promises to);
so is `--http-port|--grpc-port|--metrics-port PORT`. Commands that use the
default addresses get the free ones from BATCHER_FRONTEND, BATCHER_BACKEND, BATCHER_CONNECT
and BATCHER_WORKER_CONNECT. A default port left in a rewritten snippet fails its test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from batcher.serve.launcher import free_tcp_address
from tests.conftest import kill_group
from tests.helpers import broker_stats, wait_until

ROOT = Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/deployment.md")
BIN = Path(sys.executable).parent
#: `batcher` subcommands that run until stopped.
LONG_RUNNING = {"serve", "broker", "worker", "gateway"}
#: Languages run without a marker.
RUNNABLE = {"sh", "python"}
KINDS = {"run", "server", "file", "output", "skip"}
DEFAULT_PORTS = ("5555", "5556", "8000", "8001", "9100")
#: Host names that are all the one machine the snippets run on.
LOCAL_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost", "HOST", "A"}
COMMAND_TIMEOUT_S = 30.0
START_TIMEOUT_S = 30.0

#: Commands no test runs: they would install into the test's own environment.
INSTALLS = re.compile(r"\bpip3? install\b|-m venv\b|\bapt(-get)? install\b|\bnpm install\b")
MARKER = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->")
ADDRESS = re.compile(r"\b(0\.0\.0\.0|127\.0\.0\.1|localhost|HOST|[A-E]):(" + "|".join(DEFAULT_PORTS) + r")\b")
PORT_FLAG = re.compile(r"(--(?:http|grpc|metrics)-port[ =])(" + "|".join(DEFAULT_PORTS) + r")\b")


@dataclass
class Fence:
    doc: str
    line: int  # of the opening ```
    lang: str
    text: str
    kind: str  # "run" when unmarked
    reason: str = ""
    options: dict[str, str] = field(default_factory=dict)
    marked: bool = False

    @property
    def label(self) -> str:
        return f"{self.doc}:{self.line}"


def parse(doc: str) -> list[Fence]:
    """The top-level fences of a document, each with its marker (if any)."""
    lines = (ROOT / doc).read_text().splitlines()
    fences: list[Fence] = []
    i = 0
    while i < len(lines):
        opening = re.fullmatch(r"\s*```(\S*)\s*", lines[i])  # indented ones too (in a list)
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")
        fence = Fence(doc, i + 1, opening.group(1), body, "run")
        above = i - 1
        while above >= 0 and (not lines[above].strip() or lines[above].lstrip().startswith("<!--")):
            marker = MARKER.search(lines[above])
            if marker:
                mark(fence, marker.group(1))
                break
            above -= 1
        fences.append(fence)
        i = end + 1
    return fences


def mark(fence: Fence, marker: str) -> None:
    kind, _, rest = marker.partition(" ")
    fence.kind, fence.marked = kind, True
    if kind == "skip":
        fence.reason = rest.strip()
        return
    words = rest.split()
    if kind == "file" and words:
        fence.options["file"] = words.pop(0)
    for word in words:
        key, eq, value = word.partition("=")
        assert eq, f"{fence.label}: marker word {word!r} is not key=value"
        fence.options[key] = value


def commands(text: str) -> list[str]:
    """A sh fence's commands: backslash-continued lines joined, blank and comment lines dropped."""
    joined = text.replace("\\\n", " ")
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def long_running(command: str) -> list[str] | None:
    """The argv of a `batcher serve|broker|worker|gateway` command, its `&` dropped; else None."""
    words = shlex.split(command, comments=True)
    if words[-1:] == ["&"]:
        words = words[:-1]
    if len(words) >= 2 and words[0] == "batcher" and words[1] in LONG_RUNNING:
        return words
    return None


ALL = [fence for doc in DOCS for fence in parse(doc)]


@dataclass
class Group:
    fences: list[Fence] = field(default_factory=list)
    has_client: bool = False

    @property
    def label(self) -> str:
        first = next(f for f in self.fences if f.kind != "file")
        return f"{first.label}-{self.fences[-1].line}"


def groups(fences: list[Fence]) -> list[Group]:
    out: list[Group] = []
    pending: list[Fence] = []
    current: Group | None = None
    for fence in fences:
        if fence.kind == "skip" or (fence.kind == "run" and fence.lang not in RUNNABLE):
            continue  # the second: refused by test_every_fence_is_run_or_marked
        if fence.kind == "file":
            pending.append(fence)
            continue
        if fence.kind == "output":
            assert current is not None, f"{fence.label}: an output fence with no snippet before it"
            current.fences.append(fence)
            continue
        if (
            current is None
            or (fence.kind == "server" and current.has_client)
            or fence.doc != current.fences[0].doc
        ):
            current = Group()
            out.append(current)
        current.fences += [*pending, fence]
        pending = []
        if fence.kind == "run" or any(long_running(c) is None for c in commands(fence.text)):
            current.has_client = True
    assert not pending, f"file fences with no snippet after them: {[f.label for f in pending]}"
    return out


GROUPS = [g for doc in DOCS for g in groups([f for f in ALL if f.doc == doc])]
NAMED = {f.options["name"]: f for f in ALL if "name" in f.options}


# --- the checks without processes -------------------------------------------------------------


def test_every_fence_is_run_or_marked() -> None:
    """A fence nobody marked is run; one that cannot be run must say why not."""
    problems = []
    for f in ALL:
        if f.marked and f.kind not in KINDS:
            problems.append(f"{f.label}: unknown marker kind {f.kind!r} (one of {sorted(KINDS)})")
        elif f.kind == "skip" and not f.reason:
            problems.append(f"{f.label}: `skip` needs a reason")
        elif f.kind == "run" and f.lang not in RUNNABLE:
            problems.append(f"{f.label}: a ```{f.lang} fence with no <!-- snippet: ... --> marker is not run")
        elif f.kind == "run" and f.lang == "sh" and any(long_running(c) for c in commands(f.text)):
            problems.append(f"{f.label}: starts a server: mark it <!-- snippet: server -->")
        elif f.kind != "skip" and INSTALLS.search(f.text):
            problems.append(f"{f.label}: installs packages: mark it <!-- snippet: skip installs; ... -->")
        elif f.kind == "server" and not any(long_running(c) for c in commands(f.text)):
            problems.append(f"{f.label}: marked server but starts no batcher serve|broker|worker|gateway")
        elif f.kind == "file" and "file" not in f.options:
            problems.append(f"{f.label}: `file` needs a file name")
        for key in ("after",):
            if key in f.options and f.options[key] not in NAMED:
                problems.append(f"{f.label}: after={f.options[key]} names no fence")
    assert not problems, "\n".join(problems)
    assert len(GROUPS) >= 5 and sum(f.kind == "server" for f in ALL) >= 5  # the parser found them


@pytest.mark.parametrize("fence", [f for f in ALL if f.kind == "skip"], ids=lambda f: f.label)
def test_skipped_snippet(fence: Fence) -> None:
    pytest.skip(f"{fence.label} not run: {fence.reason}")


# --- running a group -------------------------------------------------------------------------


class Ports:
    """The free port standing for each (host, default port) of the docs."""

    def __init__(self) -> None:
        self.ports: dict[tuple[str, str], str] = {}

    def port(self, host: str, port: str) -> str:
        key = ("local" if host in LOCAL_HOSTS else host, port)
        if key not in self.ports:
            self.ports[key] = free_tcp_address().rsplit(":", 1)[1]
        return self.ports[key]

    def address(self, port: str) -> str:
        return f"tcp://127.0.0.1:{self.port('local', port)}"

    def rewrite(self, text: str) -> str:
        text = ADDRESS.sub(lambda m: f"127.0.0.1:{self.port(m.group(1), m.group(2))}", text)
        text = PORT_FLAG.sub(lambda m: m.group(1) + self.port("local", m.group(2)), text)
        left = [p for p in DEFAULT_PORTS if re.search(rf"(?<![\d.]){p}\b", text)]
        assert not left, f"default port(s) {left} left in the rewritten snippet:\n{text}"
        return text


class Run:
    """One group's directory, environment and the process groups it started."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.ports = Ports()
        self.env = dict(os.environ)
        self.env.update(
            PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            BATCHER_FRONTEND=self.ports.address("5555"),
            BATCHER_CONNECT=self.ports.address("5555"),
            BATCHER_BACKEND=self.ports.address("5556"),
            BATCHER_WORKER_CONNECT=self.ports.address("5556"),
        )
        self.pgids: list[int] = []
        self.logs: list[Path] = []
        self.broker: tuple[str, str | None, str | None] | None = None  # frontend, CURVE keys
        self.ctx = zmq.Context()
        self.outputs: dict[int, str] = {}  # fence line -> its last command's stdout
        self.done: set[int] = set()

    # -- processes --

    def client(self, command: str, fence: Fence) -> str:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=self.dir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            out, err = proc.communicate()
            pytest.fail(
                f"{fence.label}: {command!r} did not end within {COMMAND_TIMEOUT_S} s\n{err}{self.tails()}"
            )
        finally:
            kill_group(proc.pid, timeout_s=1)
        assert proc.returncode == 0, (
            f"{fence.label}: {command!r} exited {proc.returncode}\n{out}{err}{self.tails()}"
        )
        return out

    def python(self, fence: Fence, text: str) -> str:
        script = self.dir / f"snippet_{fence.line}.py"
        script.write_text(text)
        return self.client(f"{shlex.quote(sys.executable)} {script.name}", fence)

    def server(self, argv: list[str], fence: Fence) -> None:
        log = self.dir / f"server_{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(BIN / "batcher"), *argv[1:]],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pgids.append(proc.pid)
        command = argv[1]
        frontend = option(argv, "--frontend") or self.env["BATCHER_FRONTEND"]
        secret = option(argv, "--curve-secret-key")
        if command in ("serve", "broker"):
            public = secret.removesuffix("_secret") if secret else None
            self.broker = (frontend, public, secret)
        what = f"{fence.label}: {' '.join(argv)}"

        def alive() -> bool:
            return proc.poll() is None

        if command == "serve":
            ready = [
                str(BIN / "batcher"),
                "ready",
                "--connect",
                frontend,
                "--timeout-s",
                str(START_TIMEOUT_S),
            ]
            if secret:
                ready += ["--curve-server-key", secret.removesuffix("_secret"), "--curve-secret-key", secret]
            result = subprocess.run(
                ready,
                cwd=self.dir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S + 10,
            )
            assert result.returncode == 0, f"{what}: not ready: {result.stdout}{result.stderr}{self.tails()}"
        elif command == "broker":
            wait_until(lambda: not alive() or bool(self.stats()), START_TIMEOUT_S, f"{what} answering stats")
        elif command == "worker":
            wait_until(
                lambda: not alive() or f"/pid{proc.pid}/" in json.dumps(self.stats()),
                START_TIMEOUT_S,
                f"{what} listed by its broker",
            )
        http = option(argv, "--http-port")
        if http:
            wait_until(lambda: not alive() or http_ready(int(http)), START_TIMEOUT_S, f"{what}: HTTP ready")
        assert alive(), f"{what} exited {proc.returncode}{self.tails()}"

    def stats(self) -> dict[str, Any]:
        assert self.broker, "a worker started before any broker"
        frontend, public, secret = self.broker
        with contextlib.chdir(self.dir):
            return broker_stats(frontend, self.ctx, curve_server_key=public, curve_secret_key=secret)

    def tails(self) -> str:
        return "".join(
            f"\n--- {log.name} (last 2000 characters) ---\n{log.read_text(errors='replace')[-2000:]}"
            for log in self.logs
        )

    def close(self) -> None:
        for pgid in reversed(self.pgids):
            kill_group(pgid)
        self.ctx.destroy(linger=0)

    # -- fences --

    def fence(self, fence: Fence, previous: Fence | None) -> None:
        if fence.line in self.done:
            return
        self.done.add(fence.line)
        if "after" in fence.options:
            self.fence(NAMED[fence.options["after"]], None)
        text = self.ports.rewrite(fence.text)
        if fence.kind == "run" and fence.lang == "sh" and any(long_running(c) for c in commands(text)):
            pytest.fail(f"{fence.label}: starts a server: mark it <!-- snippet: server -->")
        if INSTALLS.search(text):
            pytest.fail(f"{fence.label}: installs: mark it <!-- snippet: skip installs; ... -->")
        if fence.kind == "file":
            (self.dir / fence.options["file"]).write_text(text)
        elif fence.kind == "output":
            assert previous is not None
            check_output(fence, self.outputs[previous.line])
        elif fence.lang == "python":
            self.outputs[fence.line] = self.python(fence, text)
        else:
            out = ""
            for command in commands(text):
                if fence.kind == "server" and (argv := long_running(command)):
                    self.server(argv, fence)
                else:
                    if shlex.split(command, comments=True)[:1] == ["curl"] and not has_curl():
                        pytest.skip(f"{fence.label}: curl is not installed")
                    out = self.client(command, fence)
            self.outputs[fence.line] = out


def option(argv: list[str], name: str) -> str | None:
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def has_curl() -> bool:
    return any((Path(p) / "curl").exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def shape(value: Any) -> Any:
    """A JSON value's keys, recursively: what an example output promises whatever the timings."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return [shape(value[0])]
    return type(value).__name__ if isinstance(value, (dict, list, str, bool)) else "number"


def check_output(fence: Fence, printed: str) -> None:
    shown = json.loads(fence.text)
    lines = [json.loads(line) for line in printed.splitlines() if line.strip()]
    assert lines, f"{fence.label}: the snippet before it printed nothing"
    same_id = [
        got for got in lines if isinstance(got, dict) and "id" in shown and got.get("id") == shown["id"]
    ]
    got = (same_id or lines)[-1]
    assert shape(got) == shape(shown), f"{fence.label}: printed {got}, the doc shows the form {fence.text}"
    for other in lines:
        assert sorted(other) == sorted(shown), f"{fence.label}: printed {other}, the doc shows {fence.text}"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.integration
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.label)
def test_snippets_run(group: Group, run: Run) -> None:
    """The group's fences, in order, against the servers its server fences start."""
    previous: Fence | None = None
    for fence in group.fences:
        run.fence(fence, previous)
        if fence.kind != "output":
            previous = fence
