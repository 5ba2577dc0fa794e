"""The Open Inference Protocol gateway against the direct ZeroMQ path, in one run.

`batcher serve --model echo --workers 1 --max-batch-size 32 --max-wait-ms 1
--http-port P --grpc-port Q` (one gateway process in front of the broker), driven from
a separate load process by the lightest client of each path, every request an FP32
tensor of 4 values (one row) with its reply checked:

- direct: a ZeroMQ DEALER sending pre-encoded batcher requests;
- HTTP JSON and HTTP binary (the binary tensor data extension): aiohttp, one
  connection per request in flight, a pre-encoded body;
- gRPC: grpc.aio on one channel, a pre-serialized ModelInferRequest with
  raw_input_contents.

Each path runs a closed loop with --concurrency requests in flight (requests/s, ratio to
direct) and one request at a time from the lightest blocking client of its protocol
(http.client, grpcio's blocking stub, a blocking DEALER): p50 and p99, and the p50 added
over direct. Lone requests are also sent from libcurl (pycurl, in the bench extra; over
HTTP/2 for gRPC), whose own work is C, as the direct path's pre-encoded DEALER does
little: http.client spends about a quarter of a millisecond of Python a request, and
grpcio's stub about a tenth, the client's cost, not the gateway's. The target (<= 0.5 ms
added) is read from the lightest client.
Five floor rows: the direct requests through a process that only forwards them
(libzmq's proxy), what any process between client and broker costs on this machine;
and a minimal process that forwards each request as one pre-encoded batcher request and
answers its values, what the server library and the hop cost in Python before any of
the gateway's v2 work: for HTTP on uvicorn (httptools, a raw ASGI app: what the gateway
runs on) and on aiohttp (what it ran on before), for gRPC on grpcio's asyncio server
(what the gateway runs on) and on grpclib (pure asyncio, in the bench extra).
Then rows: HTTP binary requests of 8 rows against 1 row, in rows/s (the gateway splits
a request of k rows into k batcher requests; docs/gateway.md says why).

    python benchmarks/gateway.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq
from common import handle_sigterm, md_table, running_serve, serve_v2_grpc, wait_http_200, write_results

from batcher.serve.launcher import free_tcp_address
from batcher.transport.zmqio import readable, recv_frames, send_frames

NAME = "gateway"
TITLE = "The Open Inference Protocol gateway against the direct ZeroMQ path"
ADDED_P50_TARGET_MS = 0.5
VALUES = [1.0, 2.0, 3.0, 4.0]


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


# --- load processes (each path's lightest client) ----------------------------------------------


class Window:
    """Replies inside the measured window and the latencies of requests sent in it."""

    def __init__(self, warmup_s: float, seconds: float) -> None:
        self.start = time.perf_counter() + warmup_s
        self.stop = self.start + seconds
        self.count = 0
        self.rows = 0
        self.latencies_ms: list[float] = []

    def done(self, t0: float, rows: int = 1) -> None:
        t1 = time.perf_counter()
        if self.start <= t1 < self.stop:
            self.count += 1
            self.rows += rows
        if t0 >= self.start:
            self.latencies_ms.append((t1 - t0) * 1000.0)

    def result(self, seconds: float) -> dict[str, Any]:
        lat = sorted(self.latencies_ms) or [float("nan")]
        return {
            "rps": self.count / seconds,
            "rows_per_s": self.rows / seconds,
            "p50_ms": lat[len(lat) // 2],
            "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        }


def direct_load(address: str, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    tensor = {"datatype": "FP32", "shape": [4], "data": struct.pack("<4f", *VALUES)}
    bodies = [msgpack.packb({"id": i, "model": "echo", "input": tensor}) for i in range(concurrency)]
    window = Window(warmup_s, seconds)
    sent = {}
    for i, body in enumerate(bodies):
        sent[i] = time.perf_counter()
        sock.send_multipart([b"", body])
    for _ in range(100_000_000):  # bounded; ends at the window's stop
        _, reply = sock.recv_multipart()
        rep = msgpack.unpackb(reply)
        assert rep["ok"] and rep["output"]["data"] == tensor["data"], rep
        window.done(sent[rep["id"]])
        if time.perf_counter() >= window.stop:
            break
        sent[rep["id"]] = time.perf_counter()
        sock.send_multipart([b"", bodies[rep["id"]]])
    sock.close(0)
    ctx.term()
    out.put(window.result(seconds))


def http_body(rows: int, binary: bool) -> tuple[bytes, dict[str, str]]:
    data = VALUES * rows
    if not binary:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": data}]}
        return json.dumps(doc).encode(), {"Content-Type": "application/json"}
    raw = struct.pack(f"<{len(data)}f", *data)
    doc = {
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": [rows, 4],
                "parameters": {"binary_data_size": len(raw)},
            }
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(doc).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def http_load(
    port: int, concurrency: int, warmup_s: float, seconds: float, out: Any, rows: int, binary: bool
) -> None:
    import aiohttp

    body, headers = http_body(rows, binary)
    url = f"http://127.0.0.1:{port}/v2/models/echo/infer"

    async def main() -> dict[str, Any]:
        window = Window(warmup_s, seconds)
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one() -> None:
                for _ in range(100_000_000):  # bounded; ends at the window's stop
                    t0 = time.perf_counter()
                    if t0 >= window.stop:
                        return
                    async with session.post(url, data=body, headers=headers) as r:
                        reply = await r.read()
                        assert r.status == 200, reply
                        if binary:
                            assert reply.endswith(body[-16 * rows :]), reply
                        else:
                            assert json.loads(reply)["outputs"][0]["data"] == VALUES * rows, reply
                    window.done(t0, rows)

            await asyncio.gather(*(one() for _ in range(concurrency)))
        return window.result(seconds)

    out.put(asyncio.run(main()))


def grpc_request() -> bytes:
    """A pre-serialized ModelInferRequest: one FP32 row of 4 values, as raw contents."""
    from batcher.gateway import inference_pb2 as pb

    return pb.ModelInferRequest(  # type: ignore[no-any-return]
        model_name="echo",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])],
        raw_input_contents=[struct.pack("<4f", *VALUES)],
    ).SerializeToString()


def grpc_load(port: int, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    import grpc

    from batcher.gateway import inference_pb2 as pb

    request, expected = grpc_request(), struct.pack("<4f", *VALUES)

    async def main() -> dict[str, Any]:
        window = Window(warmup_s, seconds)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=lambda b: b,  # pre-serialized once
                response_deserializer=pb.ModelInferResponse.FromString,
            )

            async def one() -> None:
                for _ in range(100_000_000):  # bounded; ends at the window's stop
                    t0 = time.perf_counter()
                    if t0 >= window.stop:
                        return
                    reply = await infer(request)
                    assert reply.raw_output_contents[0] == expected, reply
                    window.done(t0)

            await asyncio.gather(*(one() for _ in range(concurrency)))
        return window.result(seconds)

    out.put(asyncio.run(main()))


def gateway_process(serve_pid: int) -> Any:
    """serve's gateway child (psutil.Process), for its CPU time."""
    import psutil

    children = psutil.Process(serve_pid).children()
    return next(p for p in children if "gateway" in p.cmdline())


