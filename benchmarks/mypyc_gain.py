"""mypyc: what compiling the pure modules (wire, core) wins, measured, not assumed (issue 30).

Builds two copies of this checkout in a temporary directory, alike but for one thing:
in one, the pure modules are compiled with mypyc (the compiler mypy ships with), in
the other they stay Python. Nothing is built in the checkout itself. Both copies get
the same source changes first, the ones mypyc needs (below); then, alternately
(pure, compiled, pure, compiled ... for --rounds rounds, so drift on a shared machine
hits both alike):

- microbenchmarks of the hot functions, in a fresh process of each copy: the
  frontend's split_envelope + read_header, one batch's batch_frames, the REPLY's
  parse_reply_header + split_replies, and a scheduler cycle (enqueue 32, cut the
  batch, complete it), each in ns per request;
- the broker's CPU per small request: `batcher serve --model echo --workers 1` from
  each copy, loaded by `batcher bench` (from this checkout, the same client for both)
  at --concurrency 64 for --duration seconds; the serve process's user+system CPU
  time (psutil) over the load, divided by the replies.

What mypyc needs of today's sources, applied to both copies (the committed sources
are left as they are; docs/benchmarks-history.md, issue 30, says why):

- the msgspec.Struct classes of protocol.py, tensor.py and signature.py move to a
  module of their own that is not compiled: a compiled module builds a non-native
  class's __annotations__ from what mypyc makes of each annotation, `type` for a
  union (`int | str | None`) and a KeyError for a builtin (`memoryview`), so msgspec
  decodes against the wrong types (`Expected type, got str`) or the import fails;
- a compiled dataclass checks each field's type on construction, before
  __post_init__, with a TypeError of its own: BatchSettings refuses the str policy
  that the CLI and config pass it (`serve` exits at start), and the settings lose
  their precise ValueError messages (`heartbeat_liveness must be >= 1, got 2.5`);
  scheduler.NoSuchModel subclasses KeyError, which no native class may: each such
  class stays a Python class, `@mypyc_attr(native_class=False)` (mypy_extensions,
  a dependency of mypy), and its checks read its fields with getattr: compiled
  code checks a field's declared type as it reads it, even on a Python class;
- a class field annotated with a bare builtin such as `object` (QueuedRequest.id,
  WorkerInfo.gpu) raises KeyError when the compiled module is imported: spelled
  `builtins.object`;
- compiled code checks declared types where mypy cannot: the broker hands zmq.Frame
  objects (received without a copy, Any to mypy) to code that says `body: bytes`
  (QueuedRequest, protocol.id_of_refused ...), and a compiled QueuedRequest raises
  TypeError for every large request: those annotations become Any;
- a class constant of a native class (CostModel.DECAY) reads, from Python, as a
  getset_descriptor: declared ClassVar;
- `x not in (None, *BUCKET_BY)` crashes mypyc (an internal error on a starred
  expression in a tuple display): spelled without the star;
- signature.py is not compiled: mypyc stops with an internal error on it (the nested
  function in Signature.from_wire, a classmethod of a Python class).

With those, the unit tests of the compiled modules (UNIT_TESTS, 681 tests, a few of
which start a broker) pass on both copies (`--tests`).

Measured 2026-12-02 on the 2-core VM (4 runs, 20 rounds, load average 1 to 7: another
session shared the cores), compiled / pure: the scheduler cycle 0.62 to 0.64 (median of
each run; pure 1.1 to 1.2 us a request), the REPLY path 0.60 to 0.66, batch_frames 0.64
to 0.68, the frontend's header read 1.03 to 1.08 (msgspec's decode is most of it, and
compiling does not touch it); the broker's CPU per request 0.89 over all 20 rounds
(0.60 to 1.25; per run 0.84, 0.89, 0.93, 1.04). py-spy on the pure broker under the same
load puts 28% of its busy samples in these modules, which bounds the gain near what
was seen. Not adopted: about a tenth of the broker's CPU, for the changes above and a
build per CPython version (docs/benchmarks-history.md, issue 30).

    python benchmarks/mypyc_gain.py                 # 3 rounds, 5 s loads
    python benchmarks/mypyc_gain.py --tests         # also the unit tests on the compiled copy
    python benchmarks/mypyc_gain.py --rounds 5 --json out.json

It measures the flat layout it was written for (batcher/protocol.py, batcher/scheduler.py
...), the one mypyc was judged on: since the layered layout (issue 29) run it from a tree
of that commit, `git worktree add /tmp/flat 5fad766 && python /tmp/flat/benchmarks/mypyc_gain.py`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from batcher.cli.bench import LoadSettings, run_load  # noqa: E402
from batcher.client.sync import BatcherError, Client  # noqa: E402
from batcher.serve.launcher import free_tcp_address  # noqa: E402

#: The pure modules: wire (protocol, tensor and aligned, which protocol uses) and core
#: (scheduler, pool, streams). Not signature.py: mypyc fails on it with an internal
#: error (a nested function in a classmethod of a Python class: Signature.from_wire),
#: and no request of a model without a signature runs its code.
COMPILED = ["protocol", "tensor", "aligned", "scheduler", "pool", "streams"]
#: The modules whose msgspec.Struct classes move to an uncompiled module of their own.
WITH_STRUCTS = ["protocol", "tensor", "signature"]
#: Builtins that a compiled class body cannot name bare (a field annotated `object`
#: raises KeyError at import); int, str, float and the other primitives are fine.
BUILTIN_NAMES = {"object", "memoryview", "bytearray", "type", "complex", "range", "slice", "frozenset"}
#: The unit tests of the compiled modules (no process started): run with --tests.
UNIT_TESTS = [
    "tests/unit/wire/test_protocol.py",
    "tests/unit/wire/test_tensor.py",
    "tests/unit/wire/test_aligned.py",
    "tests/unit/core/test_scheduler.py",
    "tests/unit/core/test_scheduler_policy.py",
    "tests/integration/batching/test_buckets.py",
    "tests/unit/core/test_pool.py",
    "tests/unit/core/test_streams.py",
]


# --- the two copies --------------------------------------------------------------------------------


def copy_checkout(dest: Path) -> None:
    """The checkout's tracked files (as they are in the work tree) copied to `dest`."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO_ROOT / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))


