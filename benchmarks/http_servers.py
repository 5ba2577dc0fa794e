"""Which HTTP server the gateway is built on, and what the gateway costs on top of it:
CPU per request, in one run.

Each row is a server process answering a closed loop of --concurrency requests in flight
from this process (aiohttp for HTTP, grpc.aio for gRPC, every reply checked); the figure
is the server process's CPU time (psutil, all its threads) over a measured window,
divided by the requests answered in it: it does not depend on how fast the load
generator is. The rows take turns, round after round, so a noisy moment hits them alike;
the table gives each row's median and its spread (lowest to highest) over the rounds.

Bare servers (`--only servers`, or all), a v2-shaped JSON echo handler (read the body,
decode the JSON, encode a JSON reply); those not installed are skipped, saying so:

- aiohttp on asyncio's loop, and on uvloop;
- uvicorn (httptools, uvloop) with starlette;
- uvicorn (httptools) with a raw ASGI app, on asyncio's loop and on uvloop's: what the
  gateway runs on (uvloop's where it is installed, as the gateway extra does).

The gateway (`--only gateway`, or all): `batcher serve --model echo --workers 1
--max-batch-size 32 --max-wait-ms 1 --http-port P --grpc-port Q`, its gateway process's
CPU per HTTP JSON infer request (FP32 [1, 4]) and per gRPC ModelInfer call (the same
tensor as raw_input_contents), against the floors under it, in the same run, each on the
gateway's event loop (uvloop's where it is installed):

- HTTP: the bare uvicorn raw ASGI echo above (the server alone), and the minimal
  uvicorn forwarder of benchmarks/gateway.py (the server and the ZeroMQ hop to the
  broker, one pre-encoded batcher request a POST, no v2 work);
- gRPC: a bare grpc.aio echo servicer (grpcio's asyncio server parsing the
  ModelInferRequest and answering its raw contents: the server alone), and the minimal
  grpcio forwarder of benchmarks/gateway.py (server and hop).

Targets (issue 30): the gateway's CPU <= 100 us per HTTP JSON request and <= 250 us per
gRPC call.

    python benchmarks/http_servers.py [--quick] [--only servers|gateway] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import statistics
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from common import handle_sigterm, md_table, running_serve, serve_v2_grpc, wait_http_200, write_results

from batcher.serve.launcher import free_tcp_address

NAME = "http_servers"
TITLE = "HTTP servers for the gateway: CPU per request"
HTTP_TARGET_US = 100.0
GRPC_TARGET_US = 250.0
CANDIDATES = {
    "aiohttp (asyncio)": ["aiohttp"],
    "aiohttp (uvloop)": ["aiohttp", "uvloop"],
    "uvicorn + starlette (httptools, uvloop)": ["uvicorn", "starlette", "httptools", "uvloop"],
    "uvicorn, raw ASGI (httptools, asyncio)": ["uvicorn", "httptools"],
    "uvicorn, raw ASGI (httptools, uvloop)": ["uvicorn", "httptools", "uvloop"],
}
#: The event loop the gateway runs on (batcher/gateway/server.py), so its floors' too.
GATEWAY_LOOP = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
BARE_UVICORN = f"uvicorn, raw ASGI (httptools, {GATEWAY_LOOP})"
BARE_GRPC = f"grpc.aio, bare echo servicer ({GATEWAY_LOOP})"
FORWARDER_HTTP = f"floor: uvicorn + ZeroMQ hop (minimal forwarder, no v2 work, {GATEWAY_LOOP})"
FORWARDER_GRPC = f"floor: grpc.aio + ZeroMQ hop (minimal forwarder, no v2 work, {GATEWAY_LOOP})"
GATEWAY_HTTP = "the gateway: HTTP JSON infer"
GATEWAY_GRPC = "the gateway: gRPC ModelInfer"
VALUES = [1.0, 2.0, 3.0, 4.0]
BODY = json.dumps(
    {"id": "1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": VALUES}]}
).encode()
INFER_PATH = "/v2/models/echo/infer"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


# --- the bare servers (each a process of its own, until killed) -------------------------------


def server(kind: str, port: int) -> None:
    """The candidate's server, until killed."""
    if kind == BARE_GRPC:
        on_gateway_loop()
        grpc_echo_server(port)
    elif kind.startswith("aiohttp"):
        from aiohttp import web

        if "uvloop" in kind:
            import uvloop

            uvloop.install()

        async def infer(request: web.Request) -> web.Response:
            doc = json.loads(await request.read())
            return web.json_response({"id": doc.get("id"), "outputs": doc["inputs"]})

        app = web.Application()
        app.router.add_post("/v2/models/{name}/infer", infer)
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    elif "raw ASGI" in kind:
        import uvicorn

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            body, more = b"", True
            while more:
                message = await receive()
                body, more = body + message.get("body", b""), message.get("more_body", False)
            doc = json.loads(body)
            out = json.dumps({"id": doc.get("id"), "outputs": doc["inputs"]}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": out})

        uvicorn.run(
            app, host="127.0.0.1", port=port, http="httptools", lifespan="off", log_level="error",
            access_log=False, loop="uvloop" if "uvloop" in kind else "asyncio",
        )  # fmt: skip
    else:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def s_infer(request: Request) -> JSONResponse:
            doc = json.loads(await request.body())
            return JSONResponse({"id": doc.get("id"), "outputs": doc["inputs"]})

        app = Starlette(routes=[Route("/v2/models/{name}/infer", s_infer, methods=["POST"])])
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False, loop="uvloop")


