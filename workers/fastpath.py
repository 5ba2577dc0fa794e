"""The worker's batch path for the common tensor batch, done once per batch instead of
once per request.

A batch of a real model is most often n small requests, each one tensor of the same
datatype and shape, and nothing else to decode. Decoding each with msgpack and turning
each tensor into its own array, then stacking them, cost the worker more than a tenth
of its time on the ONNX benchmark (docs/benchmarks-history.md, "Real models"). Here such a batch
is read with one typed msgspec decoder per body (C speed, the tensor's bytes a view of
the body), and the tensors' bytes are joined into one stacked array with one copy; the
model gets the usual list of per-request arrays, each a row of that array, and a model
that knows (workers/onnx_model.py) runs the stacked array itself instead of stacking again.

Anything else takes the general path (workers/worker.py, `_decode_requests`) for the
whole batch: a body this decoder refuses (a key it does not know, a value of another
type, a map key that is not a str, invalid msgpack or UTF-8), a malformed tensor, two
requests whose tensors differ in datatype or shape, a large body (64 KiB or more, which
the general path reads in place without a copy), or a worker without numpy. So every
request decoded here is one the general path would have decoded to the same input.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import msgpack
import msgspec

from batcher.wire import aligned, tensor
from batcher.wire.protocol import ZERO_COPY_BYTES


def _numpy() -> Any:
    """numpy, or None where it is not installed (a worker of non-tensor models needs none).
    Imported on first use: the broker and the CLI import the worker, and never numpy."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class Rows(list[Any]):
    """The inputs of a batch as the model gets them (a plain list to any model), every one
    a row of `stacked`, in order: a model that runs stacked arrays may use it as it is.
    Any change to the list (a row replaced, the order changed) drops `stacked`, so a
    model that preprocesses its inputs in place is run on what it made of them."""

    def __init__(self, stacked: Any) -> None:
        # stacked[i, ...] is a view of row i, a 0-d array for 0-d tensors (iterating the
        # array would give numpy scalars, which go back as plain numbers, not tensors)
        super().__init__(stacked[i, ...] for i in range(len(stacked)))
        self.stacked = stacked


def _dropping_stacked(name: str) -> Any:
    method = getattr(list, name)

    def changed(self: Rows, *args: Any, **kwargs: Any) -> Any:
        self.stacked = None
        return method(self, *args, **kwargs)

    changed.__name__ = name
    return changed


for _name in (
    "__setitem__", "__delitem__", "__iadd__", "__imul__",
    "append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
):  # fmt: skip
    setattr(Rows, _name, _dropping_stacked(_name))


class _Tensor(msgspec.Struct, forbid_unknown_fields=True):
    """A tensor map; `data` a view of the body, not a copy."""

    datatype: str
    shape: list[int]
    data: memoryview


class _Request(msgspec.Struct, forbid_unknown_fields=True):
    """A request body of exactly the fields a client and the broker use (4.2), its input
    one tensor; int | float for the numbers, as msgpack gives either."""

    input: _Tensor
    id: int | str | None = None
    model: str | None = None
    op: str = "infer"
    timeout_ms: int | float | None = None
    priority: int | float = 0
    cost: int | float = 1.0


_read_request = msgspec.msgpack.Decoder(_Request).decode