def _is_struct(node: ast.stmt) -> bool:
    return isinstance(node, ast.ClassDef) and any(
        ast.unparse(b).startswith(("msgspec.Struct", "Struct")) for b in node.bases
    )


def move_structs(pkg: Path, module: str) -> None:
    """Move `module`'s top-level msgspec.Struct classes to `_<module>_structs.py` (with a
    copy of the module's imports) and import them back under their names."""
    path = pkg / f"{module}.py"
    lines = path.read_text().splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    structs = [n for n in tree.body if _is_struct(n)]
    if not structs:
        return
    moved: list[str] = []
    for node in structs:
        assert isinstance(node, ast.ClassDef) and node.end_lineno is not None
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        moved.append("".join(lines[start : node.end_lineno]) + "\n\n")
        for i in range(start, node.end_lineno):
            lines[i] = ""
    header = "".join(f"{ast.unparse(n)}\n" for n in imports)
    (pkg / f"_{module}_structs.py").write_text(header + "\n\n" + "".join(moved))
    last_import = max(n.end_lineno or n.lineno for n in imports)
    names = ", ".join(n.name for n in structs if isinstance(n, ast.ClassDef))
    lines[last_import - 1] += f"from batcher._{module}_structs import {names}\n"
    path.write_text("".join(lines))


def qualify_builtins(path: Path) -> None:
    """Spell a class field's bare builtin annotation (`id: object`) as `builtins.object`."""
    lines = path.read_text().splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    found = False
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.annotation, ast.Name)
                and node.annotation.id in BUILTIN_NAMES
            ):
                ann = node.annotation
                line = lines[ann.lineno - 1]
                lines[ann.lineno - 1] = line[: ann.col_offset] + "builtins." + line[ann.col_offset :]
                found = True
    if found:
        future = "from __future__ import annotations\n"
        lines[lines.index(future)] = future + "\nimport builtins\n"
        path.write_text("".join(lines))