def grpc_echo_server(port: int) -> None:
    """grpcio's asyncio server with the least a ModelInfer can do: the request parsed,
    a response of the gateway's shape (one output named, typed and shaped, its raw
    contents the input's) built and serialized. The gRPC floor: no hop, no v2 checks."""
    from batcher.gateway import inference_pb2 as pb

    async def infer(request: Any, context: Any) -> Any:
        t = request.inputs[0]
        return pb.ModelInferResponse(
            model_name=request.model_name,
            model_version="1",
            id=request.id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(name="output", datatype=t.datatype, shape=t.shape)
            ],
            raw_output_contents=list(request.raw_input_contents),
        )

    asyncio.run(serve_v2_grpc(port, {"ModelInfer": (infer, pb.ModelInferRequest, pb.ModelInferResponse)}))


@contextlib.contextmanager
def bare_server(kind: str) -> Iterator[tuple[int, int]]:
    """(its port, its pid): a bare server started for the whole run, killed on the way out."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)])
    try:
        yield port, proc.pid
    finally:
        proc.kill()
        proc.wait()


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


# --- load ---------------------------------------------------------------------------------------


async def closed_loop(
    call: Callable[[], Awaitable[None]], concurrency: int, warmup_s: float, seconds: float, pid: int
) -> dict[str, float]:
    """`concurrency` loops of `call` for warmup_s + seconds; the server's CPU (process
    `pid`) and the calls answered, both counted over the last `seconds` only."""
    import psutil

    ps = psutil.Process(pid)
    done = 0
    stopping = False

    async def one() -> None:
        nonlocal done
        while not stopping:
            await call()
            done += 1

    loops = [asyncio.ensure_future(one()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        cpu0, done0, t0, sw0 = sum(ps.cpu_times()[:2]), done, time.perf_counter(), switches(pid)
        await asyncio.sleep(seconds)
        cpu1, done1, t1, sw1 = sum(ps.cpu_times()[:2]), done, time.perf_counter(), switches(pid)
        stopping = True
        await asyncio.gather(*loops)
    finally:
        for loop in loops:
            loop.cancel()
    answered = max(done1 - done0, 1)
    return {
        "rps": answered / (t1 - t0),
        "cpu_us_per_request": (cpu1 - cpu0) / answered * 1e6,
        "switches_per_request": (sw1 - sw0) / answered,
    }


def switches(pid: int) -> int:
    """The voluntary context switches of every thread of `pid` so far (a thread that
    sleeps and is woken: what a wake-up costs, the event loop's and libzmq's I/O
    thread's, is a large part of a small request's CPU on this VM)."""
    import os

    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


def http_load(port: int, pid: int, concurrency: int, warmup_s: float, seconds: float) -> dict[str, float]:
    """HTTP JSON infer requests; every reply the first one's bytes (which is checked)."""
    import aiohttp

    url = f"http://127.0.0.1:{port}{INFER_PATH}"
    headers = {"Content-Type": "application/json"}

    async def main() -> dict[str, float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            async with session.post(url, data=BODY, headers=headers) as r:
                first = await r.read()
                assert r.status == 200, first
            doc = json.loads(first)
            assert doc["outputs"][0]["data"] == VALUES, doc

            async def call() -> None:
                async with session.post(url, data=BODY, headers=headers) as r:
                    reply = await r.read()
                    assert r.status == 200 and reply == first, reply

            return await closed_loop(call, concurrency, warmup_s, seconds, pid)

    return asyncio.run(main())


def grpc_request() -> bytes:
    """A pre-serialized ModelInferRequest: one FP32 row of 4 values, as raw contents."""
    from batcher.gateway import inference_pb2 as pb

    return pb.ModelInferRequest(  # type: ignore[no-any-return]
        model_name="echo",
        id="1",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])],
        raw_input_contents=[struct.pack("<4f", *VALUES)],
    ).SerializeToString()


