"""batcher and Ray Serve side by side: the same sim load through each, in one run.

Ray Serve gets what batcher has: W replicas (one per worker) of a deployment whose
`@serve.batch` handler (max_batch_size = B, batch_wait_timeout_s = max-wait-ms) blocks
in time.sleep(t(n)) like a simulated GPU, with max_ongoing_requests raised to 512.
Both are driven by a closed loop of 256 requests in flight and by a lone client
(1 in flight): batcher by `batcher.cli.bench` load processes over ZeroMQ, Ray Serve from
this driver through a DeploymentHandle; or, with --client http, both over HTTP by the
same aiohttp closed loop in this driver (batcher through the gateway of `serve
--http-port`, Open Inference Protocol requests of one row; Ray through its proxy).
batcher runs first, then Ray starts (num_cpus=2, loopback only) and is always shut
down at the end.

ray[serve] is an optional extra that the main environment does not hold; install it
in a separate virtualenv and run this script with that Python:

    python3 -m venv /tmp/rayvenv
    /tmp/rayvenv/bin/pip install 'ray[serve]' && /tmp/rayvenv/bin/pip install -e .
    /tmp/rayvenv/bin/python benchmarks/ray_serve.py [--quick]

Without ray importable it prints why it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import sys
import time
from collections import Counter
from typing import Any

from common import (
    RESULTS_DIR,
    closed_loop,
    handle_sigterm,
    md_table,
    median_summary,
    policy_option,
    running_serve,
    serve_args,
    serve_help,
    sim_batch_ms,
    summarize,
    theoretical_capacity,
    write_results,
)

from batcher.cli.bench import new_histogram

NAME = "ray_serve"
TITLE = "batcher and Ray Serve, side by side"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short single runs")
    p.add_argument("--runs", type=int, default=None, help="runs per system and load, median (3; quick 1)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run (4; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (1; quick 0.5)")
    p.add_argument("--workers", type=int, default=4, help="batcher workers = Ray Serve replicas")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="= Ray's batch_wait_timeout_s * 1000")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--sim-base-ms", type=float, default=20.0, help="t(n) = base + per_item * n, both systems")
    p.add_argument("--sim-per-item-ms", type=float, default=2.5)
    p.add_argument("--name", default=NAME, help="results/NAME.md and .json (to keep several setups)")
    p.add_argument("--max-ongoing-requests", type=int, default=512, help="Ray Serve, per replica")
    p.add_argument(
        "--client",
        choices=["handle", "http"],
        default="handle",
        help="handle: Ray through a handle, batcher over ZeroMQ; http: both over HTTP (batcher: its gateway)",
    )
    p.add_argument("--processes", type=int, default=1, help="batcher load generator processes")
    p.add_argument(
        "--policy",
        default=None,
        help="batcher's --policy (passed only when `batcher serve --help` lists it; default: serve's own)",
    )
    args = p.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.duration = args.duration or (2.0 if args.quick else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 1.0)
    return args


def ray_missing() -> str | None:
    """Why Ray Serve cannot be used here, or None when it can."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        return (
            f"ray[serve] is not importable by {sys.executable} ({exc}). It is an optional extra, never a "
            "test dependency: install it in a separate virtualenv (python3 -m venv /tmp/rayvenv && "
            "/tmp/rayvenv/bin/pip install 'ray[serve]' && /tmp/rayvenv/bin/pip install -e .) "
            "and run this script with /tmp/rayvenv/bin/python."
        )
    return None


def skip(reason: str, quick: bool) -> None:
    print(f"ray_serve: skipped: {reason}", flush=True)
    previous = RESULTS_DIR / f"{NAME}.json"
    with contextlib.suppress(OSError, ValueError):
        if not json.loads(previous.read_text()).get("skipped", True):
            print(f"(kept the earlier measured result in {previous})")
            return
    write_results(NAME, TITLE, f"Skipped: {reason}\n", {"skipped": True, "reason": reason}, quick)


