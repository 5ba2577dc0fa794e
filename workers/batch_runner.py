"""The batch path of a worker: one BATCH message decoded, run through the model once, and
answered with one REPLY (run_batch), in parts an overlapping worker runs apart
(prepare_batch, call_model, finish_batch). No sockets: frames in, frames out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgpack
import msgspec
import zmq

from batcher.errors import BatcherError
from batcher.extras import install_command
from batcher.settings import MAX_BATCH_SIZE
from batcher.wire import protocol, tensor
from batcher.wire.protocol import ErrorCode
from workers import fastpath
from workers.connection import BrokerConnection
from workers.models import ModelFn
from workers.multiplexed import Shelf, batch_model, not_served, version_of
from workers.overlap import ModelThread
from workers.steps import StepRunner

log = logging.getLogger("batcher.worker")

R = TypeVar("R")
#: How long a step-level worker waits at a time for its socket to take a CHUNK (ms).
OUTBOX_WAIT_MS = 10
#: Batches with a model thread at once (workers/overlap.py): the one it runs and the next.
OVERLAP_BATCHES = 2


class MalformedBatch(BatcherError, ValueError):
    """A BATCH message the worker cannot run. `batch_id` is None when even the header is
    unreadable: then there is nobody to answer, and the batch is dropped."""

    def __init__(self, message: str, batch_id: int | None) -> None:
        super().__init__(message)
        self.batch_id = batch_id


#: This process's tracer when tracing is on (batcher.observe.spans.Tracer), else None.
_tracer: Any = None


def set_tracer(tracer: Any) -> None:
    """Trace the batches this process runs (None: not), as `run_worker` says."""
    global _tracer
    _tracer = tracer


class _BatchHeader(msgspec.Struct, array_like=True):
    """A BATCH header's first three elements, decoded and checked in one call by msgspec,
    in C: on a lone request's cold CPU, the general decode and its checks took a third of
    the worker's time before the model (docs/benchmarks-history.md). Later elements (the
    traceparent, the model) are left to whoever reads them."""

    batch_id: int
    queue_ms: Any  # a list when usable (each value checked where it is used)
    lengths: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_BATCH_SIZE)]


_decode_batch_header = msgspec.msgpack.Decoder(_BatchHeader).decode


def _decode_header(header_frame: bytes) -> tuple[int, list[Any] | None, list[int]]:
    """(batch id, queue_ms list or None when unusable, each body's length) from a BATCH
    header; MalformedBatch without an id when no integer batch id can be read, with it
    when the lengths cannot. A 4th element (the batch span's traceparent) is read by
    `_trace_of`, and only when tracing is on. The usual header is read by msgspec
    (`_BatchHeader`), any other by `_checked_header`, which says what is wrong with it
    (the same verdict either way: a property test)."""
    try:
        header = _decode_batch_header(header_frame)
    except (msgspec.DecodeError, RecursionError):  # (ValidationError is one; RecursionError:
        return _checked_header(header_frame)  # nested past Python's limit, msgpack reads 1024)
    queue_ms = header.queue_ms
    return header.batch_id, queue_ms if isinstance(queue_ms, list) else None, header.lengths


def _checked_header(header_frame: bytes) -> tuple[int, list[Any] | None, list[int]]:
    """_decode_header's checks, one by one, in Python."""
    try:
        header = protocol.unpack(header_frame)
    except Exception as exc:  # msgpack raises several unrelated types
        header = _first_three(header_frame)  # the elements a worker reads (protocol.md 6.3)
        if header is None:
            raise MalformedBatch(f"header is not msgpack: {type(exc).__name__}: {exc}", None) from None
    if not isinstance(header, list) or not header or type(header[0]) is not int:
        raise MalformedBatch(
            f"header must be [batch_id, queue_ms, lengths], got {protocol.clip(header)}", None
        )
    lengths = header[2] if len(header) > 2 else None
    if not isinstance(lengths, list) or not protocol.naturals(lengths):
        raise MalformedBatch(f"header must hold the bodies' lengths, got {protocol.clip(header)}", header[0])
    if len(lengths) > MAX_BATCH_SIZE:  # no broker sends more (--max-batch-size); each costs a reply
        raise MalformedBatch(f"a batch holds at most {MAX_BATCH_SIZE} bodies, got {len(lengths)}", header[0])
    queue_ms = header[1] if isinstance(header[1], list) else None
    return header[0], queue_ms, lengths


def _first_three(header_frame: bytes) -> list[Any] | None:
    """[batch_id, queue_ms, lengths] of a header msgpack cannot decode whole: nothing past
    the third is read (protocol.md 6.3: ignored, as `_BatchHeader` skips it), a queue_ms
    msgpack refuses is None (unusable). None if the id or the lengths cannot be read."""
    try:
        elements = _raw_elements(header_frame)
        batch_id, lengths = protocol.unpack(elements[0]), protocol.unpack(elements[2])
    except Exception:  # msgspec's and msgpack's several unrelated types (too few: IndexError)
        return None
    with contextlib.suppress(Exception):  # msgpack raises several unrelated types
        return [batch_id, protocol.unpack(elements[1]), lengths]
    return [batch_id, None, lengths]


#: A msgpack array's elements as their raw bytes, none decoded.
_raw_elements = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode


def _decode_requests(bodies: list[Any]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The batch's request maps, tensors in them as numpy arrays viewing the bytes
    msgpack decoded (docs/protocol.md, "Tensors"); and, by position, why a request cannot
    be run: a body that is not a msgpack map (the broker reads only its header), or a
    malformed tensor. That request is answered `bad_request` and never reaches the model."""
    requests: list[dict[str, Any]] = []
    bad: dict[int, str] = {}
    for i, body in enumerate(bodies):
        try:
            request, why = _decode_request(body)
        except TypeError as exc:  # valid msgpack, but a map key that is an array or a map
            request = {"id": protocol.id_of(body)}
            why = f"body has a map key that is an array or a map, which is not supported ({exc})"
        except Exception as exc:  # msgpack raises several unrelated types
            request, why = {"id": protocol.id_of(body)}, f"body cannot be decoded: {protocol.describe(exc)}"
        if not isinstance(request, dict):
            request, why = {}, f"body must be a msgpack map, got {type(request).__name__}"
        requests.append(request)
        if why is not None:
            bad[i] = why
    return requests, bad


def _decode_request(body: Any) -> tuple[Any, str | None]:
    """One request body decoded, and why one of its tensors is malformed (None if none is).
    A large body's input tensors, in the usual forms, are arrays viewing the received
    frame (tensor.unpack_viewing); any other tensor is an array viewing the bytes
    msgpack decoded it into."""
    if len(body) < protocol.ZERO_COPY_BYTES and b"datatype" not in body:
        return protocol.unpack(body), None  # no tensor: the plain decode (a C-speed scan)
    malformed: list[str] = []

    def arrays(value: dict[Any, Any]) -> Any:
        array, why = _array(value)
        if why is not None:
            malformed.append(why)
        return array

    if len(body) >= protocol.ZERO_COPY_BYTES:
        try:
            request = tensor.unpack_viewing(body, "input", arrays)
            return request, malformed[0] if malformed else None
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            malformed.clear()  # not a map of str keys: the plain decode says what is wrong
    request = msgpack.unpackb(body, raw=False, strict_map_key=False, object_hook=arrays)
    return request, malformed[0] if malformed else None


def _array(value: dict[Any, Any]) -> tuple[Any, str | None]:
    """A tensor map as a numpy array (and None), a malformed one as itself and why; any
    other map as itself."""
    if not tensor.is_tensor(value):
        return value, None
    try:
        return tensor.to_array(value), None
    except (tensor.TensorError, ValueError) as exc:  # ValueError: numpy refused the shape
        return value, str(exc)
    except ImportError:
        return (
            value,
            f"this worker takes no tensors: numpy is not installed here ({install_command('tensors')})",
        )


class PreparedBatch(msgspec.Struct):
    """A BATCH decoded and ready for the model: what run_batch does before the model call,
    apart from it so that an overlapping worker does it while the model runs another. A
    Struct, made in C: a lone request's worker pays each Python frame on a cold CPU."""

    batch_id: int
    queue_ms: list[Any]
    everything: list[Any]  # every request map, by position
    bad: dict[int, str]  # position -> why that request never reaches the model
    live: list[int]  # the positions the model runs
    inputs: Any  # the model's argument: the live requests' inputs
    arrived_at: float | None
    trace: Any = None  # the batch span's context when the batch is traced here
    decode_s: tuple[float, float] = (0.0, 0.0)  # its decode began and ended (monotonic), when traced


class ModelOutcome(msgspec.Struct):
    """What the model call gave: its outputs, or the exception that failed the batch (a
    Struct, as PreparedBatch)."""

    outputs: Any
    error: Exception | None
    infer_ms: float
    wait_ms: float | None  # from the BATCH's arrival to the model call
    padding: tuple[int, int] | None
    model_s: tuple[float, float] = (0.0, 0.0)  # the model call began and ended (monotonic), when traced


def prepare_batch(
    header_frame: bytes, body_frames: list[Any], arrived_at: float | None = None
) -> PreparedBatch:
    """Decode a BATCH for the model; MalformedBatch for one that cannot be run."""
    begun = time.monotonic() if _tracer is not None else 0.0
    batch_id, queue_ms, lengths = _decode_header(header_frame)
    plain = fastpath.decode_plain(lengths, body_frames)  # small, no tensors: in one pass
    fast = None
    bad: dict[int, str]
    if plain is not None:
        everything, bad = plain, {}
    else:
        try:
            bodies = protocol.split_bodies(lengths, body_frames)
        except ValueError as exc:
            raise MalformedBatch(f"the bodies do not match the header: {exc}", batch_id) from None
        fast = fastpath.decode_uniform(bodies)  # one tensor each, all alike: decoded as one batch
        everything, bad = (fast[0], {}) if fast is not None else _decode_requests(bodies)
    if queue_ms is None or len(queue_ms) != len(everything):
        # Only metadata: the requests themselves are fine, so they are answered.
        log.warning(
            "batch %d: queue_ms does not match its %d requests; replying without it",
            batch_id,
            len(everything),
        )
        queue_ms = [None] * len(everything)
    if bad:
        live = [i for i in range(len(everything)) if i not in bad]
        inputs = [everything[i].get("input") for i in live]
    else:
        live = list(range(len(everything)))
        inputs = fast[1] if fast is not None else [r.get("input") for r in everything]
    prepared = PreparedBatch(batch_id, queue_ms, everything, bad, live, inputs, arrived_at)
    if _tracer is not None:
        prepared.trace = _trace_of(header_frame)
        prepared.decode_s = (begun, time.monotonic())
    return prepared


def _trace_of(header_frame: bytes) -> Any:
    """The batch span's context from a BATCH header's 4th element (None: not traced, or
    a malformed traceparent, which is ignored)."""
    from batcher.observe.spans import span_context
    from batcher.wire.tracecontext import parse_traceparent

    try:  # read by msgspec, which skipped the elements past the third: msgpack may refuse them
        header = protocol.unpack(header_frame)
    except Exception:  # msgpack raises several unrelated types
        return None
    parent = parse_traceparent(header[3]) if len(header) > 3 else None
    return None if parent is None or not parent.sampled else span_context(parent)


def _log_ids(batch: PreparedBatch) -> dict[str, str]:
    """The trace and span id of a traced batch's span, for its log lines (JSON format)."""
    ctx = batch.trace
    return {} if ctx is None else {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}


def _record_spans(batch: PreparedBatch, outcome: ModelOutcome, encode_begun: float) -> None:
    """The worker's spans of a traced batch, children of its batch span: decode, model,
    encode (a failed model call's span says why)."""
    tracer, parent = _tracer, batch.trace
    n = len(batch.everything)
    attributes = {"batcher.batch_id": str(batch.batch_id), "batcher.batch_size": n}
    tracer.record("batcher.worker.decode", parent, *batch.decode_s, attributes)
    error = None if outcome.error is None else f"{type(outcome.error).__name__}: {outcome.error}"
    model_attrs = {**attributes, "batcher.infer_ms": float(outcome.infer_ms)}
    if outcome.wait_ms is not None:
        model_attrs["batcher.worker_wait_ms"] = float(outcome.wait_ms)
    tracer.record("batcher.worker.model", parent, *outcome.model_s, model_attrs, error=error)
    tracer.record("batcher.worker.encode", parent, encode_begun, time.monotonic(), attributes)


def call_model(model: ModelFn, batch: PreparedBatch) -> ModelOutcome:
    """Run the model on a prepared batch; the model's exception, or a wrong count of
    outputs, is the outcome's error, not raised."""
    arrived_at = batch.arrived_at
    # fastpath.round_ms: round(x, 3)'s float without its decimal conversion (a cold CPU's 23 us)
    wait_ms = None
    if arrived_at is not None:
        wait_ms = fastpath.round_ms(max(0.0, (time.monotonic() - arrived_at) * 1000.0))
    if getattr(model, "last_padding", None) is not None:
        with contextlib.suppress(AttributeError, TypeError):
            model.last_padding = None  # type: ignore[attr-defined]  # only this batch's counts
    n = len(batch.live)
    begun = time.monotonic() if batch.trace is not None else 0.0
    t0 = time.perf_counter()
    try:
        outputs = model(batch.inputs) if n else []
        if not isinstance(outputs, _SEQUENCE) or len(outputs) != n:
            got = f"{len(outputs)} outputs" if isinstance(outputs, _SEQUENCE) else repr(type(outputs))
            raise ValueError(f"model returned {got} for a batch of {n}")
    except Exception as exc:
        outcome = ModelOutcome(None, exc, (time.perf_counter() - t0) * 1000.0, wait_ms, None)
    else:
        infer_ms = fastpath.round_ms((time.perf_counter() - t0) * 1000.0)
        outcome = ModelOutcome(outputs, None, infer_ms, wait_ms, _padding_of(model))
    if batch.trace is not None:
        outcome.model_s = (begun, time.monotonic())
    return outcome


def finish_batch(
    batch: PreparedBatch, outcome: ModelOutcome, worker_name: str, version: str | None = None
) -> list[Any]:
    """The REPLY frames of a batch the model ran (see run_batch); a traced batch's spans.
    `version`: the repository version this worker serves, named in each ok reply."""
    if batch.trace is None:
        return _finish_batch(batch, outcome, worker_name, version)
    begun = time.monotonic()
    frames = _finish_batch(batch, outcome, worker_name, version)
    try:
        _record_spans(batch, outcome, begun)
    except Exception:  # a span is never worth a reply
        log.exception("could not record a batch's spans")
    return frames


def _finish_batch(
    batch: PreparedBatch, outcome: ModelOutcome, worker_name: str, version: str | None
) -> list[Any]:
    everything, live, wait_ms, infer_ms = batch.everything, batch.live, outcome.wait_ms, outcome.infer_ms
    replies: list[bytes | None] = [None] * len(everything)
    for i, why in batch.bad.items():  # a malformed tensor: answered here, never given to the model
        replies[i] = protocol.error_reply(
            protocol.answer_id(everything[i]), ErrorCode.BAD_REQUEST, why, _streamed(everything[i])
        )
    if outcome.error is not None:
        exc = outcome.error
        message = f"{type(exc).__name__}: {exc}"
        log.warning("model raised on a batch of %d: %s", len(live), message, extra=_log_ids(batch))
        log.debug("batch %d: the model's traceback", batch.batch_id, exc_info=exc)
        for i in live:
            replies[i] = protocol.error_reply(
                protocol.answer_id(everything[i]), ErrorCode.MODEL_ERROR, message, _streamed(everything[i])
            )
        errors = protocol.error_counts(len(live), len(batch.bad))
        return protocol.reply_frames(batch.batch_id, infer_ms, _all(replies), errors, wait_ms)
    n = len(live)
    refused, model_errors = len(batch.bad), 0
    encoder = None  # the batch's shared parts, for outputs that are bytes or arrays (as the first is)
    first = outcome.outputs[0] if n else None
    if type(first) is bytes or tensor.is_array(first):
        encoder = fastpath.ReplyEncoder(n, worker_name, wait_ms, infer_ms, version)
        if not refused:  # the common batch, every reply in one pass (its bytes are the same)
            plain = encoder.encode_plain(everything, outcome.outputs, batch.queue_ms)
            if plain is not None:
                return protocol.reply_frames(batch.batch_id, infer_ms, plain, 0, wait_ms, outcome.padding)
    # The batch's metadata once; each reply's copy gets its own queue_ms (key order kept).
    template = fastpath.reply_meta(n, worker_name, None, wait_ms, infer_ms, version)
    for i, out in zip(live, outcome.outputs, strict=True):
        r = everything[i]
        req_id = protocol.answer_id(r)
        stream = _streamed(r)
        if isinstance(out, BaseException):  # one check on the common path for both cases
            if isinstance(out, tensor.TensorError):  # its input does not fit the model's batch
                refused += 1
                replies[i] = protocol.error_reply(req_id, ErrorCode.BAD_REQUEST, str(out), stream)
                continue
            # the model failed this input alone
            model_errors += 1
            message = f"{type(out).__name__}: {out}"
            trace = out if out.__traceback__ is not None else None
            ids = {**_log_ids(batch), "request_id": req_id}
            log.debug(
                "batch %d: the model failed item %d: %s",
                batch.batch_id,
                i,
                message,
                exc_info=trace,
                extra=ids,
            )
            replies[i] = protocol.error_reply(req_id, ErrorCode.MODEL_ERROR, message, stream)
            continue
        q = batch.queue_ms[i]
        if not isinstance(q, _NUMBER) or isinstance(q, bool):
            q = None  # forwarded to the client: only a number from the broker
        else:  # rounded here, not by the broker (docs/protocol.md, BATCH)
            q = fastpath.round_ms(q + (wait_ms or 0.0))
        # an array or bytes: the batch's encoding, byte for byte (a streamed request's says "more");
        # any other output (or any, when the first is neither): ok_reply, which gives the same bytes
        reply = None if stream or encoder is None else encoder.encode(req_id, out, q)
        if reply is not None:
            replies[i] = reply
            continue
        try:
            meta = template.copy()
            meta["queue_ms"] = q
            if stream:  # a request-level model's stream is one chunk: its last
                meta["more"] = False
            replies[i] = protocol.ok_reply(req_id, out, meta)
        except (TypeError, ValueError, OverflowError, BufferError, RecursionError) as exc:
            model_errors += 1
            replies[i] = protocol.error_reply(
                req_id, ErrorCode.MODEL_ERROR, f"output cannot be encoded: {exc}", stream
            )
    errors = protocol.error_counts(model_errors, refused)
    return protocol.reply_frames(batch.batch_id, infer_ms, _all(replies), errors, wait_ms, outcome.padding)


#: What a broker's queue_ms may be (a tuple: `int | float` would build a union each time).
_NUMBER = (int, float)
#: What a model may return its outputs as (a tuple, for the same reason).
_SEQUENCE = (list, tuple)


def run_batch(
    model: ModelFn,
    header_frame: bytes,
    body_frames: list[Any],
    worker_name: str,
    arrived_at: float | None = None,
    version: str | None = None,
) -> list[Any]:
    """Run one BATCH message through the model; returns the REPLY frames.

    Whatever the model does, every request of the batch gets a reply: its output, or
    `model_error` for all of them when the model raises or returns the wrong count,
    or for one alone when its output is an exception instance or cannot be encoded.
    `arrived_at` (time.monotonic()) is when the BATCH reached the worker: the wait from
    then until the model ran (behind other batches) is part of each request's queue
    time, so it is added to `queue_ms`, given as `worker_wait_ms` and sent to the broker
    as the REPLY header's 5th element. Raises MalformedBatch for a message that cannot
    be run (see `_run_safely`).
    """
    batch = prepare_batch(header_frame, body_frames, arrived_at)
    return finish_batch(batch, call_model(model, batch), worker_name, version)


def _prepare_tensors() -> None:
    """Import numpy (where it is installed) and run a tiny tensor request's decode and
    reply through the batch path, before READY: the first tensor request to a model
    without a signature (so without a warm-up) paid 40-170 ms for that otherwise. A
    worker without numpy takes no tensors and skips this."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return
    body = protocol.pack({"id": 0, "input": {"datatype": "FP32", "shape": [2], "data": bytes(8)}})
    frames = protocol.batch_frames(0, [0.0], [body])
    run_batch(list, frames[2], frames[3:], "warm")


def _streamed(request: dict[str, Any]) -> bool:
    """Whether a request asked for a stream: its reply is then the stream's last chunk."""
    return request.get("stream") is True


def _padding_of(model: ModelFn) -> tuple[int, int] | None:
    """(padded, real) elements of the batch the model just ran, when it says (a stacked
    model does: workers.stacking.Stacked.last_padding; any model may set it)."""
    padding = getattr(model, "last_padding", None)
    if isinstance(padding, tuple) and len(padding) == 2 and all(type(n) is int and n >= 0 for n in padding):
        return padding[0], padding[1]
    return None


def _all(replies: list[bytes | None]) -> list[bytes]:
    """Every reply of a batch, once each position has one."""
    assert None not in replies
    return replies  # type: ignore[return-value]  # no None left


def _run_safely(
    model: ModelFn,
    header_frame: bytes,
    body_frames: list[Any],
    name: str,
    arrived_at: float | None = None,
    version: str | None = None,
) -> list[Any] | None:
    """run_batch that never raises (see `_failed_batch`)."""
    try:
        return run_batch(model, header_frame, body_frames, name, arrived_at, version)
    except Exception as exc:
        return _failed_batch(exc, header_frame)


def _prepared_or_error(frames: list[Any], arrived_at: float) -> PreparedBatch | Exception:
    try:
        return prepare_batch(frames[2], frames[3:], arrived_at)
    except Exception as exc:  # MalformedBatch, or a bug of ours
        return exc


def _batch_id_of(header_frame: bytes) -> int | None:
    try:
        return _decode_header(header_frame)[0]
    except MalformedBatch as exc:
        return exc.batch_id


def _failed_batch(exc: Exception, header_frame: bytes) -> list[Any] | None:
    """The answer to a batch that could not be run: a batch whose body cannot be read gets
    an empty REPLY (the broker fails all its requests); one without a readable batch id
    is dropped (None: nothing to answer; its broker re-dispatches it when it loses this
    worker); any other exception is a bug of ours, logged, and the worker goes on."""
    if isinstance(exc, MalformedBatch):
        if exc.batch_id is None:
            log.warning("dropped a batch whose header cannot be read: %s", exc)
            return None
        log.warning("batch %d cannot be read (%s); failing its requests", exc.batch_id, exc)
        return protocol.reply_frames(exc.batch_id, 0.0, [])
    log.error("could not run a batch", exc_info=exc)
    try:
        return protocol.reply_frames(_decode_header(header_frame)[0], 0.0, [])
    except MalformedBatch:
        return None


class BatchRunner(BrokerConnection):
    """The worker's batch path over its connection: batches run in the main thread (or
    on a model thread, overlapped), steps of a step-level model, each answered on the
    connection it came on, the socket left to the heartbeat thread while the model runs."""

    model: ModelFn | None
    #: A multiplexed worker's models (workers/multiplexed.py); None for a worker of one model.
    shelf: Shelf | None = None
    #: The repository version this worker serves (its model key is `NAME/V`), named in
    #: its replies (docs/protocol.md 4.3); None for a model outside a repository.
    reply_version: str | None = None

    def _busy(self) -> bool:
        return bool(self._pending) or (self._model_thread is not None and self._model_thread.in_flight > 0)

    def _overlap(self, runner: ModelThread[tuple[PreparedBatch, int], ModelOutcome]) -> None:
        """Answer the batches the model thread finished, and keep OVERLAP_BATCHES with it:
        the one it runs and the next, decoded meanwhile."""
        for job, outcome in runner.take():
            self._answer(job, outcome)
        while runner.in_flight < OVERLAP_BATCHES and (batch := self._prepare()) is not None:
            runner.put((batch, self.reconnects))

    def _finished(self, batch: PreparedBatch, outcome: ModelOutcome) -> list[Any]:
        try:
            return finish_batch(batch, outcome, self.name, self.reply_version)
        except Exception:  # a bug of ours; the worker goes on, and answers if it can
            log.exception("could not answer a batch")
            return protocol.reply_frames(batch.batch_id, 0.0, [])

    def _wait_for_model(
        self, runner: ModelThread[tuple[PreparedBatch, int], ModelOutcome]
    ) -> list[tuple[tuple[PreparedBatch, int], ModelOutcome]]:
        """Block until the model thread is done, the socket left to the heartbeat thread."""
        return self._unlocked(runner.wait)

    def _prepare(self) -> PreparedBatch | None:
        """The next pending batch decoded, the socket left to the heartbeat thread the
        while (a large batch may take longer than the broker's heartbeat expiry); one
        that cannot be run is answered (or dropped) at once, as `_run_safely` does."""
        while self._pending and self._sock is not None:
            arrived_at, frames = self._pending.popleft()
            prepared = self._unlocked(functools.partial(_prepared_or_error, frames, arrived_at))
            if isinstance(prepared, PreparedBatch):
                return prepared
            reply = _failed_batch(prepared, frames[2])
            if reply is not None:
                self._send(reply)
        return None

    def _answer(self, job: tuple[PreparedBatch, int], outcome: ModelOutcome) -> None:
        """Send the replies of a batch the model thread ran, on the connection it came on
        (a broker that lost us re-dispatched it: any other gets nothing)."""
        batch, connection = job
        reply = self._unlocked(functools.partial(self._finished, batch, outcome))  # heartbeats go on
        if connection != self.reconnects:
            return
        self._send_reply(reply)

    def _send_reply(self, reply: list[Any]) -> None:
        """Send a batch's REPLY, counted; one that cannot leave is said (its broker
        re-dispatches that batch when it finds us gone)."""
        self.batches += 1
        if not self._send(reply):
            log.warning(
                "worker %s: the reply to a batch could not be sent (no connection to the broker, "
                "which re-dispatches that batch)",
                self.name,
            )

    def _run_pending(self) -> None:
        """Run the batches received so far, in order, answering each on its connection;
        a stop lets the batch at hand finish and leaves the rest to the broker. The first
        batch asks only what the loop's poll just told (`_stop_known`): reading serve's
        empty pipe again raised BlockingIOError between a lone request's BATCH and its
        model (20-25 us of a cold CPU); each later one reads it, as a model may run long."""
        assert self.model is not None or self.shelf is not None
        stopped = self._stop_known
        while self._pending and self._sock is not None and not stopped():
            stopped = self.stop_requested
            arrived_at, frames = self._pending.popleft()
            self._in_model = True
            self._socket_lock.release()  # the heartbeat thread may use the socket meanwhile
            try:
                if self.shelf is not None:
                    reply = self._run_multiplexed(self.shelf, frames, arrived_at)
                else:
                    assert self.model is not None
                    version = self.reply_version
                    reply = _run_safely(self.model, frames[2], frames[3:], self.name, arrived_at, version)
            finally:
                self._socket_lock.acquire()
                self._in_model = False
            if reply is not None:
                self._send_reply(reply)

    def _run_multiplexed(self, shelf: Shelf, frames: list[Any], arrived_at: float) -> list[Any] | None:
        """A multiplexed worker's batch: run by the model its header names, loaded first
        when not held (the REPLY then says what that took: docs/protocol.md 6.4)."""
        key = batch_model(frames[2])
        if key is None or not shelf.resident.serves(key):
            why = not_served(key)
            return _failed_batch(MalformedBatch(why, _batch_id_of(frames[2])), frames[2])
        model, load = shelf.model_for(key)
        reply = _run_safely(model, frames[2], frames[3:], self.name, arrived_at, version_of(key))
        if reply is None or load is None:
            return reply
        return protocol.with_load(reply, *load)

    def _run_steps(self, steps: StepRunner) -> None:
        """Read the START and CANCEL messages that came, then run one step, the socket left
        to the heartbeat thread meanwhile in both (a model's start, stop and step may each
        be slow), sending the chunks as one CHUNK after each. No step runs while a CHUNK
        waits for the socket to take it: a chunk is never dropped, and a slow broker slows
        the model down instead."""
        if not self._flush_outbox():
            return
        if self._inbox:
            self._unlocked(lambda: self._read_inbox(steps))
            self._send_chunks(steps)
        if steps.busy() and self._flush_outbox():
            self._unlocked(lambda: steps.run_step(time.monotonic()))
            self._send_chunks(steps)

    def _unlocked(self, work: Callable[[], R]) -> R:
        """Run `work` (the model's, or decoding or encoding a batch) with the socket left
        to the heartbeat thread; its result."""
        self._in_model = True
        self._socket_lock.release()
        try:
            return work()
        finally:
            self._socket_lock.acquire()
            self._in_model = False

    def _read_inbox(self, steps: StepRunner) -> None:
        while True:
            try:
                arrived_at, frames = self._inbox.popleft()
            except IndexError:  # empty (the heartbeat thread may clear it on a DISCONNECT)
                return
            try:
                if frames[1] == protocol.CMD_START and len(frames) >= 3:
                    steps.receive_start(frames[2], frames[3:], arrived_at)
                else:
                    steps.receive_cancel(frames[2])
            except Exception as exc:  # msgpack raises several unrelated types
                log.warning(
                    "worker %s: ignored a malformed broker message: %s", self.name, protocol.describe(exc)
                )

    def _send_chunks(self, steps: StepRunner) -> None:
        frames = steps.take_entries(time.monotonic())
        if frames is not None:
            self._outbox.append(frames)
        self._flush_outbox()

    def _flush_outbox(self) -> bool:
        """Send the CHUNKs that wait, in order; True once none does. While the socket takes
        none (the broker reads slowly: its queue for us is full), wait at most OUTBOX_WAIT_MS
        for room, so the loop still beats and reads its pipe."""
        while self._outbox:
            if self._sock is None:
                self._outbox.clear()  # the connection is gone: the broker answers for those
                return True
            if not self._send(self._outbox[0]):
                self._sock.poll(OUTBOX_WAIT_MS, zmq.POLLOUT)
                return False
            self._outbox.popleft()
        return True