def cpu_s(proc: Any) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def lone_http(
    port: int, concurrency: int, warmup_s: float, seconds: float, out: Any, rows: int, binary: bool
) -> None:
    """One request at a time over one keep-alive connection (http.client: lighter than
    aiohttp's client, so the round trip is the gateway's, not the client's)."""
    import http.client

    body, headers = http_body(rows, binary)
    conn = http.client.HTTPConnection("127.0.0.1", port)
    window = Window(warmup_s, seconds)
    for _ in range(100_000_000):  # bounded; ends at the window's stop
        t0 = time.perf_counter()
        if t0 >= window.stop:
            break
        conn.request("POST", "/v2/models/echo/infer", body, headers)
        reply = conn.getresponse()
        data = reply.read()
        assert reply.status == 200, data
        window.done(t0)
    conn.close()
    out.put(window.result(seconds))


def lone_curl(
    port: int, concurrency: int, warmup_s: float, seconds: float, out: Any, rows: int, binary: bool
) -> None:
    """One request at a time over one keep-alive connection from libcurl (pycurl): the
    lightest HTTP client at hand, whose own work is C (http.client's is Python: about a
    quarter of a millisecond a request here), as the direct path's is a pre-encoded
    DEALER."""
    import io

    import pycurl  # type: ignore[import-untyped]

    body, headers = http_body(rows, binary)
    curl = pycurl.Curl()
    curl.setopt(pycurl.URL, f"http://127.0.0.1:{port}/v2/models/echo/infer")
    curl.setopt(pycurl.POSTFIELDS, body)
    curl.setopt(pycurl.HTTPHEADER, [f"{k}: {v}" for k, v in headers.items()] + ["Expect:"])
    window = Window(warmup_s, seconds)
    for _ in range(100_000_000):  # bounded; ends at the window's stop
        reply = io.BytesIO()
        curl.setopt(pycurl.WRITEDATA, reply)
        t0 = time.perf_counter()
        if t0 >= window.stop:
            break
        curl.perform()
        assert curl.getinfo(pycurl.RESPONSE_CODE) == 200, reply.getvalue()
        window.done(t0)
    curl.close()
    out.put(window.result(seconds))


