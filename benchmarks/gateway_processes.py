"""HTTP rows/s against the number of gateway processes (`serve --gateway-processes N`).

`batcher serve --model echo --workers 1 --max-batch-size 32 --max-wait-ms 1
--http-port P --gateway-processes N`, driven by Go's `hey` (Debian: `apt-get install
hey`), a load generator whose own work is not Python: --concurrency connections, each
POSTing a v2 JSON request of --rows rows of --values FP32 values (4) to the `echo`
model, for --seconds after a one-second warm-up. Each N gets a serve of its own, on fresh
ports, and the Ns alternate within a round (same-run ratios: the figure of record is the
median of N processes' rows/s over one process's, round by round). Beside rows/s, the
CPU every process used in the measured window (psutil), per request: the gateway's
processes together, the broker, the worker, and `hey`, which says where the cores went.
A machine with fewer cores than gateway processes + broker + worker + load generator
cannot show the gateway scaling: the table says how much of the machine was busy.

    python benchmarks/gateway_processes.py [--quick] [--processes 1 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import psutil
from common import handle_sigterm, md_table, running_serve, wait_http_200, write_results

from batcher.serve.launcher import free_tcp_address

NAME = "gateway_processes"
TITLE = "The gateway's HTTP rows/s against its number of processes"
TARGET_RATIO_2 = 1.6


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


def body(rows: int, values: int) -> bytes:
    data = [float(v % 7) for _ in range(rows) for v in range(values)]
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, values], "data": data}]}
    return json.dumps(doc).encode()


def wait_ready(port: int, timeout_s: float = 30.0) -> None:
    """Until /v2/health/ready says 200 (the gateway starts after the broker)."""
    wait_http_200(f"http://127.0.0.1:{port}/v2/health/ready", timeout_s)


def hey(
    url: str, body_path: str, concurrency: int, seconds: float
) -> tuple[subprocess.Popen[str], list[str]]:
    command = [
        "hey", "-z", f"{seconds:g}s", "-c", str(concurrency), "-m", "POST",
        "-T", "application/json", "-D", body_path, url,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), command


def parse_hey(text: str) -> dict[str, Any]:
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    codes = {int(c): int(n) for c, n in re.findall(r"\[(\d{3})\]\s+(\d+) responses", text)}
    errors = re.search(r"Error distribution:(.*)", text, re.S)
    if rps is None:
        raise RuntimeError(f"hey printed no Requests/sec:\n{text}")
    return {"rps": float(rps.group(1)), "codes": codes, "errors": errors.group(1).strip() if errors else ""}


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def roles(serve_pid: int) -> dict[str, list[psutil.Process]]:
    """serve's processes by role: broker (serve itself), worker, gateway (the parent and
    its children, or the one process)."""
    serve = psutil.Process(serve_pid)
    out: dict[str, list[psutil.Process]] = {"broker": [serve], "worker": [], "gateway": []}
    for child in serve.children():
        cmd = " ".join(child.cmdline())
        if " gateway " in f" {cmd} ":
            out["gateway"] += [child, *child.children(recursive=True)]
        else:
            out["worker"].append(child)
    return out


def measure(n: int, rows: int, body_path: str, concurrency: int, seconds: float) -> dict[str, Any]:
    port = free_port()
    args = [
        "--model", "echo", "--workers", "1", "--max-batch-size", "32", "--max-wait-ms", "1",
        "--http-port", str(port), "--gateway-processes", str(n), "--log-level", "WARNING",
    ]  # fmt: skip
    with running_serve(args, workers=1) as sp:
        assert sp.process is not None
        wait_ready(port)
        url = f"http://127.0.0.1:{port}/v2/models/echo/infer"
        warm, _ = hey(url, body_path, concurrency, 1.0)
        warm.communicate(timeout=30)
        by_role = roles(sp.process.pid)
        if len(by_role["gateway"]) != (n if n == 1 else n + 1):
            raise RuntimeError(f"expected {n} gateway processes, found {by_role['gateway']}")
        before = {role: cpu_s(ps) for role, ps in by_role.items()}
        wall0 = time.perf_counter()
        load, command = hey(url, body_path, concurrency, seconds)
        out = load.stdout.read() if load.stdout else ""  # until it exits
        _, status, usage = os.wait4(load.pid, 0)  # its own CPU, exactly
        load.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - wall0
        after = {role: cpu_s(ps) for role, ps in by_role.items()}
    result = parse_hey(out)
    requests = result["rps"] * seconds
    cpu = {role: after[role] - before[role] for role in before}
    cpu["hey"] = usage.ru_utime + usage.ru_stime
    return {
        "processes": n,
        "rows_per_s": result["rps"] * rows,
        "rps": result["rps"],
        "codes": result["codes"],
        "errors": result["errors"],
        "cpu_us_per_request": {role: s / requests * 1e6 for role, s in cpu.items()},
        "cores_busy": sum(cpu.values()) / wall,
        "command": " ".join(command),
    }


def ceilings(runs: dict[int, list[dict[str, Any]]]) -> str:
    """What a machine with a core for every process would reach, from the CPU each
    request cost here: N gateway processes at one core each, and the broker at one core
    (the worker and the load generator on cores of their own)."""
    lines = []
    for n, res in runs.items():
        gateway_us = statistics.median(x["cpu_us_per_request"]["gateway"] for x in res)
        broker_us = statistics.median(x["cpu_us_per_request"]["broker"] for x in res)
        lines.append(
            f"- {n} process(es): gateway ceiling {n * 1e6 / gateway_us:,.0f} req/s "
            f"({n} x 1e6 / {gateway_us:.0f} us), broker ceiling {1e6 / broker_us:,.0f} req/s "
            f"(1e6 / {broker_us:.0f} us): the lower of the two bounds a machine with the cores"
        )
    return (
        "Ceilings with a core for every process, from the CPU a request cost here "
        "(CPU per request is itself higher on a crowded machine, so these are conservative):\n"
        + "\n".join(lines)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one round of 3 s")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="gateway process counts")
    p.add_argument("--runs", type=int, default=3, help="rounds, each N once")
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per load (<= 10 here)")
    p.add_argument("--concurrency", type=int, default=64, help="hey's connections")
    p.add_argument("--rows", type=int, default=1, help="rows per request")
    p.add_argument(
        "--values",
        type=int,
        default=4,
        help="FP32 values per row, as JSON: more makes the gateway's JSON work a larger share of all",
    )
    args = p.parse_args()
    handle_sigterm()
    if shutil.which("hey") is None:
        raise SystemExit("needs Go's `hey` on PATH (Debian/Ubuntu: apt-get install hey)")
    rounds, seconds = (1, 3.0) if args.quick else (args.runs, args.seconds)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.processes}
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(body(args.rows, args.values))
        body_path = f.name
    try:
        for r in range(rounds):
            order = args.processes if r % 2 == 0 else list(reversed(args.processes))
            for n in order:
                run = measure(n, args.rows, body_path, args.concurrency, seconds)
                runs[n].append(run)
                print(
                    f"round {r + 1}, {n} process(es): {run['rows_per_s']:,.0f} rows/s, codes {run['codes']}"
                )
    finally:
        os.unlink(body_path)
    base = args.processes[0]
    rows_table = []
    for n, res in runs.items():
        rates = [x["rows_per_s"] for x in res]
        ratios = [x["rows_per_s"] / b["rows_per_s"] for x, b in zip(res, runs[base], strict=True)]
        cpu = {
            role: statistics.median(x["cpu_us_per_request"][role] for x in res)
            for role in res[0]["cpu_us_per_request"]
        }
        rows_table.append(
            [
                n,
                statistics.median(rates),
                f"{min(rates):,.0f}-{max(rates):,.0f}",
                statistics.median(ratios),
                f"{min(ratios):.2f}-{max(ratios):.2f}",
                cpu["gateway"],
                cpu["broker"],
                cpu["worker"],
                cpu["hey"],
                statistics.median(x["cores_busy"] for x in res),
                sum(sum(c for code, c in x["codes"].items() if code != 200) for x in res),
            ]
        )
    table = md_table(
        [
            "gateway processes",
            "rows/s (median)",
            "rows/s (spread)",
            f"x {base} process (median)",
            "ratio spread",
            "gateway CPU us/req",
            "broker",
            "worker",
            "hey",
            "cores busy",
            "non-200",
        ],
        rows_table,
    )
    cores = os.cpu_count()
    body_md = (
        f"`hey -c {args.concurrency}`, {args.rows} row(s) of {args.values} FP32 values a request (JSON), "
        f"{rounds} round(s) of {seconds:g} s per process count, alternating within a round; "
        "one `echo` worker, `--max-batch-size 32 --max-wait-ms 1`. CPU is every process's "
        "user + system time over the measured window, per request (the gateway column sums "
        "its processes, the parent's idle loop included; `cores busy` is all of them over "
        f"the window). This machine has {cores} CPUs; the target, x{TARGET_RATIO_2} for 2 "
        "processes, needs the cores for 2 gateway processes beside the broker, the worker "
        f"and the load generator.\n\n{table}\n\n{ceilings(runs)}\n"
    )
    print(body_md)
    write_results(NAME, TITLE, body_md, {"runs": runs, "args": vars(args)}, args.quick)


if __name__ == "__main__":
    main()