def python_classes(path: Path) -> None:
    """Keep as Python classes (`@mypyc_attr(native_class=False)`) the settings that check
    their own fields (a __post_init__) and the subclasses of KeyError (which no native
    class may be), and make their checks read each field untyped (`getattr`): compiled
    code checks a field's declared type as it reads it, with a TypeError of its own,
    before the check could say what is wrong."""
    lines = path.read_text().splitlines(keepends=True)
    tree = ast.parse("".join(lines))
    found = False
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
        if "__post_init__" in methods or any(ast.unparse(b) == "KeyError" for b in cls.bases):
            checks = _checking_methods(methods)
            for method in checks:
                _untyped_reads(lines, method)
            first = min([cls.lineno, *(d.lineno for d in cls.decorator_list)]) - 1
            lines[first] = "@mypyc_attr(native_class=False)\n" + lines[first]
            found = True
    if found:
        future = "from __future__ import annotations\n"
        lines[lines.index(future)] = future + "\nfrom mypy_extensions import mypyc_attr\n"
        path.write_text("".join(lines))


def _checking_methods(methods: dict[str, ast.FunctionDef]) -> list[ast.FunctionDef]:
    """__post_init__ and the methods it calls on self, transitively."""
    todo, seen = ["__post_init__"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        for node in ast.walk(methods[name]):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "self"
            ):
                todo.append(node.func.attr)
    return [methods[n] for n in seen]


def _untyped_reads(lines: list[str], method: ast.FunctionDef) -> None:
    """Rewrite each `self.x` read in `method` (one line each) as `getattr(self, "x")`."""
    reads = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and isinstance(n.ctx, ast.Load)
        and n.lineno == n.end_lineno
    ]
    for n in sorted(reads, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        line = lines[n.lineno - 1]
        quote = "'" if 'f"' in line else '"'  # inside an f-string, the other quote (3.11)
        read = f"getattr(self, {quote}{n.attr}{quote})"
        lines[n.lineno - 1] = line[: n.col_offset] + read + line[n.end_col_offset :]


def frames_untyped(path: Path) -> None:
    """A body or frame annotated `bytes` as `Any`: the broker hands on zmq.Frame objects
    (received without a copy), which mypy sees as Any and compiled code refuses."""
    text = path.read_text()
    text = re.sub(r"\b(body|frame|frames|data): (list\[)?bytes\b", r"\1: \2Any", text)
    text = text.replace("tuple[list[bytes], bytes]", "tuple[list[Any], Any]")
    if "from typing import" in text and "Any" not in text.split("from typing import", 1)[1].split("\n", 1)[0]:
        text = text.replace("from typing import ", "from typing import Any, ", 1)
    elif "from typing import" not in text:
        text = text.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nfrom typing import Any\n",
            1,
        )
    path.write_text(text)


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path.name}: expected one {old!r} to rewrite for mypyc; the source changed")
    path.write_text(text.replace(old, new))


def prepare(dest: Path) -> None:
    """A copy of the checkout with the source changes mypyc needs (module docstring)."""
    copy_checkout(dest)
    pkg = dest / "batcher"
    for module in WITH_STRUCTS:
        move_structs(pkg, module)
    for module in COMPILED:
        qualify_builtins(pkg / f"{module}.py")
    replace_once(
        pkg / "scheduler.py",
        "if self.bucket_by not in (None, *BUCKET_BY):",
        "if self.bucket_by is not None and self.bucket_by not in BUCKET_BY:",
    )
    for module in COMPILED:
        python_classes(pkg / f"{module}.py")
        frames_untyped(pkg / f"{module}.py")
    text = (pkg / "scheduler.py").read_text()
    (pkg / "scheduler.py").write_text(
        text.replace("    DECAY = 0.97\n", "    DECAY: ClassVar[float] = 0.97\n")
    )
    text = (pkg / "scheduler.py").read_text()
    (pkg / "scheduler.py").write_text(text.replace("from typing import ", "from typing import ClassVar, ", 1))


