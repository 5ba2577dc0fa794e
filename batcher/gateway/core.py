"""What the HTTP and gRPC front ends share: one DEALER to the broker, and the v2 calls.

Every request of every front end goes over the one `BrokerLink` (an AsyncClient), so a
gateway keeps any number of rows in flight with no thread per request, and the broker
batches them with everyone else's. A request of k rows is k batcher requests, awaited
together; the first error answers the whole request and cancels its other rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import zmq

from batcher import __version__
from batcher.client.sync import cancel_body, open_dealer
from batcher.core.link import Backoff, Drop, PeerLink
from batcher.core.replies import ReplyTable
from batcher.core.row_deadline import RowDeadline, RowStep
from batcher.gateway import oip
from batcher.gateway.bodies import pack_request
from batcher.gateway.metrics import GatewayMetrics
from batcher.gateway.names import NAMES_TTL_S as NAMES_TTL_S  # its old home
from batcher.gateway.names import ModelNames
from batcher.gateway.settings import GatewaySettings as GatewaySettings  # its old home
from batcher.transport.connection_watch import ConnectionWatch
from batcher.transport.zmqio import readable, recv_frames, send_frames
from batcher.wire import protocol, tensor
from batcher.wire.protocol import ErrorCode

log = logging.getLogger("batcher.gateway")

#: The link's back-off between sockets (after a lost connection or a refused handshake),
#: doubling while connections last less than STABLE_S, as libzmq's RECONNECT_IVL(_MAX).
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 2.0
STABLE_S = 1.0
RECONNECT_BACKOFF = Backoff(initial_s=RECONNECT_MIN_S, cap_s=RECONNECT_MAX_S)
#: Messages the link may hold each way before a send is refused (`unavailable`).
LINK_HWM = 100_000
#: The largest body the link sends before it knows the broker's limits (the `limits`
#: control op): the hard frame limit of the smallest --max-message-bytes a broker takes
#: (1024, x4), so no message can make libzmq drop the link.
SAFE_BODY_BYTES = 4 * 1024
#: The limit taken from a broker too old to answer `limits`: BrokerSettings' default.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: What `GET /v2` and ServerMetadata say the gateway supports.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]


def _keep_view(value: dict[Any, Any]) -> dict[Any, Any]:
    return dict(value)  # a new map: unpack_viewing keeps the tensor's data a view


class BrokerLink:
    """The gateway's one DEALER to the broker, read on the event loop (loop.add_reader on
    its file descriptor): every row of every client is in flight over it at once, with no
    task of its own. Leaner than AsyncClient, which zmq.asyncio carries: measured in
    docs/benchmarks-history.md ("Gateway"). Replies keep tensors as raw maps (no numpy).

    It queues nothing while no broker is connected: a row that cannot leave is refused
    at once (503 `unavailable`) instead of waiting. A lost connection fails the rows in
    flight and replaces the socket, so a row given up on is never delivered to a broker
    that comes back later; so does a handshake libzmq gives up on (a refused CURVE key),
    which libzmq would never retry. A new socket comes after the link core's back-off
    (RECONNECT_BACKOFF), as libzmq's own reconnects do. Not ZMQ_IMMEDIATE, which would
    do the first with less code: libzmq then drops a reply that arrived just before the
    connection closed (the last reply of a draining broker) unless it had been read."""

    def __init__(self, settings: GatewaySettings, address: str | None = None) -> None:
        self.address = settings.connect if address is None else address
        #: Handshakes so far: a new one is a new connection (maybe a restarted broker).
        self.generation = 0
        self._settings = settings
        self._ctx: zmq.Context[Any] = zmq.Context()
        #: The requests sent and not answered yet, and their ids (batcher/core/replies.py).
        self._replies: ReplyTable[asyncio.Future[dict[str, Any]]] = ReplyTable()
        #: Rows to send at the end of this turn of the loop (`_flush`), by id, in order.
        self._unsent: dict[int, bytes] = {}
        self._flush_due = False
        self._loop = asyncio.get_running_loop()
        self._sock: zmq.Socket[Any] | None = None  # None between a lost socket and the next
        self._watch: ConnectionWatch | None = None
        self._why_down = "not connected yet"
        self._reopen: asyncio.TimerHandle | None = None
        #: When to open a new socket (batcher/core/link.py): heard at each handshake.
        self._link = PeerLink(RECONNECT_BACKOFF, stable_s=STABLE_S)
        #: The broker's --max-message-bytes, learnt (`learn_limits`) for each connection:
        #: a larger row is refused here (413), never sent, since past 4x that libzmq
        #: drops the one connection every client's rows share.
        self.max_message_bytes: int | None = None
        self._learning: asyncio.Future[int] | None = None
        self._open()  # raises (a key file that does not load): the gateway does not start

    def _open(self) -> None:
        s = self._settings
        self._reopen = None
        sock, watch = open_dealer(self._ctx, self.address, s.curve_server_key, s.curve_secret_key)
        sock.setsockopt(zmq.SNDHWM, LINK_HWM)
        sock.setsockopt(zmq.RCVHWM, LINK_HWM)
        self._sock, self._watch = sock, watch
        self._link.connected(self._loop.time())
        self._forget_limits()
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop.add_reader(self._fd, self._drain)
        self._monitor_fd = int(watch.monitor.getsockopt(zmq.FD))
        self._loop.add_reader(self._monitor_fd, self._on_monitor)
        self._on_monitor()  # the descriptor signals only once its socket has been looked at

    def _reopen_now(self) -> None:
        try:
            self._open()
        except Exception as exc:  # a key file gone, no descriptors left: try again later
            log.error("broker link: cannot open a socket to %s: %s", self.address, exc)
            self._why_down = f"cannot open a socket to it: {exc}"
            self._replace_later()

    def _replace_later(self) -> None:
        """Drop the socket now; open a new one after the back-off."""
        self._shut()
        drop = self._link.refused(self._why_down, self._loop.time())
        assert isinstance(drop, Drop)  # the link never gives up on its broker
        self._reopen = self._loop.call_later(drop.retry_in_s, self._reopen_now)

    def _shut(self) -> None:
        self._unsent.clear()  # dropped with the socket, as what it had not sent yet is
        sock, watch, self._sock, self._watch = self._sock, self._watch, None, None
        if sock is None or watch is None:
            return
        self._loop.remove_reader(self._fd)
        self._loop.remove_reader(self._monitor_fd)
        watch.close()
        sock.close(0)  # linger 0: what was not sent yet is dropped with it

    def why_unavailable(self) -> str:
        """Why a row cannot leave now (for its 503)."""
        refusal = self._watch.refusal() if self._watch is not None else self._why_down
        return f"the broker at {self.address} is not connected" + (f": {refusal}" if refusal else "")

    def _on_monitor(self) -> None:
        """A lost connection fails the rows in flight at once (503): the broker that held
        them is gone, and they would otherwise wait for their deadline."""
        watch = self._watch
        while watch is not None and readable(watch.monitor):
            was_up = watch.handshake_ok  # rows may have been sent (and wait unsent)
            events = watch.poll()
            if any(event == zmq.EVENT_HANDSHAKE_SUCCEEDED for event, _ in events):
                self._link.heard(self._loop.time())
                self.generation += 1
                self._forget_limits()  # a broker (re)connected: its limits may differ
            lost = any(event == zmq.EVENT_DISCONNECTED for event, _ in events)
            if lost:
                self._drain()  # the replies that came before the connection went: theirs
                self._fail_pending(
                    oip.OipError(
                        ErrorCode.UNAVAILABLE, f"the connection to the broker at {self.address} was lost"
                    )
                )
            if (lost and was_up) or watch.dead:  # else libzmq's own reconnects hold
                self._why_down = watch.refusal() or "the connection was lost; reconnecting"
                self._replace_later()
                return
            if not events:
                break

    def poll_monitor(self) -> None:
        """Read the connection's events now (a handshake done but not yet seen)."""
        self._on_monitor()

    @property
    def up(self) -> bool:
        """Connected, its handshake done: a row sent now leaves."""
        return self._watch is not None and self._watch.handshake_ok

    @property
    def outstanding(self) -> int:
        """Requests sent and not answered yet (rows and questions)."""
        return len(self._replies)

    def _fail_pending(self, error: oip.OipError) -> None:
        for fut in self._replies.take_all().values():
            if not fut.done():
                fut.set_exception(error)

    def close(self) -> None:
        """Stop reading; every row still waiting is answered `closed` (503)."""
        if self._reopen is not None:
            self._reopen.cancel()
        self._forget_limits()
        self._shut()
        self._ctx.term()
        self._fail_pending(oip.OipError("closed", "the gateway is closing"))

    def _forget_limits(self) -> None:
        self.max_message_bytes = None
        if self._learning is not None and not self._learning.done():
            self._learning.cancel()
        self._learning = None

    async def learn_limits(self, wait_s: float) -> int:
        """The broker's --max-message-bytes, asked (`limits`) once per connection; until it
        is known, nothing larger than SAFE_BODY_BYTES is sent. OipError as for `call`."""
        while self.max_message_bytes is None:
            if self._learning is None or self._learning.done():
                self._learning = self._loop.create_task(_ask_limits(self, wait_s))
            learning = self._learning
            try:
                return await asyncio.shield(learning)
            except asyncio.CancelledError:
                if not learning.cancelled():
                    raise  # we are cancelled, not the question
                # a new connection came while it was asked: ask it
        return self.max_message_bytes

    def send(self, fields: dict[str, Any]) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """Send one request now; (its id, the future of its reply). OipError `unavailable`
        when it cannot leave (no broker connected, or the link's queue is full)."""
        return self.send_packed(*self.pack(fields))

    def pack(self, fields: dict[str, Any]) -> tuple[int, bytes]:
        """A request's id and body, to send with `send_packed`; `too_large` (413) when it
        is over the broker's --max-message-bytes (SAFE_BODY_BYTES while that is not
        known), so that a request of many rows is refused before any of them leaves."""
        req_id = self._replies.new_id()
        body = pack_request({"id": req_id, **fields})
        limit = self.max_message_bytes
        if len(body) > (limit or SAFE_BODY_BYTES):
            where = "the broker's --max-message-bytes" if limit else "what may go before its limits are known"
            raise oip.OipError(
                ErrorCode.TOO_LARGE,
                f"a row of this request is {len(body)} bytes as a batcher request, over {where} "
                f"({limit or SAFE_BODY_BYTES})",
            )
        return req_id, body

    def send_packed(
        self, req_id: int, body: bytes, now: bool = True
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        """Send a body from `pack`; as `send`. With `now` false it leaves with the others
        queued so in this turn of the event loop, back to back (`_flush`); its future
        then fails `unavailable` if the link's queue is full."""
        sock, watch = self._sock, self._watch
        if sock is None or watch is None or not watch.handshake_ok:
            self._on_monitor()  # the handshake may be done with its event not yet read
            sock, watch = self._sock, self._watch
            if sock is None or watch is None or not watch.handshake_ok:
                raise oip.OipError(ErrorCode.UNAVAILABLE, self.why_unavailable())
        fut = self._replies.add(req_id, self._loop.create_future())
        if not now:
            self._unsent[req_id] = body
            if not self._flush_due:
                self._flush_due = True
                self._loop.call_soon(self._flush)
            return req_id, fut
        self._flush()  # what was queued before it leaves first
        try:
            send_frames(sock, [b"", body])
        except zmq.Again:
            self._replies.forget(req_id)
            raise oip.OipError(ErrorCode.UNAVAILABLE, self.why_unavailable()) from None
        except BaseException:
            self._replies.forget(req_id)
            raise
        finally:
            self._drain()  # a send may take the descriptor's edge: read what is there now
        return req_id, fut

    def _flush(self) -> None:
        """Send the rows `send_packed` queued, in order, back to back: libzmq's I/O thread
        is woken once for all of them (a send that wakes it took 25 to 43 us of this
        VM's CPU, one behind another 0.6 us), and writes them to the broker together."""
        self._flush_due = False
        if not self._unsent:
            return
        unsent, self._unsent = self._unsent, {}
        sock = self._sock
        try:
            for req_id, body in unsent.items():
                fut = self._replies.get(req_id)
                if fut is None or fut.done():
                    continue  # forgotten, or answered (a lost connection), before it left
                try:
                    if sock is None:
                        raise zmq.Again
                    send_frames(sock, [b"", body])
                except zmq.Again:
                    self._replies.forget(req_id)
                    fut.set_exception(oip.OipError(ErrorCode.UNAVAILABLE, self.why_unavailable()))
                except Exception as exc:  # as `send_packed` would have raised it to its caller
                    self._replies.forget(req_id)
                    fut.set_exception(exc)
        finally:
            self._drain()  # a send may take the descriptor's edge: read what is there now

    def forget(self, req_id: int, cancel: bool) -> None:
        """Stop waiting for `req_id`; with `cancel`, ask the broker to drop it if queued."""
        fut = self._replies.forget(req_id)
        if fut is not None and not fut.done():
            fut.cancel()
        if self._unsent.pop(req_id, None) is not None:
            return  # it never left: nothing to drop at the broker
        if cancel:
            self.cancel(req_id)

    def cancel(self, req_id: int) -> None:
        """Ask the broker to drop `req_id` if it is still queued; its reply, if one comes
        (it was in a batch already), is still awaited."""
        self._flush()  # the cancel goes after the row it is for
        sock = self._sock
        if sock is None:
            return  # no broker: nothing of ours is queued anywhere
        try:
            with contextlib.suppress(zmq.Again, zmq.ZMQError):
                send_frames(sock, [b"", cancel_body(req_id)])
        finally:
            self._drain()  # as after any send: a reply may be waiting unsignalled

    def _drain(self) -> None:
        """Every reply waiting on the socket to its future (late and unknown ones dropped)."""
        sock = self._sock
        if sock is None:
            return
        try:
            while readable(sock):
                frames = recv_frames(sock, copied=1)
                try:
                    reply = _decode_reply(frames[-1])
                    fut = self._replies.match(reply["id"])
                except Exception:
                    continue  # not a reply of ours
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except zmq.ZMQError as exc:  # closed under us: nothing more to read
            log.debug("broker link: %s", exc)

    async def call(self, fields: dict[str, Any], wait_s: float) -> dict[str, Any]:
        """One request and its whole reply map; OipError `timeout` after `wait_s`."""
        req_id, fut = self.send(fields)
        try:
            async with asyncio.timeout(wait_s):
                return await fut
        except TimeoutError:
            raise oip.OipError(
                "timeout", f"no reply from the broker at {self.address} in {wait_s:g} s"
            ) from None
        finally:
            if _unanswered(fut):  # a timeout or a cancel cancels the future itself
                self.forget(req_id, cancel="op" not in fields)


async def _ask_limits(self: BrokerLink, wait_s: float) -> int:
    """The `limits` question of BrokerLink.learn_limits, on the connection of now."""
    sock = self._sock
    try:
        reply = await self.call({"op": "limits"}, wait_s)
        _raise_if_error(reply)
        limits = reply.get("output")
    except oip.OipError as exc:
        if exc.code != ErrorCode.BAD_REQUEST:
            raise
        log.warning(
            "broker link: the broker at %s does not say its limits (%s); taking its default "
            "--max-message-bytes %d",
            self.address,
            exc,
            DEFAULT_MAX_MESSAGE_BYTES,
        )
        limits = {}
    value = limits.get("max_message_bytes") if isinstance(limits, dict) else None
    limit = value if type(value) is int and value > 0 else DEFAULT_MAX_MESSAGE_BYTES
    if self._sock is sock:  # still the connection it was asked on
        self.max_message_bytes = limit
    return limit


def _unanswered(fut: asyncio.Future[Any]) -> bool:
    """No reply came: still waiting, or cancelled (by a timeout, an error of a sibling
    row, or the client going away)."""
    return not fut.done() or fut.cancelled()


def _decode_reply(frame: Any) -> dict[str, Any]:
    if len(frame) >= tensor.VIEW_BYTES:
        with contextlib.suppress(Exception):
            return tensor.unpack_viewing(frame, "output", _keep_view)
    reply: dict[str, Any] = protocol.unpack(frame if isinstance(frame, bytes) else frame.bytes)
    return reply


class Gateway:
    """The v2 operations over the gateway's brokers (create inside the event loop): one
    link each (batcher.gateway.brokers), every row routed to one ready for its model."""

    tracer: Any = None  #: the gateway's tracer when tracing is on (set by server.serve)

    def __init__(self, settings: GatewaySettings) -> None:
        from batcher.gateway.brokers import BrokerPool  # it builds on BrokerLink, above

        self.settings = settings
        #: Each (model, version)'s input and output names (batcher.gateway.names).
        self.names = ModelNames(self._control)
        self.metrics = GatewayMetrics()  # request durations, spans dropped (/metrics)
        self.pool = BrokerPool(settings)
        self.pool.start()

    @property
    def link(self) -> BrokerLink:
        """The link of the first broker (the only one of a gateway given one --connect)."""
        return self.pool.any_link()

    async def close(self) -> None:
        self.pool.close()

    # --- health and metadata ----------------------------------------------------------------

    async def _control(self, op: str, link: BrokerLink | None = None, **fields: Any) -> Any:
        """A control request to `link` (else an open broker's), waiting at most the probe
        timeout; OipError on failure."""
        link = self.pool.any_link() if link is None else link
        wait_s = self.settings.probe_timeout_ms / 1000.0
        if link.max_message_bytes is None:
            await link.learn_limits(wait_s)  # a model's name may be long (gRPC)
        reply = await link.call({"op": op, **fields}, wait_s)
        _raise_if_error(reply)
        return reply.get("output")

    async def ready(self) -> bool:
        """Ready when some broker answers, and every model some broker has configured is
        ready (has a worker) on one that is not draining, and some model is (a broker with
        no model serves nothing): core.routing.gateway_ready over every broker's stats now."""
        from batcher.core.routing import BrokerHealth, gateway_ready

        healths = []
        for _, stats in await self.pool.all_stats():
            if isinstance(stats, dict):
                health = BrokerHealth(connected=True)
                health.heard(stats, 0.0)
                healths.append(health)
        return gateway_ready(healths, 0.0, 1.0)

    async def metadata(self, model: str, version: str = "") -> dict[str, Any]:
        """The model's v2 metadata, from every connected broker: ready when one has it
        ready; unknown_model (404) for a model or version none serves."""
        check_version(model, version)
        asked = {"version": version} if version else {}
        links = [b.link for b in self.pool.brokers.values() if b.link.up] or [self.pool.any_link()]
        answers = await asyncio.gather(
            *(self._control("metadata", link, model=model, **asked) for link in links), return_exceptions=True
        )
        metas = [m for m in answers if isinstance(m, dict)]
        if not metas:
            errors = [e for e in answers if isinstance(e, oip.OipError)]
            unknown = [e for e in errors if e.code == ErrorCode.UNKNOWN_MODEL]
            raise (unknown or errors or [oip.OipError(ErrorCode.INTERNAL, repr(answers))])[0]
        meta = next((m for m in metas if m.get("ready")), metas[0])
        self.names.learned(model, version, meta)
        return {
            "name": model,
            "versions": meta.get("versions") or [oip.MODEL_VERSION],
            "platform": "batcher",
            "inputs": meta.get("inputs") or [],
            "outputs": meta.get("outputs") or [],
            "ready": any(bool(m.get("ready")) for m in metas),
        }

    async def model_ready(self, model: str, version: str = "") -> bool:
        try:
            return bool((await self.metadata(model, version))["ready"])
        except oip.OipError:
            return False

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "batcher", "version": __version__, "extensions": EXTENSIONS}

    # --- inference --------------------------------------------------------------------------

    async def infer(self, request: oip.InferRequest, trace: Any = None) -> list[oip.OutputTensor]:
        """The request's outputs (see `answer`)."""
        return (await self.answer(request, trace))[0]

    async def answer(
        self, request: oip.InferRequest, trace: Any = None
    ) -> tuple[list[oip.OutputTensor], str]:
        """The request's rows through the brokers (each to its own), joined, and the
        version that answered ("" for a model outside a repository); OipError for any
        failure.

        Every row carries a deadline (the request's timeout, else the gateway's
        --request-timeout-ms), so the broker drops rows whose client was answered 504."""
        from batcher.gateway.brokers import Row

        check_version(request.model, request.version)
        inputs = oip.row_inputs(request.inputs)
        timeout_ms = request.timeout_ms or self.settings.request_timeout_ms
        # What is asked before the rows go (the broker's limits, the model's input names,
        # each once and cached) comes out of the request's own time, never on top of it.
        loop = asyncio.get_running_loop()
        started = loop.time()
        budget_s = min(self.settings.probe_timeout_ms, timeout_ms) / 1000.0
        known = self.names.fresh(request.model, request.version)
        if known is not None:
            input_names = known[0]  # no task, no timer: the common case
        else:
            try:
                input_names, _ = await asyncio.wait_for(
                    self.names.get(request.model, request.version), budget_s
                )
            except TimeoutError:
                input_names = None  # the broker is slow to say: it checks the signature itself
        if input_names is not None:
            check_input_names(request, input_names)
        brokers = [self.pool.choose(request.model) for _ in inputs]
        for link in {b.link for b in brokers if b.link.max_message_bytes is None}:
            await link.learn_limits(max(0.001, budget_s - (loop.time() - started)))
        timeout_ms = max(1.0, timeout_ms - (loop.time() - started) * 1000.0)
        model, retry = request.model, request.retry
        fields = [_row_fields(request, r, timeout_ms) for r in inputs]
        for context in [trace.round_trip(model, len(inputs))] if trace is not None else ():
            fields = [{**f, **context} for f in fields]  # each row a child of the round trip
        rows = [Row(self.pool, model, f, retry) for f in fields]
        sent: list[Row] = []
        # Rows still unanswered past their deadline are cancelled at the broker, then given
        # up on (batcher.core.row_deadline), so the cancels have left well before a 504
        # tells anyone, and a broker that resumes reads them before it could run those
        # rows. One timer a request does both (a timer costs about 5 us here,
        # asyncio.timeout twice that).
        timeline = RowDeadline(loop.time() + timeout_ms / 1000.0)
        timer: list[asyncio.TimerHandle] = []  # the one pending
        timer.append(loop.call_at(timeline.cancel_at, self._row_timer, sent, timer, timeline))
        try:
            packed = [(row, b, *b.link.pack(row.fields)) for row, b in zip(rows, brokers, strict=True)]
            for row, broker, req_id, body in packed:
                row.send_packed(broker, req_id, body, now=False)
                sent.append(row)
            if len(sent) == 1:
                replies = [await sent[0].future]
                _raise_if_error(replies[0])
            else:
                replies = await _all_or_first_error([row.future for row in sent])
        finally:  # rows not answered (an error, a timeout, a client gone): dropped at the broker
            timer[0].cancel()
            for row in sent:
                if _unanswered(row.future):
                    row.forget(cancel=not row.cancelled)
        values = [r.get("output") for r in replies]
        # The version that answered (the worker's reply says: docs/protocol.md 4.3); rows a
        # split sent to different versions name each, in order: "2,3".
        answered = dict.fromkeys(str(r["version"]) for r in replies if r.get("version") is not None)
        names = await self._output_names(model, values[0], list(answered), request.version)
        outputs = oip.select_outputs(oip.join_outputs(values, names), request.outputs)
        size, limit = sum(oip.output_size(o) for o in outputs), self.settings.max_response_bytes
        if size > limit:
            raise oip.OipError(
                ErrorCode.TOO_LARGE, f"the outputs hold {size} bytes, over the gateway's {limit}"
            )
        return outputs, ",".join(answered)

    async def _output_names(
        self, model: str, first: Any, answered: list[str], asked: str
    ) -> list[str] | None:
        """The output names to name a lone output after (None: the outputs are named): the
        answering version's (the one asked for, when rows of a split differ)."""
        if oip.named_outputs(first):
            return None
        version = answered[0] if len(answered) == 1 else asked
        known = self.names.fresh(model, version)
        return (known if known is not None else await self.names.get(model, version))[1]

    def _row_timer(self, sent: list[Any], timer: list[asyncio.TimerHandle], timeline: RowDeadline) -> None:
        """Do what `timeline` says is due for the rows still unanswered: cancel them at
        their broker (and wake again to give up), or fail them `timeout`."""
        loop = asyncio.get_running_loop()
        step = timeline.step(loop.time())
        if step is RowStep.WAIT:  # a timer that fired early: wait for the step
            timer[0] = loop.call_at(timeline.next_wakeup(loop.time()), self._row_timer, sent, timer, timeline)
            return
        if step is RowStep.CANCEL_AT_BROKER:
            for row in sent:
                if not row.future.done():
                    row.cancel_at_broker()
            timer[0] = loop.call_at(timeline.give_up_at, self._row_timer, sent, timer, timeline)
            return
        for row in sent:
            if not row.future.done():
                where = row.broker.address if row.broker is not None else "?"
                error = oip.OipError("timeout", f"no reply from the broker at {where} in time")
                row.future.set_exception(error)
                row.forget(cancel=False)  # cancelled already


