"""Which HTTP server the gateway is built on: the server's CPU per request, in one run.

Each candidate serves the same v2-shaped handler (read the body, decode the JSON, encode
a JSON reply) from its own process; one aiohttp load process keeps --concurrency
requests in flight for a few seconds; the figure is the server process's CPU time per
request (psutil), which does not depend on how fast the load generator is. Candidates
that are not installed are skipped, saying so:

- aiohttp on asyncio's loop, and on uvloop;
- uvicorn (httptools, uvloop) with starlette;
- uvicorn (httptools, asyncio's loop) with a raw ASGI app: what the gateway runs on.

The gateway's own figure that decided it, a lone request's added latency, is measured
by benchmarks/gateway.py (its floor rows): CPU per request under load is close for all
of them.

    python benchmarks/http_servers.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from common import md_table, write_results

from batcher.launcher import free_tcp_address

NAME = "http_servers"
TITLE = "HTTP servers for the gateway: CPU per request"
CANDIDATES = {
    "aiohttp (asyncio)": ["aiohttp"],
    "aiohttp (uvloop)": ["aiohttp", "uvloop"],
    "uvicorn + starlette (httptools, uvloop)": ["uvicorn", "starlette", "httptools", "uvloop"],
    "uvicorn, raw ASGI (httptools, asyncio)": ["uvicorn", "httptools"],
}
BODY = json.dumps(
    {"id": "1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
)


def server(kind: str, port: int) -> None:
    """The candidate's server, until killed."""
    if kind.startswith("aiohttp"):
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
            app, host="127.0.0.1", port=port, http="httptools", loop="asyncio", lifespan="off",
            log_level="error", access_log=False,
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


def load(port: int, concurrency: int, seconds: float) -> int:
    """Requests answered in `seconds` with `concurrency` in flight (after a warm-up)."""
    import asyncio

    import aiohttp

    async def main() -> int:
        done = 0
        url = f"http://127.0.0.1:{port}/v2/models/echo/infer"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
            for _ in range(200):
                async with session.post(url, data=BODY) as r:
                    await r.read()
            stop = time.perf_counter() + seconds

            async def one() -> None:
                nonlocal done
                for _ in range(100_000_000):  # bounded; ends at `stop`
                    if time.perf_counter() >= stop:
                        return
                    async with session.post(url, data=BODY) as r:
                        assert r.status == 200
                        await r.read()
                    done += 1

            await asyncio.gather(*(one() for _ in range(concurrency)))
        return done

    return asyncio.run(main())


def measure(kind: str, concurrency: int, seconds: float) -> dict[str, Any]:
    import psutil

    port = int(free_tcp_address().rsplit(":", 1)[1])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)])
    try:
        deadline = time.monotonic() + 20
        for _ in range(10_000):  # until it listens
            try:
                load(port, 1, 0.01)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # between probes of a starting process
        ps = psutil.Process(proc.pid)
        cpu0 = sum(ps.cpu_times()[:2])
        done = load(port, concurrency, seconds)
        cpu = sum(ps.cpu_times()[:2]) - cpu0
        return {"rps": done / seconds, "cpu_us_per_request": cpu / (done + 200) * 1e6}
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        server(args.serve[0], int(args.serve[1]))
        return
    seconds, runs = (2.0, 1) if args.quick else (4.0, 3)
    present = {k: all(importlib.util.find_spec(m) for m in mods) for k, mods in CANDIDATES.items()}
    results: dict[str, list[dict[str, Any]]] = {k: [] for k, ok in present.items() if ok}
    for _ in range(runs):  # interleaved
        for kind in results:
            results[kind].append(measure(kind, args.concurrency, seconds))
    rows = [
        [
            kind,
            statistics.median(r["cpu_us_per_request"] for r in res),
            statistics.median(r["rps"] for r in res),
        ]
        for kind, res in results.items()
    ]
    rows += [[kind, "not installed", ""] for kind, ok in present.items() if not ok]
    table = md_table(["server", "server CPU us/request", f"req/s ({args.concurrency} in flight)"], rows)
    body = (
        f"A v2-shaped JSON echo handler; one aiohttp load process, {args.concurrency} in flight, "
        f"{runs} interleaved run(s) of {seconds:g} s, median. req/s is bound by the load process."
        f"\n\n{table}\n"
    )
    print(body)
    write_results(NAME, TITLE, body, {"results": results}, args.quick)


if __name__ == "__main__":
    main()