def lone_grpc(port: int, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    """One request at a time from grpcio's blocking stub, pre-serialized."""
    import grpc

    from batcher.gateway import inference_pb2 as pb

    request = grpc_request()
    window = Window(warmup_s, seconds)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        for _ in range(100_000_000):  # bounded; ends at the window's stop
            t0 = time.perf_counter()
            if t0 >= window.stop:
                break
            assert infer(request).raw_output_contents[0] == struct.pack("<4f", *VALUES)
            window.done(t0)
    out.put(window.result(seconds))


def lone_curl_grpc(port: int, concurrency: int, warmup_s: float, seconds: float, out: Any) -> None:
    """One call at a time from libcurl (pycurl) over HTTP/2 with prior knowledge: a gRPC
    call is a POST of one length-prefixed message, its status in the trailers. Its own
    work is C (nghttp2), lighter than grpcio's stub, as pycurl is for HTTP."""
    import io

    import pycurl

    from batcher.gateway import inference_pb2 as pb

    message = grpc_request()
    curl = pycurl.Curl()
    curl.setopt(pycurl.URL, f"http://127.0.0.1:{port}/inference.GRPCInferenceService/ModelInfer")
    curl.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_2_PRIOR_KNOWLEDGE)
    curl.setopt(pycurl.POSTFIELDS, b"\0" + struct.pack(">I", len(message)) + message)
    curl.setopt(pycurl.HTTPHEADER, ["Content-Type: application/grpc", "TE: trailers", "Expect:"])
    expected = struct.pack("<4f", *VALUES)
    window = Window(warmup_s, seconds)
    for _ in range(100_000_000):  # bounded; ends at the window's stop
        reply, head = io.BytesIO(), io.BytesIO()
        curl.setopt(pycurl.WRITEDATA, reply)
        curl.setopt(pycurl.HEADERFUNCTION, head.write)
        t0 = time.perf_counter()
        if t0 >= window.stop:
            break
        curl.perform()
        assert b"grpc-status: 0" in head.getvalue(), head.getvalue()
        response = pb.ModelInferResponse.FromString(reply.getvalue()[5:])
        assert response.raw_output_contents[0] == expected, response
        window.done(t0)
    curl.close()
    out.put(window.result(seconds))


def zmq_proxy(frontend: str, backend: str) -> None:
    """A process that only forwards (libzmq's own proxy, no Python per message): the
    least any process between a client and the broker costs."""
    ctx: zmq.Context[Any] = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    front.bind(frontend)
    back.connect(backend)
    zmq.proxy(front, back)