# --- batcher -----------------------------------------------------------------------------------


def measure_batcher(args: argparse.Namespace) -> dict[str, Any]:
    w = args.workers
    supported, _, default = policy_option(serve_help())
    extra = ["--policy", args.policy] if args.policy and supported else []
    if args.policy and not supported:
        print(f"batcher serve lists no --policy option: --policy {args.policy} ignored", flush=True)
    args.batcher_policy = (args.policy if extra else default) or "(none)"
    extra += ["--sim-base-ms", str(args.sim_base_ms), "--sim-per-item-ms", str(args.sim_per_item_ms)]
    if args.client == "http":  # both over HTTP: batcher through its gateway (docs/gateway.md)
        port = free_port()
        extra += ["--http-port", str(port)]
        srv = serve_args(
            workers=w, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, extra=extra
        )
        with running_serve(srv, w):
            out = asyncio.run(drive_gateway(args, port))
        report("batcher (HTTP gateway)", out)
        return out
    srv = serve_args(workers=w, max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, extra=extra)
    with running_serve(srv, w) as serve:
        loaded = [
            summarize(
                closed_loop(
                    serve.frontend, args.concurrency, args.duration, args.warmup, processes=args.processes
                )
            )
            for _ in range(args.runs)
        ]
        lone = [
            summarize(closed_loop(serve.frontend, 1, args.duration, args.warmup)) for _ in range(args.runs)
        ]
    out = {
        "loaded": median_summary(loaded),
        "lone": median_summary(lone),
        "loaded_runs": loaded,
        "lone_runs": lone,
    }
    report("batcher", out)
    return out


async def drive_gateway(args: argparse.Namespace, port: int) -> dict[str, Any]:
    """batcher's side over HTTP: the same aiohttp closed loop as Ray's, posting a v2
    infer request of one BYTES row (the same 16 characters) to the gateway."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v2/models/sim/infer"
    await wait_http(f"http://127.0.0.1:{port}/v2/health/ready")
    http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=args.concurrency), timeout=aiohttp.ClientTimeout(total=60.0)
    )

    async def call(x: Any) -> Any:
        body = {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [x]}]}
        async with http.post(url, data=json.dumps(body)) as r:
            r.raise_for_status()
            outputs = {o["name"]: o["data"] for o in (await r.json())["outputs"]}
            assert outputs["echo"] == [x], outputs
            return {"batch_size": outputs["batch_size"][0]}

    try:
        return await loaded_and_lone(args, call, "x" * 16)
    finally:
        await http.close()


async def loaded_and_lone(args: argparse.Namespace, call: Any, payload: str) -> dict[str, Any]:
    """`args.runs` closed loops of `args.concurrency` in flight, then of one, through `call`."""
    loaded = [
        await ray_closed_loop(call, args.concurrency, args.duration, args.warmup, payload)
        for _ in range(args.runs)
    ]
    lone = [await ray_closed_loop(call, 1, args.duration, args.warmup, payload) for _ in range(args.runs)]
    return {
        "loaded": median_summary(loaded),
        "lone": median_summary(lone),
        "loaded_runs": loaded,
        "lone_runs": lone,
    }


async def wait_http(url: str, timeout_s: float = 30.0) -> None:
    """Until `url` answers 200 (the gateway starts after the broker)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready within {timeout_s} s")
            await asyncio.sleep(0.05)  # between probes of a starting process