def grpc_load(port: int, pid: int, concurrency: int, warmup_s: float, seconds: float) -> dict[str, float]:
    """gRPC ModelInfer calls on one channel; every reply the first one's bytes (checked)."""
    import grpc

    from batcher.gateway import inference_pb2 as pb

    request = grpc_request()

    async def main() -> dict[str, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(MODEL_INFER, request_serializer=bytes, response_deserializer=bytes)
            first = await infer(request, wait_for_ready=True, timeout=30)
            reply = pb.ModelInferResponse.FromString(first)
            assert reply.raw_output_contents[0] == struct.pack("<4f", *VALUES), reply

            async def call() -> None:
                assert await infer(request) == first

            return await closed_loop(call, concurrency, warmup_s, seconds, pid)

    return asyncio.run(main())


def wait_for_http(port: int, timeout_s: float = 30.0) -> None:
    """Until an infer POST is answered 200 on `port`."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{INFER_PATH}", data=BODY, headers={"Content-Type": "application/json"}
    )
    wait_http_200(request, timeout_s)


# --- the run -------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else "-"


def main() -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--runs", type=int, default=None, help="rounds, median and spread (3; quick 1)")
    p.add_argument("--seconds", type=float, default=None, help="measured window of each row (3; quick 1.5)")
    p.add_argument("--only", choices=["servers", "gateway"], help="the bare servers or the gateway rows")
    p.add_argument(
        "--baseline",
        type=Path,
        action="append",
        default=[],
        help="another source tree (git archive REV | tar -x -C DIR): its gateway's HTTP row, same rounds",
    )
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        server(args.serve[0], int(args.serve[1]))
        return
    seconds = args.seconds or (1.5 if args.quick else 3.0)
    warmup_s = 0.5
    runs = args.runs or (1 if args.quick else 3)
    with_servers, with_gateway = args.only in (None, "servers"), args.only in (None, "gateway")
    present = {k: all(importlib.util.find_spec(m) for m in mods) for k, mods in CANDIDATES.items()}
    if with_gateway and not present[BARE_UVICORN]:
        sys.exit("the gateway rows need uvicorn and httptools: pip install -e '.[gateway,bench]'")
    bare = [k for k, ok in present.items() if ok and (with_servers or k == BARE_UVICORN)]
    # row: (its load, its port, its pid); started once, kept for every round
    rows: dict[str, tuple[Callable[..., dict[str, float]], int, int]] = {}
    with contextlib.ExitStack() as stack:
        for kind in bare:
            port, pid = stack.enter_context(bare_server(kind))
            rows[kind] = (http_load, port, pid)
        if with_gateway:
            import gateway as gw_bench  # benchmarks/gateway.py: its floors and its lookup

            http_port, grpc_port = free_port(), free_port()
            serve = [
                "--model", "echo", "--workers", "1", "--max-batch-size", "32", "--max-wait-ms", "1",
                "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            ]  # fmt: skip
            srv = stack.enter_context(running_serve(serve, 1))
            assert srv.process is not None
            gw_pid = gw_bench.gateway_process(srv.process.pid).pid
            fwd_http, fwd_grpc = free_port(), free_port()
            fwd_http_proc = stack.enter_context(
                forwarder_process("minimal_uvicorn_forwarder", srv.frontend, fwd_http)
            )
            fwd_grpc_proc = stack.enter_context(
                forwarder_process("minimal_grpc_forwarder", srv.frontend, fwd_grpc)
            )
            grpc_port_bare, grpc_pid_bare = stack.enter_context(bare_server(BARE_GRPC))
            rows[FORWARDER_HTTP] = (http_load, fwd_http, fwd_http_proc)
            rows[GATEWAY_HTTP] = (http_load, http_port, gw_pid)
            for source in args.baseline:
                port = free_port()
                base_serve = [*serve[:-4], "--http-port", str(port), "--grpc-port", str(free_port())]
                base = stack.enter_context(running_serve(base_serve, 1, source=source))
                assert base.process is not None
                rows[f"the gateway at {source}: HTTP JSON infer"] = (
                    http_load, port, gw_bench.gateway_process(base.process.pid).pid
                )  # fmt: skip
            rows[BARE_GRPC] = (grpc_load, grpc_port_bare, grpc_pid_bare)
            rows[FORWARDER_GRPC] = (grpc_load, fwd_grpc, fwd_grpc_proc)
            rows[GATEWAY_GRPC] = (grpc_load, grpc_port, gw_pid)
        for load, port, _ in rows.values():
            if load is http_load:
                wait_for_http(port)  # gRPC rows wait for their server in their first call
        results: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
        for _ in range(runs):  # interleaved
            for name, (load, port, pid) in rows.items():
                results[name].append(load(port, pid, args.concurrency, warmup_s, seconds))
    table_rows = []
    for name, res in results.items():
        cpu = [r["cpu_us_per_request"] for r in res]
        target = {GATEWAY_HTTP: HTTP_TARGET_US, GATEWAY_GRPC: GRPC_TARGET_US}.get(name)
        met = target is not None and statistics.median(cpu) <= target
        verdict = "-" if target is None else f"<= {target:g}: {'met' if met else 'missed'}"
        table_rows.append(
            [
                name,
                statistics.median(cpu),
                spread(cpu),
                statistics.median(r["switches_per_request"] for r in res),
                statistics.median(r["rps"] for r in res),
                verdict,
            ]
        )
    missing = [kind for kind, ok in present.items() if not ok and with_servers]
    table_rows += [[kind, "not installed", "", "", "", "-"] for kind in missing]
    table = md_table(
        [
            "server",
            "server CPU us/request",
            "spread",
            "wake-ups/request",
            f"req/s ({args.concurrency} in flight)",
            "target",
        ],
        table_rows,
    )
    body = (
        f"One load process (aiohttp for HTTP, grpc.aio for gRPC), {args.concurrency} in flight, every "
        f"reply checked; {runs} interleaved round(s), each row {warmup_s:g} s of warm-up then "
        f"{seconds:g} s measured; CPU of the server process over the measured window per request "
        f"answered in it, median and spread (lowest-highest). req/s is bound by the load process."
        f"\n\n{table}\n"
    )
    if with_gateway:
        med = {name: statistics.median(r["cpu_us_per_request"] for r in res) for name, res in results.items()}
        body += (
            f"\nThe gateway over its floors: HTTP JSON {med[GATEWAY_HTTP]:.0f} us, "
            f"{med[GATEWAY_HTTP] - med[FORWARDER_HTTP]:+.0f} over the minimal forwarder and "
            f"{med[GATEWAY_HTTP] - med[BARE_UVICORN]:+.0f} over bare uvicorn; "
            f"gRPC {med[GATEWAY_GRPC]:.0f} us, "
            f"{med[GATEWAY_GRPC] - med[FORWARDER_GRPC]:+.0f} over the minimal forwarder and "
            f"{med[GATEWAY_GRPC] - med[BARE_GRPC]:+.0f} over the bare grpc.aio servicer.\n"
        )
    print(body)
    write_results(NAME, TITLE, body, {"results": results, "concurrency": args.concurrency}, args.quick)


@contextlib.contextmanager
def forwarder_process(target: str, broker: str, port: int) -> Iterator[int]:
    """A minimal forwarder of benchmarks/gateway.py (spawned, on the gateway's loop), its
    pid; killed on the way out."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=forwarder, args=(target, broker, port))
    proc.start()
    try:
        assert proc.pid is not None
        yield proc.pid
    finally:
        proc.kill()
        proc.join(10)


def forwarder(name: str, broker: str, port: int) -> None:
    """benchmarks/gateway.py's forwarder `name`, on the gateway's event loop."""
    import gateway as gw_bench

    on_gateway_loop()
    getattr(gw_bench, name)(broker, port)


def on_gateway_loop() -> None:
    """asyncio.run on the loop the gateway runs on from here on (uvloop's if installed)."""
    if GATEWAY_LOOP == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


if __name__ == "__main__":
    main()