class _Forwarder:
    """What the minimal forwarders share: one DEALER read by the event loop, one
    pre-encoded request per POST, the reply's values as v2 JSON."""

    def __init__(self, broker: str) -> None:
        import itertools

        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(broker)
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self.ids = itertools.count(1)
        self.tensor = {"datatype": "FP32", "shape": [4], "data": struct.pack("<4f", *VALUES)}
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self.drain)

    def drain(self) -> None:
        while readable(self.sock):
            reply = msgpack.unpackb(recv_frames(self.sock)[-1])
            fut = self.pending.pop(reply["id"], None)
            if fut is not None:
                fut.set_result(reply["output"]["data"])

    async def raw(self) -> bytes:
        """The reply's values, as the worker packed them."""
        req_id = next(self.ids)
        fut: asyncio.Future[bytes] = self.loop.create_future()
        self.pending[req_id] = fut
        send_frames(self.sock, [b"", msgpack.packb({"id": req_id, "model": "echo", "input": self.tensor})])
        self.drain()
        return await fut

    async def infer(self) -> bytes:
        """The reply's values as a v2 JSON response."""
        data = list(struct.unpack("<4f", await self.raw()))
        doc = {"outputs": [{"name": "output", "datatype": "FP32", "shape": [1, 4], "data": data}]}
        return json.dumps(doc).encode()


def minimal_forwarder(broker: str, port: int) -> None:
    """The least an aiohttp gateway can do: take a POST, send one pre-encoded batcher
    request (no v2 parsing or checks), and answer the reply's values as v2 JSON. What the
    HTTP server and the ZeroMQ hop cost in Python, before any of the gateway's work."""
    from aiohttp import web

    async def serve() -> None:
        forwarder = _Forwarder(broker)

        async def infer(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=await forwarder.infer(), content_type="application/json")

        async def live(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", infer)
        app.router.add_get("/v2/health/live", live)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()  # until killed

    asyncio.run(serve())


def minimal_uvicorn_forwarder(broker: str, port: int) -> None:
    """The same least work on uvicorn (httptools, a raw ASGI app), what the gateway
    runs on."""
    import uvicorn

    async def serve() -> None:
        forwarder = _Forwarder(broker)

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            more = True
            while more:
                more = (await receive()).get("more_body", False)
            body = await forwarder.infer() if scope["method"] == "POST" else b""
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, http="httptools", lifespan="off", access_log=False,
            log_level="warning",
        )  # fmt: skip
        await uvicorn.Server(config).serve()

    asyncio.run(serve())