def check_input_names(request: oip.InferRequest, known: list[str]) -> None:
    """Every input must be one of the model's (Triton's check): a model of one input is
    sent its tensor alone, so a wrong name would otherwise never be seen."""
    for t in request.inputs:
        if t.name not in known:
            raise oip.bad_request(
                f"unexpected inference input '{t.name}' for model '{request.model}': its inputs are {known}"
            )


def _row_fields(request: oip.InferRequest, row: Any, timeout_ms: float) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": request.model, "timeout_ms": timeout_ms}
    if request.version:  # a repository's version (docs/models.md); none: its newest or split
        fields["version"] = request.version
    if request.priority is not None:
        fields["priority"] = request.priority
    fields["input"] = row  # last: `pack_request` writes its tensors after the rest
    return fields


def check_version(model: str, version: str) -> None:
    """A version is a number (the broker says whether the model serves it: a repository's
    model its versions, any other model version 1 alone)."""
    if version and not version.isdigit():
        raise oip.OipError(ErrorCode.UNKNOWN_MODEL, f"model '{model}' has no version '{version}'")


def _raise_if_error(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise oip.OipError(str(err.get("code", ErrorCode.INTERNAL)), str(err.get("message", "")))


async def _all_or_first_error(calls: Sequence[asyncio.Future[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every row's reply in order; on the first error (reply or exception), the rows
    still waiting are cancelled (the broker drops those still queued) and it is raised.
    If the caller is cancelled (its client went away), so is every row. O(rows): one
    callback per row, no wait over the pending set."""
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    remaining = len(calls)

    def on_done(fut: asyncio.Future[dict[str, Any]]) -> None:
        nonlocal remaining
        if fut.cancelled():
            return
        if finished.done():
            fut.exception()  # retrieved: a later row's error is not the request's
            return
        try:
            exc = fut.exception()
            if exc is None:
                _raise_if_error(fut.result())
            else:
                raise exc
        except Exception as error:
            finished.set_exception(error)
            return
        remaining -= 1
        if remaining == 0:
            finished.set_result(None)

    for fut in calls:
        fut.add_done_callback(on_done)
    try:
        await finished
        return [fut.result() for fut in calls]
    finally:
        for fut in calls:
            if not fut.done():
                fut.cancel()