def compile_copy(dest: Path) -> float:
    """mypyc the COMPILED modules of `dest` in place; returns the seconds it took."""
    mypyc = Path(sys.executable).with_name("mypyc")
    started = time.monotonic()
    out = subprocess.run(
        [str(mypyc), *(f"batcher/{m}.py" for m in COMPILED)],
        cwd=dest,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"mypyc failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return time.monotonic() - started


def env_for(copy: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(copy))


def check_loaded(copy: Path, compiled: bool) -> None:
    """The copy imports what it should: extension modules in the compiled one, .py in the other."""
    code = (
        "import json, importlib; "
        "print(json.dumps([importlib.import_module('batcher.' + m).__file__ for m in %r]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code % COMPILED], cwd=copy, env=env_for(copy), capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"importing the {'compiled' if compiled else 'pure'} copy failed:\n{out.stderr}")
    for path in json.loads(out.stdout):
        if path.endswith(".so") != compiled or not path.startswith(str(copy)):
            raise SystemExit(f"the {'compiled' if compiled else 'pure'} copy loaded {path}")


# --- microbenchmarks -------------------------------------------------------------------------------

MICRO = r"""
import json, time
from batcher.wire import protocol
from batcher.core.scheduler import BatchSettings, QueuedRequest, Scheduler

N = 32
body = protocol.pack({"id": 7, "model": "echo", "input": b"x" * 16})
frames = [b"client-identity", b"", body]
reply = protocol.ok_reply(7, b"x" * 16)
rep = protocol.reply_frames(1, 0.5, [reply] * N)
rep_header, rep_blob = rep[2], rep[3]
queue_ms = [0.1] * N

def frontend():
    for _ in range(N):
        env, b = protocol.split_envelope(frames)
        protocol.read_header(b)

def batch_out():
    protocol.batch_frames(1, queue_ms, [body] * N)

def reply_in():
    h = protocol.parse_reply_header(rep_header)
    protocol.split_replies(h.lengths, rep_blob)

s = Scheduler(BatchSettings(max_batch_size=N, max_wait_ms=0.0), models=["echo"])
s.add_worker(b"w", "echo")
now = [1000.0]
def scheduler_cycle():
    t = now[0] = now[0] + 0.001
    for i in range(N):
        s.enqueue("echo", QueuedRequest([b"c", b""], body, i, t))
    batches = s.due_batches(t)
    assert len(batches) == 1 and len(batches[0].requests) == N, batches
    s.complete(b"w", batches[0].batch_id, 0.0001, t)

def ns_per_request(fn, seconds):
    for _ in range(200):
        fn()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter_ns()
        for _ in range(200):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / (200 * N))
    return best

SECONDS = %(seconds)r
print(json.dumps({name: ns_per_request(fn, SECONDS) for name, fn in [
    ("frontend: split_envelope + read_header", frontend),
    ("backend out: batch_frames", batch_out),
    ("backend in: parse_reply_header + split_replies", reply_in),
    ("scheduler: enqueue + cut + complete", scheduler_cycle),
]}))
"""


def micro(copy: Path, seconds: float) -> dict[str, float]:
    """ns per request of each hot function (best of repeated runs) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MICRO % {"seconds": seconds}],
        cwd=copy,
        env=env_for(copy),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise SystemExit(f"microbenchmark failed in {copy}:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout)
    return result


# --- the broker's CPU per request ------------------------------------------------------------------


@contextlib.contextmanager
def serving(copy: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`batcher serve --model echo --workers 1` run from `copy`, ready; stopped by group."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    cmd = [sys.executable, "-m", "batcher", "serve", "--frontend", frontend, "--backend", backend]
    cmd += ["--model", "echo", "--workers", "1", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=copy, env=env_for(copy), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        with Client(frontend, timeout_s=1.0) as client:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"serve from {copy} exited with {proc.returncode}")
                with contextlib.suppress(BatcherError):
                    stats = client.control("stats")
                    if sum(m["workers"] for m in stats["models"].values()) >= 1:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("serve's worker not ready within 60 s")
                time.sleep(0.05)  # between readiness probes only
        yield proc, frontend
    finally:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def broker_cpu(copy: Path, duration_s: float, concurrency: int) -> dict[str, float]:
    """The serve process's CPU time per reply under a closed loop of small requests."""
    import psutil

    with serving(copy) as (proc, frontend):
        broker = psutil.Process(proc.pid)
        settings = LoadSettings(connect=frontend, concurrency=concurrency, duration_s=0.5, warmup_s=0.0)
        run_load(settings).check()  # warm-up, not counted
        before = broker.cpu_times()
        result = run_load(
            LoadSettings(connect=frontend, concurrency=concurrency, duration_s=duration_s, warmup_s=0.0)
        ).check()
        after = broker.cpu_times()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    replies = result.ok + sum(result.errors.values())
    return {
        "broker_us_per_request": 1e6 * cpu_s / max(replies, 1),
        "throughput_rps": result.throughput_rps,
        "mean_batch_size": result.mean_batch_size,
        "errors": float(sum(result.errors.values())),
        "lost": float(result.lost),
    }


# --- report ----------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="pure/compiled rounds (3)")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per load (5)")
    p.add_argument("--concurrency", type=int, default=64, help="closed loop's requests in flight (64)")
    p.add_argument("--micro-seconds", type=float, default=1.0, help="seconds per microbenchmark (1)")
    p.add_argument("--tests", action="store_true", help="run the unit tests on the compiled copy first")
    p.add_argument("--no-load", action="store_true", help="microbenchmarks only")
    p.add_argument("--keep", action="store_true", help="keep the temporary copies (prints where)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (REPO_ROOT / "batcher" / "scheduler.py").is_file():
        print(
            "mypyc_gain.py measures the flat layout (batcher/scheduler.py ...): run it from a tree of "
            "commit 5fad766 (git worktree add /tmp/flat 5fad766), see its docstring",
            file=sys.stderr,
        )
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="batcher-mypyc-"))
    try:
        pure, compiled = tmp / "pure", tmp / "compiled"
        prepare(pure)
        prepare(compiled)
        build_s = compile_copy(compiled)
        shutil.rmtree(compiled / "build", ignore_errors=True)
        check_loaded(pure, compiled=False)
        check_loaded(compiled, compiled=True)
        print(f"mypyc built {len(COMPILED)} modules in {build_s:.1f} s: {', '.join(COMPILED)}", flush=True)
        report: dict[str, Any] = {"build_s": build_s, "modules": COMPILED, "rounds": []}
        if args.tests:
            for copy in (compiled, pure):
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *UNIT_TESTS]
                started = time.monotonic()
                rc = subprocess.run(cmd, cwd=copy, env=env_for(copy), check=False).returncode
                took = time.monotonic() - started
                print(f"unit tests on the {copy.name} copy: exit {rc} in {took:.1f} s", flush=True)
                report[f"tests_{copy.name}"] = {"exit": rc, "seconds": took}
        for i in range(args.rounds):
            row: dict[str, Any] = {}
            for copy in (pure, compiled):
                row[copy.name] = {"micro_ns": micro(copy, args.micro_seconds)}
                if not args.no_load:
                    row[copy.name]["load"] = broker_cpu(copy, args.duration, args.concurrency)
            report["rounds"].append(row)
            line = f"round {i + 1}:"
            if not args.no_load:
                p_us, c_us = (row[k]["load"]["broker_us_per_request"] for k in ("pure", "compiled"))
                p_rps, c_rps = (row[k]["load"]["throughput_rps"] for k in ("pure", "compiled"))
                line += f" broker CPU/request pure {p_us:.1f} us, compiled {c_us:.1f} us"
                line += f" ({c_us / p_us:.3f}x);"
                line += f" req/s pure {p_rps:.0f}, compiled {c_rps:.0f};"
                p_b, c_b = (row[k]["load"]["mean_batch_size"] for k in ("pure", "compiled"))
                line += f" mean batch pure {p_b:.1f}, compiled {c_b:.1f};"
                line += f" load average {os.getloadavg()[0]:.1f}"
            print(line, flush=True)
        rounds = report["rounds"]
        print("\ncompiled / pure, median (min-max) over rounds:")
        for name in rounds[0]["pure"]["micro_ns"]:
            ratios = [r["compiled"]["micro_ns"][name] / r["pure"]["micro_ns"][name] for r in rounds]
            pure_ns = statistics.median(r["pure"]["micro_ns"][name] for r in rounds)
            print(f"  {name}: {spread(ratios)}  (pure {pure_ns:.0f} ns/request)")
        if not args.no_load:
            for key in ("broker_us_per_request", "throughput_rps"):
                ratios = [r["compiled"]["load"][key] / r["pure"]["load"][key] for r in rounds]
                print(f"  {key}: {spread(ratios)}")
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        if args.keep:
            print(f"copies kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