def minimal_grpc_forwarder(broker: str, port: int) -> None:
    """The same least work on grpcio's asyncio server (what the gateway's gRPC runs on):
    each ModelInfer sends one pre-encoded batcher request and answers its values as raw
    output contents, with no v2 parsing or checks."""
    from batcher.gateway import inference_pb2 as pb

    async def serve() -> None:
        forwarder = _Forwarder(broker)

        async def infer(request: Any, context: Any) -> Any:
            return pb.ModelInferResponse(model_name="echo", raw_output_contents=[await forwarder.raw()])

        async def live(request: Any, context: Any) -> Any:
            return pb.ServerLiveResponse(live=True)

        await serve_v2_grpc(
            port,
            {
                "ModelInfer": (infer, pb.ModelInferRequest, pb.ModelInferResponse),
                "ServerLive": (live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            },
        )

    asyncio.run(serve())


def minimal_grpclib_forwarder(broker: str, port: int) -> None:
    """The same least work on grpclib (pure asyncio on h2, no threads of its own): the
    other well-kept gRPC server for asyncio, measured against grpcio's."""
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    from batcher.gateway import inference_pb2 as pb

    class Service:
        def __init__(self, forwarder: _Forwarder) -> None:
            self.forwarder = forwarder

        async def infer(self, stream: Any) -> None:
            await stream.recv_message()
            raw = await self.forwarder.raw()
            await stream.send_message(pb.ModelInferResponse(model_name="echo", raw_output_contents=[raw]))

        async def live(self, stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(pb.ServerLiveResponse(live=True))

        def __mapping__(self) -> dict[str, Any]:
            service = "/inference.GRPCInferenceService/"
            return {
                service + "ModelInfer": Handler(
                    self.infer, Cardinality.UNARY_UNARY, pb.ModelInferRequest, pb.ModelInferResponse
                ),
                service + "ServerLive": Handler(
                    self.live, Cardinality.UNARY_UNARY, pb.ServerLiveRequest, pb.ServerLiveResponse
                ),
            }

    async def serve() -> None:
        server = Server([Service(_Forwarder(broker))])
        await server.start("127.0.0.1", port)
        await server.wait_closed()

    asyncio.run(serve())


def wait_for_grpc(port: int, timeout_s: float = 30.0) -> None:
    """Until ServerLive answers on `port`."""
    import grpc

    from batcher.gateway import inference_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        live = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=pb.ServerLiveRequest.SerializeToString,
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        assert live(pb.ServerLiveRequest(), timeout=timeout_s, wait_for_ready=True).live


@contextlib.contextmanager
def floor_process(target: Any, *args: Any) -> Iterator[None]:
    """A floor's process (spawned), killed on the way out, whatever happened."""
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args)
    proc.start()
    try:
        yield
    finally:
        proc.kill()
        proc.join(10)


def run_load(target: Any, *args: Any) -> dict[str, Any]:
    """One load process (spawned: no zmq context or event loop carried over)."""
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    proc = mp.Process(target=target, args=(*args[:4], queue, *args[4:]))
    proc.start()
    try:
        result: dict[str, Any] = queue.get(timeout=args[2] + args[3] + 60)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return result


# --- the run -----------------------------------------------------------------------------------


def main() -> None:
    handle_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--runs", type=int, default=None, help="runs of each path, median (3; quick 1)")
    args = p.parse_args()
    seconds, warmup_s = (2.0, 0.5) if args.quick else (4.0, 1.0)
    runs = args.runs or (1 if args.quick else 3)
    http_port, grpc_port = free_port(), free_port()
    serve = [
        "--model", "echo", "--workers", "1", "--max-batch-size", "32", "--max-wait-ms", "1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
    ]  # fmt: skip
    with running_serve(serve, 1) as srv, contextlib.ExitStack() as floors:
        wait_for_gateway(http_port)
        proxy_address = free_tcp_address()
        floors.enter_context(floor_process(zmq_proxy, proxy_address, srv.frontend))
        port: dict[str, int] = {}
        for name, forwarder in (
            ("aiohttp", minimal_forwarder),
            ("uvicorn", minimal_uvicorn_forwarder),
            ("grpcio", minimal_grpc_forwarder),
            ("grpclib", minimal_grpclib_forwarder),
        ):
            port[name] = free_port()
            floors.enter_context(floor_process(forwarder, srv.frontend, port[name]))
        wait_for_gateway(port["aiohttp"])
        wait_for_gateway(port["uvicorn"])
        wait_for_grpc(port["grpcio"])
        wait_for_grpc(port["grpclib"])
        # path: (its loaded client, its lone client, the lightest one if another, the arguments)
        paths: dict[str, tuple[Any, Any, Any, tuple[Any, ...]]] = {
            "direct (ZeroMQ)": (direct_load, direct_load, None, (srv.frontend,)),
            "floor: direct through a C zmq proxy process": (direct_load, direct_load, None, (proxy_address,)),
            "floor: a minimal uvicorn forwarder, no v2 work (HTTP JSON)": (
                http_load,
                lone_http,
                lone_curl,
                (port["uvicorn"], 1, False),
            ),
            "floor: a minimal aiohttp forwarder, no v2 work (HTTP JSON)": (
                http_load,
                lone_http,
                lone_curl,
                (port["aiohttp"], 1, False),
            ),
            "floor: a minimal grpcio forwarder, no v2 work (gRPC)": (
                grpc_load,
                lone_grpc,
                lone_curl_grpc,
                (port["grpcio"],),
            ),
            "floor: a minimal grpclib forwarder, no v2 work (gRPC)": (
                grpc_load,
                lone_grpc,
                lone_curl_grpc,
                (port["grpclib"],),
            ),
            "HTTP, JSON": (http_load, lone_http, lone_curl, (http_port, 1, False)),
            "HTTP, binary data": (http_load, lone_http, lone_curl, (http_port, 1, True)),
            "gRPC, raw contents": (grpc_load, lone_grpc, lone_curl_grpc, (grpc_port,)),
        }
        results: dict[str, dict[str, Any]] = {
            name: {"loaded": [], "lone": [], "lightest": []} for name in paths
        }
        rows8: list[dict[str, Any]] = []
        assert srv.process is not None
        gw = gateway_process(srv.process.pid)
        for _ in range(runs):  # interleaved, so a noisy moment hits every path alike
            for name, (loaded_client, lone_client, lightest, (where, *extra)) in paths.items():
                cpu0 = cpu_s(gw)
                loaded = run_load(loaded_client, where, args.concurrency, warmup_s, seconds, *extra)
                # the gateway's CPU per request of the loaded run (warm-up included: an estimate)
                loaded["gateway_cpu_us"] = (cpu_s(gw) - cpu0) / (loaded["rps"] * (seconds + warmup_s)) * 1e6
                results[name]["loaded"].append(loaded)
                results[name]["lone"].append(run_load(lone_client, where, 1, warmup_s, seconds, *extra))
                if lightest is not None:
                    lone = run_load(lightest, where, 1, warmup_s, seconds, *extra)
                    results[name]["lightest"].append(lone)
            rows8.append(run_load(http_load, http_port, args.concurrency, warmup_s, seconds, 8, True))
    summary = {
        name: {
            "rps": statistics.median(r["rps"] for r in res["loaded"]),
            "p99_loaded_ms": statistics.median(r["p99_ms"] for r in res["loaded"]),
            "gateway_cpu_us": statistics.median(r["gateway_cpu_us"] for r in res["loaded"]),
            "p50_ms": statistics.median(r["p50_ms"] for r in res["lone"]),
            "p99_ms": statistics.median(r["p99_ms"] for r in res["lone"]),
            # the lone figures of the lightest client (pycurl; the same client for direct)
            "lightest_p50_ms": statistics.median(r["p50_ms"] for r in res["lightest"] or res["lone"]),
            "lightest_p99_ms": statistics.median(r["p99_ms"] for r in res["lightest"] or res["lone"]),
        }
        for name, res in results.items()
    }
    direct = summary["direct (ZeroMQ)"]
    rows = []
    for name, sm in summary.items():
        added = sm["p50_ms"] - direct["p50_ms"]
        lightest = sm["lightest_p50_ms"] - direct["p50_ms"]
        through_gateway = not name.startswith(("direct", "floor"))
        rows.append(
            [
                name, sm["rps"], sm["rps"] / direct["rps"], sm["p50_ms"], sm["p99_ms"], added,
                sm["lightest_p50_ms"], sm["lightest_p99_ms"], lightest,
                sm["gateway_cpu_us"] if through_gateway else "-",
                ("met" if lightest <= ADDED_P50_TARGET_MS else "missed") if through_gateway else "-",
            ]
        )  # fmt: skip
    table = md_table(
        ["path", f"req/s ({args.concurrency} in flight)", "of direct", "lone p50 ms", "lone p99 ms",
         "added p50 ms", "lightest client: lone p50 ms", "p99 ms", "added p50 ms",
         "gateway CPU us/request", f"added p50 <= {ADDED_P50_TARGET_MS} ms (lightest client)"],
        rows,
    )  # fmt: skip
    one_row = summary["HTTP, binary data"]["rps"]
    eight = statistics.median(r["rows_per_s"] for r in rows8)
    body = (
        f"echo model, 1 worker, max batch 32, max wait 1 ms; one gateway process; every request "
        f"FP32 [1, 4]; {runs} interleaved run(s) of {seconds:g} s after {warmup_s:g} s, median. Lone "
        "requests: http.client and grpcio's blocking stub; the lightest client is libcurl (pycurl, "
        "over HTTP/2 for gRPC), whose own work is C, as the direct path's pre-encoded DEALER does "
        "little.\n\n"
        f"{table}\n\nRows: HTTP binary requests of 8 rows move {eight:,.0f} rows/s against "
        f"{one_row:,.0f} of 1 row ({eight / one_row:.2f}x).\n"
    )
    print(body)
    write_results(
        NAME,
        TITLE,
        body,
        {"summary": summary, "runs": results, "rows8": rows8, "concurrency": args.concurrency},
        args.quick,
    )


def wait_for_gateway(port: int, timeout_s: float = 30.0) -> None:
    """Until the gateway answers /v2/health/live (it starts after the broker)."""
    wait_http_200(f"http://127.0.0.1:{port}/v2/health/live", timeout_s)


if __name__ == "__main__":
    main()