def decode_uniform(bodies: list[Any]) -> tuple[list[dict[str, Any]], Rows] | None:
    """(the requests, each as {"id": ..., "input": its row}, and the inputs as Rows) when
    every body is a small request whose input is one valid tensor, all of one datatype
    and shape; None otherwise: then the general path decodes the batch."""
    if not bodies:
        return None
    first = bodies[0]
    if type(first) is bytes and b"datatype" not in first:  # no tensor: spares a failed decode
        return None
    ids: list[Any] = []
    datas: list[memoryview] = []
    datatype: str | None = None
    shape: list[int] | None = None
    try:
        for body in bodies:
            if len(body) >= ZERO_COPY_BYTES:
                return None
            request = _read_request(body)
            t = request.input
            if datatype is None:
                datatype, shape = t.datatype, t.shape
            elif t.datatype != datatype or t.shape != shape:
                return None
            ids.append(request.id)
            datas.append(t.data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    assert datatype is not None and shape is not None
    np = _numpy()  # only now: a batch without tensors never imports it (it takes 0.1 s and more)
    if np is None:
        return None
    try:
        tensor.check_header(datatype, shape)
    except tensor.TensorError:
        return None
    itemsize = tensor.ITEM_BYTES[datatype]
    expected = math.prod(shape) * itemsize
    if any(len(d) != expected for d in datas):
        return None
    joined = b"".join(datas)  # the one copy: as msgpack's decode would copy each body's bin
    if datatype == "BOOL" and joined and np.frombuffer(joined, dtype=np.uint8).max() > 1:
        return None  # a byte that is no BOOL: the general path refuses its request alone
    try:
        stacked = np.frombuffer(joined, dtype=tensor.DATATYPES[datatype]).reshape(len(datas), *shape)
    except ValueError:  # numpy refused the shape
        return None
    rows = Rows(stacked)
    return [{"id": i, "input": row} for i, row in zip(ids, rows, strict=True)], rows


def stacked_of(inputs: list[Any]) -> Any:
    """The stacked array whose rows `inputs` are (decode_uniform's), or None."""
    stacked = getattr(inputs, "stacked", None)
    if isinstance(inputs, Rows) and stacked is not None and len(stacked) == len(inputs):
        return stacked
    return None


def decode_plain(lengths: list[int], frames: list[Any]) -> list[dict[str, Any]] | None:
    """The requests of a batch of small bodies without tensors, joined in one frame as the
    broker sends them, decoded in one call (0.53 against 1.7 us a body: one copy of the
    frame, not one per body, and no Python call per body); each must end exactly where
    its length says and be a map, as `_decode_request` decodes it. None for anything else:
    then the general path decodes the batch, and says what is wrong with which body. A
    batch of one is decoded here too: a lone request's worker pays each Python call of
    the general path on a cold CPU."""
    if len(frames) != 1 or not lengths:
        return None
    blob = frames[0]
    if type(blob) is not bytes or b"datatype" in blob or sum(lengths) != len(blob):
        return None
    if len(lengths) == 1:  # a lone request: its body is the frame (no array to make of it)
        try:
            request = msgpack.unpackb(blob, raw=False, strict_map_key=False)
        except Exception:  # msgpack's several unrelated types (trailing bytes: ExtraData)
            return None
        return [request] if type(request) is dict else None
    # The bodies one after another are the elements of an array: one header before them
    # makes them one msgpack value. msgspec reads each element's extent (skipped, never
    # decoded: 0.1 us a body), which must be its length; msgpack then decodes the array in
    # one call, as `protocol.unpack` decodes each body alone (a msgpack value's extent is
    # fixed by its bytes, so the same body decodes the same wherever it starts).
    whole = b"\xdd" + len(lengths).to_bytes(4, "big") + blob
    try:
        if list(map(len, _extents(whole))) != lengths:
            return None
        requests = msgpack.unpackb(whole, raw=False, strict_map_key=False)
    except Exception:  # msgspec's and msgpack's several unrelated types
        return None
    if set(map(type, requests)) != {dict}:
        return None
    return requests  # type: ignore[no-any-return]


#: Each element of a msgpack array as its raw bytes (to check where each body ends).
_extents = msgspec.msgpack.Decoder(list[msgspec.Raw]).decode


_encode = msgspec.msgpack.Encoder().encode


@functools.lru_cache(maxsize=256)
def _fixed_parts(n: int, worker: str, waited: bool, version: str | None) -> tuple[bytes, bytes, bytes, bytes]:
    """The parts of a batch's replies that change only with its size, this worker and
    whether it waited (ReplyEncoder._batch_parts): the same from batch to batch, so
    encoded once (1.6 of the 2.2 us they cost a batch)."""
    keys = 3 + len(reply_meta(n, worker, None, 0.0 if waited else None, 0.0, version))
    head = bytes([0x80 | keys]) + _encode("id")  # a fixmap: at most 15 keys
    after_id = _encode("ok") + _encode(True) + _encode("output")
    before_queue = _encode("batch_size") + _encode(n) + _encode("worker") + _encode(worker)
    before_queue += _encode("queue_ms")
    version_part = b"" if version is None else _encode("version") + _encode(version)
    return head, after_id, before_queue, version_part


_WAIT_KEY = _encode("worker_wait_ms")
_INFER_KEY = _encode("infer_ms")


class ReplyEncoder:
    """The success replies of one batch whose outputs are arrays or bytes, each written as
    the bytes `protocol.ok_reply(req_id, output, meta)` gives, meta being `reply_meta`'s:
    every part that is the same for the whole batch (the keys, the batch's metadata, an
    output tensor's header per datatype and shape) is encoded once, and a reply is those
    parts joined around its id, its output's bytes and its queue_ms, the tensor's data
    aligned as batcher.wire.aligned aligns it. docs/protocol.md 4.3 has the reply's form.

    A bytes output is msgpack's bin, as `protocol.pack_carrying` writes it (msgspec, the
    map's parts one after another): 0.4 against 1.9 us a reply through `ok_reply` (the
    echo model's small replies, 27 to a batch: a reply map built and copied, the payload
    checked twice), so a batch of small binary replies costs the worker about what it
    did in v1."""

    def __init__(
        self, n: int, worker: str, wait_ms: float | None, infer_ms: float, version: str | None = None
    ) -> None:
        self._batch = (n, worker, wait_ms, infer_ms, version)
        self._parts: tuple[bytes, bytes, bytes, bytes] | None = None  # made at the first array
        # per dtype and shape, and the tensor's offset modulo ALIGN_BYTES: its bytes up to its data
        self._tensor_heads: dict[tuple[tuple[str, tuple[int, ...]], int], bytes] = {}
        self._datatypes: dict[tuple[str, tuple[int, ...]], str] = {}

    def _batch_parts(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The parts shared by the batch's replies, encoded at its first array or bytes
        output only: a batch of other outputs (lists, str) never pays for them (1.6 us a
        batch)."""
        n, worker, wait_ms, infer_ms, version = self._batch
        head, after_id, before_queue, version_part = _fixed_parts(n, worker, wait_ms is not None, version)
        # the tail's keys in reply_meta's order: worker_wait_ms, infer_ms, version
        waited = b"" if wait_ms is None else _WAIT_KEY + _encode(wait_ms)
        self._parts = (head, after_id, before_queue, waited + _INFER_KEY + _encode(infer_ms) + version_part)
        return self._parts

    def encode_plain(
        self, requests: list[dict[str, Any]], outputs: list[Any], queue_ms: list[Any]
    ) -> list[bytes] | None:
        """Every reply of a batch whose requests all reached the model, in one pass, when
        each is the common case: a bytes output, a float queue_ms, no "stream" key, an id
        that is an int, a str or absent; None for any other batch (then each reply is
        encoded by `encode` or `protocol.ok_reply`). The bytes are `encode`'s: the id
        answered as `protocol.answer_id` answers it, queue_ms plus the batch's wait (0
        when unknown), rounded to 3 places, as the per-request path adds it."""
        head, after_id, before_queue, tail = self._parts or self._batch_parts()
        wait_ms = self._batch[2] or 0.0
        join = b"".join
        replies: list[bytes] = []
        append = replies.append
        try:
            for request, output, q in zip(requests, outputs, queue_ms, strict=True):
                req_id = request.get("id")
                if (
                    type(output) is not bytes
                    or type(q) is not float
                    or "stream" in request
                    or (type(req_id) is not int and type(req_id) is not str and req_id is not None)
                ):
                    return None
                # round_ms(q + wait_ms), inlined: the call was a third of it
                x = q + wait_ms
                m = x * 1000.0
                k = round(m) if 0.0 < x < 1e9 else 0
                q = k / 1000 if k and -0.499 < m - k < 0.499 else round(x, 3)
                parts = (head, _encode(req_id), after_id, _encode(output), before_queue, _encode(q), tail)
                append(join(parts))
        except (TypeError, ValueError, OverflowError):  # an id too large for msgpack
            return None
        return replies

    def encode(self, req_id: int | str | None, output: Any, queue_ms: float | None) -> bytes | None:
        """The reply's bytes, or None when `output` is neither bytes nor a C-ordered array
        of a protocol datatype (then `protocol.ok_reply` encodes it, or says why it cannot)."""
        if type(output) is bytes:
            try:
                id_bytes, queue_bytes = _encode(req_id), _encode(queue_ms)
            except (TypeError, ValueError, OverflowError):  # not the protocol's id or number
                return None
            first, after_id, before_queue, tail = self._parts or self._batch_parts()
            return b"".join((first, id_bytes, after_id, _encode(output), before_queue, queue_bytes, tail))
        if not tensor.is_array(output) or not output.flags.c_contiguous:  # (numpy imported then)
            return None
        key = (output.dtype.str, output.shape)
        datatype = self._datatypes.get(key)
        if datatype is None:
            datatype = tensor.DATATYPES_BY_DTYPE.get(key[0])
            if datatype is None:
                return None
            self._datatypes[key] = datatype
        try:
            id_bytes, queue_bytes = _encode(req_id), _encode(queue_ms)
        except (TypeError, ValueError, OverflowError):  # not the protocol's id or number
            return None
        first, after_id, before_queue, tail = self._parts or self._batch_parts()
        offset = len(first) + len(id_bytes) + len(after_id)
        head_key = (key, offset % tensor.ALIGN_BYTES)
        head = self._tensor_heads.get(head_key)
        if head is None:
            head = self._tensor_heads[head_key] = aligned.tensor_head(
                offset, datatype, output.shape, output.nbytes
            )
        return b"".join((first, id_bytes, after_id, head, output.data, before_queue, queue_bytes, tail))


def round_ms(x: float) -> float:
    """round(x, 3), the same float, at a third of its cost (round with ndigits goes through
    a decimal string: 0.28 us, the most costly step of a small reply). x * 1000 is rounded
    half to even to the integer k, and k / 1000 is the float nearest k/1000, which is what
    round(x, 3) gives for the same k. The product's rounding error is at most half an ulp
    (under 2**-13 below 1e9), so k is round's own unless x * 1000 lies within 0.001 of a
    half: then, and outside (0, 1e9) (a negative zero, whose sign round keeps; NaN,
    infinities), round itself answers."""
    m = x * 1000.0
    if 0.0 < x < 1e9:
        k = round(m)
        if -0.499 < m - k < 0.499:
            return k / 1000
    return round(x, 3)


def reply_meta(
    n: int,
    worker: str,
    queue_ms: float | None,
    wait_ms: float | None,
    infer_ms: float,
    version: str | None = None,
) -> dict[str, Any]:
    """The metadata keys of a success reply from the reference worker (docs/protocol.md
    4.3), in their order: ReplyEncoder writes the same. `version`: the repository version
    the worker serves (its model key `NAME/V`), so the reply says which one answered."""
    meta: dict[str, Any] = {"batch_size": n, "worker": worker, "queue_ms": queue_ms}
    if wait_ms is not None:
        meta["worker_wait_ms"] = wait_ms
    meta["infer_ms"] = infer_ms
    if version is not None:
        meta["version"] = version
    return meta