# --- Ray Serve ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_app(args: argparse.Namespace) -> Any:
    """The Ray Serve application: W replicas of a batched, blocking sim model."""
    from ray import serve

    base_ms, per_item_ms = args.sim_base_ms, args.sim_per_item_ms

    @serve.deployment(
        num_replicas=args.workers,
        max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    class SimModel:
        @serve.batch(max_batch_size=args.max_batch_size, batch_wait_timeout_s=args.max_wait_ms / 1000.0)
        async def infer(self, inputs: list[Any]) -> list[Any]:
            n = len(inputs)
            time.sleep((base_ms + per_item_ms * n) / 1000.0)  # blocking, like a GPU call
            return [{"echo": x, "batch_size": n} for x in inputs]

        async def __call__(self, request: Any) -> Any:
            if hasattr(request, "body"):  # HTTP: a starlette Request with a JSON body
                return await self.infer(json.loads(await request.body()))
            return await self.infer(request)

    return SimModel.bind()  # type: ignore[attr-defined]


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def ray_closed_loop(
    call: Any, concurrency: int, duration_s: float, warmup_s: float, payload: str
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight from this process's event loop; counted like
    batcher.cli.bench: throughput from the replies that arrive inside the measured window,
    latency of the requests sent in it (from send to reply, late replies included)."""
    hist = new_histogram()
    sizes: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    in_window = [0]  # ok replies that arrived inside the window
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop = measure_from + duration_s
    cpu0 = cpu_s()

    async def one_client() -> None:
        for _ in range(100_000_000):  # bounded; the loop ends at `stop`
            t0 = time.perf_counter()
            if t0 >= stop:
                return
            try:
                out = await call(payload)
            except Exception as exc:  # counted, then the loop goes on
                errors[type(exc).__name__] += 1
                continue
            t1 = time.perf_counter()
            if measure_from <= t1 < stop:
                in_window[0] += 1
            if t0 >= measure_from:
                hist.record_value(max(1, int((t1 - t0) * 1e6)))
                size = out.get("batch_size") if isinstance(out, dict) else None
                if isinstance(size, int):
                    sizes[size] += 1

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    busy = (cpu_s() - cpu0) / wall if wall > 0 else 0.0
    n_batches = sum(v / k for k, v in sizes.items())
    completed = hist.get_total_count()
    return {
        "throughput_rps": in_window[0] / duration_s,
        "window_s": duration_s,
        "p50_ms": hist.get_value_at_percentile(50) / 1000.0,
        "p90_ms": hist.get_value_at_percentile(90) / 1000.0,
        "p99_ms": hist.get_value_at_percentile(99) / 1000.0,
        "p99.9_ms": hist.get_value_at_percentile(99.9) / 1000.0,
        "max_ms": hist.get_max_value() / 1000.0,
        "mean_ms": hist.get_mean_value() / 1000.0,
        "mean_batch_size": sum(sizes.values()) / n_batches if n_batches else 0.0,
        "ok": completed,
        "errors": sum(errors.values()),
        "lost": 0,
        "error_kinds": dict(errors),
        "client_cpu_share": round(busy, 3),
        "client_kept_up": busy <= 0.9,
        "client_notes": [] if busy <= 0.9 else [f"the driver used {busy:.0%} of a core"],
    }


def measure_ray(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    payload = "x" * 16
    port = free_port()
    try:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=200 * 2**20,
            _node_ip_address="127.0.0.1",
        )
        if args.client == "http":
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        else:
            serve.start(proxy_location="Disabled")
        handle = serve.run(build_app(args), name="sim", route_prefix="/")
        return asyncio.run(drive_ray(args, handle, port, payload))
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


async def drive_ray(args: argparse.Namespace, handle: Any, port: int, payload: str) -> dict[str, Any]:
    http: Any = None
    if args.client == "http":
        import aiohttp  # a dependency of ray[serve]; lighter per request than httpx

        url = f"http://127.0.0.1:{port}/"
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.concurrency),
            timeout=aiohttp.ClientTimeout(total=60.0),
        )

        async def call(x: Any) -> Any:
            async with http.post(url, data=json.dumps(x)) as r:
                r.raise_for_status()
                return await r.json()
    else:

        async def call(x: Any) -> Any:
            return await handle.remote(x)

    try:
        out = await loaded_and_lone(args, call, payload)
    finally:
        if http is not None:
            await http.close()
    report(f"Ray Serve ({args.client})", out)
    return out


# --- report ------------------------------------------------------------------------------------


def report(name: str, res: dict[str, Any]) -> None:
    ld, ln = res["loaded"], res["lone"]
    print(
        f"{name}: {ld['throughput_rps']:.0f} req/s, p50 {ld['p50_ms']:.1f} ms, p99 {ld['p99_ms']:.1f} ms, "
        f"mean batch {ld['mean_batch_size']:.1f}, client {ld['client_cpu_share']:.0%} of a core; "
        f"lone p50 {ln['p50_ms']:.2f} ms, p99 {ln['p99_ms']:.2f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    handle_sigterm()
    args = parse_args(argv)
    reason = ray_missing()
    if reason is not None:
        skip(reason, args.quick)
        return
    import ray

    theory = theoretical_capacity(args.workers, args.max_batch_size, args.sim_base_ms, args.sim_per_item_ms)
    systems = {"batcher": measure_batcher(args), f"Ray Serve {ray.__version__}": measure_ray(args)}
    rows = []
    for name, res in systems.items():
        ld, ln = res["loaded"], res["lone"]
        rows.append(
            [
                name, ld["throughput_rps"], ld["throughput_rps"] / theory, ld["p50_ms"], ld["p99_ms"],
                ld["mean_batch_size"], ld["errors"] + ld["lost"], f"{ld['client_cpu_share']:.0%}",
                ln["p50_ms"], ln["p99_ms"],
            ]
        )  # fmt: skip
    bt, ry = list(systems.values())
    ratio = (
        bt["loaded"]["throughput_rps"] / ry["loaded"]["throughput_rps"]
        if ry["loaded"]["throughput_rps"]
        else 0
    )
    table = md_table(
        ["system", "req/s", "of theoretical", "p50 ms", "p99 ms", "mean batch", "errors", "client CPU",
         "lone p50 ms", "lone p99 ms"],
        rows,
    )  # fmt: skip
    client = (
        "a DeploymentHandle from the driver's event loop"
        if args.client == "handle"
        else "HTTP (aiohttp) through Ray Serve's proxy"
    )
    batcher_client = (
        "`batcher.cli.bench` load processes over ZeroMQ"
        if args.client == "handle"
        else "the same aiohttp closed loop from this driver, posting v2 infer requests (one BYTES row) "
        "to the gateway of `serve --http-port`"
    )
    t1 = sim_batch_ms(1, args.sim_base_ms, args.sim_per_item_ms)
    body = (
        f"sim model, t(n) = {args.sim_base_ms:g} + {args.sim_per_item_ms:g} * n ms, "
        f"W = {args.workers} workers / replicas, max batch {args.max_batch_size}, max wait "
        f"{args.max_wait_ms:g} ms (Ray: @serve.batch batch_wait_timeout_s {args.max_wait_ms / 1000:g}, "
        f"max_ongoing_requests {args.max_ongoing_requests}, a blocking time.sleep(t(n)) handler); "
        f"theoretical {theory:.0f} req/s. Closed loop with {args.concurrency} in flight, and a lone client "
        f"(1 in flight, against t(1) = {t1:g} ms); median of {args.runs} run(s) of "
        f"{args.duration:g} s after {args.warmup:g} s warm-up. batcher (policy {args.batcher_policy}): "
        f"{batcher_client}; Ray Serve: {client}, Ray started with num_cpus=2 "
        "on loopback.\n\n"
        f"{table}\n\nbatcher / Ray Serve throughput: {ratio:.2f}x.\n"
    )
    write_results(
        args.name,
        TITLE if args.name == NAME else f"{TITLE}: {args.name}",
        body,
        {
            "skipped": False,
            "settings": vars(args),
            "ray_version": ray.__version__,
            "theoretical_rps": theory,
            "throughput_ratio_batcher_to_ray": ratio,
            "systems": systems,
        },
        args.quick,
    )


if __name__ == "__main__":
    main()
