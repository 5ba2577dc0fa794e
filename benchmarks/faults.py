"""Fault-injection helpers of benchmarks/reliability.py and benchmarks/soak.py: a model that
crashes its worker, the soak's model, a `batcher serve` whose log is kept, steady DEALER
load, and malformed messages.

reliability.py imports this module by name (`from faults import ...`, this folder is
first on sys.path when it runs); its workers load `benchmarks.faults:CrashAtStartup`,
which `serve` finds through the checkout it puts on their PYTHONPATH. Nothing here comes
from tests/; tests/reliability_models.py imports these helpers from here.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import msgpack
import psutil
import zmq

from batcher.serve.launcher import ServeProcess

#: The model spec of CrashAtStartup, for `serve --model`.
CRASHING = "benchmarks.faults:CrashAtStartup"


class CrashAtStartup:
    """A model whose constructor kills its process, as a native crash while loading weights
    (a segfault, an abort in a CUDA library, the OOM killer) would: its worker dies at every
    start with no Python exception to report, and `serve` must give up on it.

    (A constructor that raises is reported by the worker as a model that cannot be loaded,
    which `serve` may treat as a configuration error rather than retrying.)"""

    def __init__(self, gpu: int | None) -> None:
        os.write(2, f"CrashAtStartup: simulated crash loading the weights for gpu {gpu}\n".encode())
        os._exit(3)

    def __call__(self, inputs: list[Any]) -> list[Any]:  # pragma: no cover - never built
        return list(inputs)


#: The soak model's cost (benchmarks/soak.py): a batch of n takes 20 ms + 2.5 ms x n.
SOAK_BASE_S, SOAK_PER_ITEM_S = 0.020, 0.0025


def soak_model(inputs: list[Any]) -> list[Any]:
    """The soak's model: costs like `sim`, answers each input {"tag", "payload"} with its tag
    and the payload's length (so a reply proves it belongs to its request without sending
    a megabyte back), and hangs, heartbeat thread alive, on a batch holding {"hang": true}."""
    if any(isinstance(x, dict) and x.get("hang") for x in inputs):
        time.sleep(3600)
    time.sleep(SOAK_BASE_S + SOAK_PER_ITEM_S * len(inputs))
    return [{"tag": x.get("tag"), "bytes": len(x.get("payload", b""))} for x in inputs]


# --- a `batcher serve` whose log is kept --------------------------------------------------------


class LoggedServe:
    """`batcher serve` on free loopback ports (batcher.serve.launcher.ServeProcess, in a process
    group of its own) with its stderr, the log, in a file; `stop()` leaves nothing behind."""

    def __init__(self, args: Sequence[str], log_path: str | os.PathLike[str], log_level: str = "INFO"):
        self.log_path = Path(log_path)
        self.sp = ServeProcess(list(args), log_level=log_level)
        self._log_file: IO[bytes] | None = None

    def start(self, workers: int, timeout_s: float = 30.0) -> LoggedServe:
        """Start it and wait until `workers` workers have joined."""
        self._log_file = self.log_path.open("wb")
        self.sp.stderr = self._log_file
        self.sp.start()
        self.sp.wait_ready(workers, timeout_s=timeout_s)
        return self

    @property
    def process(self) -> Any:
        assert self.sp.process is not None, "not started"
        return self.sp.process

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def frontend(self) -> str:
        return self.sp.frontend

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> set[int]:
        """The pids of serve's live (not zombie) worker processes."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return set()
        out = set()
        for p in children:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.add(p.pid)
        return out

    def group_alive(self) -> list[int]:
        """Pids of the process group still running (serve and its workers)."""
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == self.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
        return out

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGCONT the group (a stopped worker would hold the stop up), then SIGTERM it,
        SIGKILL after `timeout_s`; returns serve's exit code."""
        try:
            if self.sp.process is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.sp.process.pid, signal.SIGCONT)
            return self.sp.stop(timeout_s=timeout_s)
        finally:
            if self._log_file is not None:
                self._log_file.close()

    def __enter__(self) -> LoggedServe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- steady load from DEALER clients ----------------------------------------------------------------


class DealerLoad:
    """A few DEALER clients, each keeping `depth` requests in flight (closed loop). Request
    ids are unique strings ("c1-42"), inputs {"tag": id, "sleep": sleep_s} (sim and echo
    send them back). Records every reply each id gets, and when."""

    def __init__(
        self, ctx: zmq.Context[Any], address: str, clients: int = 3, depth: int = 4, sleep_s: float = 0.0
    ) -> None:
        self.socks: list[zmq.Socket[Any]] = []
        for _ in range(clients):
            sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.socks.append(sock)
        self.depth = depth
        self.sleep_s = sleep_s
        self.sending = True
        self.sent: dict[str, int] = {}  # id -> index of the socket it went out on
        self.sent_at: dict[str, float] = {}
        self.replies: dict[str, list[dict[str, Any]]] = {}
        self.answered_at: dict[str, float] = {}  # first reply
        self.foreign: list[tuple[int, dict[str, Any]]] = []  # replies to ids a socket never sent
        self._outstanding = [0] * clients
        self._next = [0] * clients
        self._poller = zmq.Poller()
        for sock in self.socks:
            self._poller.register(sock, zmq.POLLIN)

    def _top_up(self) -> None:
        for i, sock in enumerate(self.socks):
            while self.sending and self._outstanding[i] < self.depth:
                tag = f"c{i}-{self._next[i]}"
                self._next[i] += 1
                sock.send_multipart([b"", pack({"id": tag, "input": {"tag": tag, "sleep": self.sleep_s}})])
                self.sent[tag] = i
                self.sent_at[tag] = time.monotonic()
                self._outstanding[i] += 1

    def burst(self) -> None:
        """Send `depth` requests per client at once, and no more after them."""
        self.sending = True
        self._top_up()
        self.sending = False

    def step(self, timeout_ms: int = 10) -> None:
        """Send up to `depth` per client, then take the replies that come within `timeout_ms`."""
        self._top_up()
        for sock, _ in self._poller.poll(timeout_ms):
            i = self.socks.index(sock)
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                tag = reply.get("id")
                if self.sent.get(tag) != i:
                    self.foreign.append((i, reply))
                    continue
                if tag not in self.replies:
                    self._outstanding[i] -= 1
                    self.answered_at[tag] = time.monotonic()
                self.replies.setdefault(tag, []).append(reply)
        self._top_up()

    def run_until(self, predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Keep the load going until `predicate()` (checked every ~20 ms) is truthy."""
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        while True:
            self.step()
            now = time.monotonic()
            if now >= next_check:
                value = predicate()
                if value:
                    return value
                next_check = now + 0.02
            if now > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s}s (under load)")

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()

    def outstanding(self) -> set[str]:
        return {t for t in self.sent if t not in self.replies}

    def drain(self, timeout_s: float) -> bool:
        """Stop sending; wait until every request has its reply. False if some never came."""
        self.sending = False
        deadline = time.monotonic() + timeout_s
        while any(self._outstanding):
            if time.monotonic() > deadline:
                return False
            self.step(50)
        return True

    def summary(self) -> dict[str, Any]:
        """Requests sent; answered ok (with their own result), with each error code, with
        another request's result (`wrong`); never answered (`lost`); answered twice or more."""
        errors: dict[str, int] = {}
        ok = wrong = 0
        for tag, replies in self.replies.items():
            reply = replies[0]
            if reply.get("ok"):
                output = reply.get("output") or {}
                echoed = output.get("input", output.get("echo")) if isinstance(output, dict) else None
                if isinstance(echoed, dict) and echoed.get("tag") == tag:
                    ok += 1
                else:
                    wrong += 1
            else:
                code = str(reply.get("error", {}).get("code"))
                errors[code] = errors.get(code, 0) + 1
        return {
            "sent": len(self.sent),
            "ok": ok,
            "errors": errors,
            "wrong": wrong,
            "lost": len(self.outstanding()),
            "duplicated": sum(1 for r in self.replies.values() if len(r) > 1),
            "foreign": len(self.foreign),
        }

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


# --- malformed messages ---------------------------------------------------------------------------

# Protocol constants, spelled out rather than imported, so the generators encode the documented
# wire format (docs/protocol.md) and not whatever batcher.wire.protocol happens to say.
WORKER_PROTOCOL = b"BATCHER-W2"
READY, BATCH, REPLY, HEARTBEAT, DISCONNECT = b"\x01", b"\x02", b"\x03", b"\x04", b"\x05"


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _decodes_to_request(body: bytes) -> bool:
    """Whether `body` might be accepted: a msgpack map (random content rarely is one)."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:
        return False
    return isinstance(msg, dict)


NAN = math.nan
#: For each request field, values of the wrong type (or out of range) that make a request
#: a bad_request whatever the other fields say.
WRONG_FIELDS: dict[str, list[Any]] = {
    "id": [1.5, True, False, [1], {"a": 1}, b"bytes-id", NAN],
    "op": [1, None, True, [b"infer"], {"op": "infer"}, b"infer", 2.5, "no-such-op"],
    "model": [1, True, [b"sim"], {"m": 1}, b"sim", 0.5],
    "timeout_ms": ["100", True, -1, -0.001, NAN, [100], {"ms": 1}, b"1"],
    "priority": ["1", True, None, NAN, [1], {"p": 1}, b"1"],
}


def _valid_request(rng: random.Random) -> dict[str, Any]:
    return {"id": rng.randrange(1 << 30), "input": rng.random(), "model": "echo", "timeout_ms": 1000}


def _too_many_frames(rng: random.Random) -> list[bytes]:
    body = pack(_valid_request(rng))
    shape = rng.randrange(4)
    if shape == 0:  # delimiter, then two or more bodies
        return [b"", *[body] * rng.randint(2, 5)]
    if shape == 1:  # no delimiter, two or more non-empty frames
        return [body, *[rng.randbytes(rng.randint(1, 20)) for _ in range(rng.randint(1, 4))]]
    if shape == 2:  # two delimiters, then a body
        return [b"", b"", body]
    return [b"", body, b""]


def _body(rng: random.Random) -> tuple[str, bytes]:
    """A malformed request body: (category, bytes)."""
    kind = rng.randrange(9)
    if kind == 0:
        while True:
            body = rng.randbytes(rng.randint(1, 64))
            if not _decodes_to_request(body):
                return "random bytes", body
    if kind == 1:  # bytes msgpack never uses, or a type byte with nothing after it
        return "invalid msgpack", rng.choice([b"\xc1", b"\x81\xc1\xc0", b"\xd9", b"\xdf", b"\xc7\x05"])
    if kind == 2:
        full = pack(_valid_request(rng))
        return "truncated msgpack", full[: rng.randint(1, len(full) - 1)]
    if kind == 3:
        return "trailing bytes", pack(_valid_request(rng)) + rng.randbytes(rng.randint(1, 8))
    if kind == 4:
        return "not a map", pack(rng.choice([[1, 2], 7, "text", None, b"bin", 1.5, True, [{"input": 1}]]))
    if kind == 5:
        req = _valid_request(rng)
        field = rng.choice(list(WRONG_FIELDS))
        req[field] = rng.choice(WRONG_FIELDS[field])
        return f"wrong type: {field}", pack(req)
    if kind == 6:
        req = _valid_request(rng)
        del req["input"]
        return "no input", pack(req)
    if kind == 7:  # a header that announces more than the message holds
        return "huge length header", rng.choice(
            [
                b"\xdf\xff\xff\xff\xff",
                b"\xdd\xff\xff\xff\xff",
                b"\xdb\xff\xff\xff\xff",
                b"\xc6\xff\xff\xff\xff",
            ]
        )
    return "empty body", b""


def malformed_frontend(rng: random.Random) -> Iterator[tuple[str, list[bytes]]]:
    """An endless stream of (category, frames a DEALER sends) that must each be answered
    with bad_request: wrong frame layouts and malformed bodies, behind a delimiter or not."""
    while True:
        layout = rng.randrange(10)
        if layout == 0:
            yield "no frames after delimiter", [b""]
        elif layout == 1:
            yield "too many frames", _too_many_frames(rng)
        elif layout == 2:
            yield "empty frames", [b""] * rng.randint(2, 6)
        else:
            category, body = _body(rng)
            if body and rng.random() < 0.3:
                yield category, [body]  # DEALER without delimiter
            else:
                yield category, [b"", body]


def rare_frontend() -> list[tuple[str, list[bytes]]]:
    """Big malformed messages, sent a few times each (under 1 MiB, the --max-message-bytes
    that reliability.py's malformed_input sets)."""
    nested = b"\x91" * 100_000 + b"\xc0"
    return [
        ("deeply nested arrays", [b"", nested]),
        ("deeply nested input", [b"", b"\x81\xa5input" + nested]),
        ("deeply nested maps", [b"", b"\x81\xa1k" * 50_000 + b"\xc0"]),
        ("huge map", [b"", pack({f"k{i}": i for i in range(40_000)})]),
        ("huge array", [b"", pack(list(range(100_000)))]),
        ("map with unhashable keys", [b"", b"\x81\x91\x01\x01"]),
        ("invalid utf-8 in a str", [b"", b"\x81\xa5input\xa2\xff\xfe"]),
    ]


def bad_ready_info(rng: random.Random) -> bytes:
    """READY info that must be refused: not a map, or a model/slots of the wrong type."""
    return rng.choice(
        [
            rng.randbytes(rng.randint(0, 16)),
            pack([1, 2]),
            pack("sim"),
            pack({}),
            pack({"model": 1}),
            pack({"model": ""}),
            pack({"model": None, "gpu": 0}),
            pack({"model": ["sim"]}),
            pack({"model": "sim", "slots": "1"}),
            pack({"model": "sim", "slots": 1.5}),
            pack({"model": "sim", "slots": [1]}),
            b"\x81\xa5model",  # truncated
        ]
    )


def _reply_header(rng: random.Random) -> bytes:
    return rng.choice(
        [
            pack([rng.randrange(1 << 40), 1.0, [3]]),
            pack([rng.randrange(1 << 40), -1, []]),
            pack(["batch", "ms", "lengths"]),
            pack([[1], 0, [1]]),  # an unhashable batch id
            pack([1, 2]),
            pack({"batch": 1}),
            rng.randbytes(rng.randint(0, 12)),
        ]
    )


def malformed_backend_unknown(rng: random.Random) -> Iterator[tuple[str, list[bytes], bool]]:
    """Messages from a peer that never sent a valid READY: (category, frames a DEALER sends,
    whether the broker must answer DISCONNECT). Anything in the worker protocol from an
    unknown peer is answered DISCONNECT, except a (refused) READY and a DISCONNECT."""
    while True:
        kind = rng.randrange(8)
        if kind == 0:
            frames = [rng.randbytes(rng.randint(0, 32)) for _ in range(rng.randint(1, 4))]
            if frames[0] == WORKER_PROTOCOL:
                continue
            yield "random frames", frames, False
        elif kind == 1:
            proto = rng.choice([b"BATCHER-W0", b"batcher-w1", b"", b"BATCHER-W1 ", b"HTTP/1.1"])
            yield "wrong protocol frame", [proto, rng.choice([READY, HEARTBEAT, REPLY])], False
        elif kind == 2:
            yield "protocol frame alone", [WORKER_PROTOCOL], False
        elif kind == 3:
            yield "fake READY with bad info", [WORKER_PROTOCOL, READY, bad_ready_info(rng)], False
        elif kind == 4:
            yield "heartbeat from an unknown peer", [WORKER_PROTOCOL, HEARTBEAT], True
        elif kind == 5:
            frames = [WORKER_PROTOCOL, REPLY, _reply_header(rng), rng.randbytes(rng.randint(0, 16))]
            yield "reply from an unknown peer", frames, True
        elif kind == 6:
            command = rng.choice([BATCH, b"\x00", b"\x06", b"\xff", b"", b"READY"])
            yield "unknown command", [WORKER_PROTOCOL, command, *[b"x"] * rng.randint(0, 2)], True
        else:  # READY with the wrong number of frames: not a READY, so not from a known worker
            extra = [pack({"model": "sim"})] * rng.choice([0, 2])
            yield "READY with wrong frame count", [WORKER_PROTOCOL, READY, *extra], True
