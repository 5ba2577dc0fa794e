"""msgpack bodies with the protocol's settings (batcher/wire/codec.py): the reply bodies a
broker or worker sends, as a client decodes them (docs/protocol.md, 4.6 and 5)."""

from __future__ import annotations

import numpy as np
import pytest

from batcher.wire import aligned, codec, tensor


def test_an_error_reply_that_ends_a_stream_says_more_false() -> None:
    # docs/protocol.md 4.6: a stream's last reply, an error included, says "more": false.
    body = codec.error_reply(7, "cancelled", "the client cancelled it", stream=True)
    assert codec.unpack(body) == {
        "id": 7,
        "ok": False,
        "error": {"code": "cancelled", "message": "the client cancelled it"},
        "more": False,
    }


def test_an_error_reply_outside_a_stream_has_no_more_key() -> None:
    body = codec.error_reply("a", "overloaded", "full")
    assert codec.unpack(body) == {"id": "a", "ok": False, "error": {"code": "overloaded", "message": "full"}}


def test_an_ok_reply_carries_its_output_and_metadata() -> None:
    body = codec.ok_reply(3, {"y": b"\x00\x01"}, {"batch_size": 2})
    assert codec.unpack(body) == {"id": 3, "ok": True, "output": {"y": b"\x00\x01"}, "batch_size": 2}


def test_a_reply_whose_other_field_holds_the_fast_paths_marker_is_still_written_whole() -> None:
    # The fast path (aligned.pack_plain) marks each array's place with bytes it then looks
    # for; a field that holds those bytes too makes it give up, and the general path
    # writes the body: the reply is still the map it was, with its array aligned.
    output = np.arange(6, dtype=np.int32)
    body = codec.ok_reply(1, output, {"note": aligned._MARK + b"\x00"})
    reply = tensor.unpack_arrays(body)
    assert reply["note"] == aligned._MARK + b"\x00"
    assert reply["output"].tolist() == [0, 1, 2, 3, 4, 5]
    assert reply["id"] == 1 and reply["ok"] is True


@pytest.mark.parametrize(
    ("output", "has_array"),
    [
        (b"\x07" * 4096, False),
        ({"text": b"abc", "logits": b"\x00" * 64}, False),
        ([b"a", bytearray(b"bc")], False),
        (np.arange(6, dtype=np.float32), True),
        ({"y": np.arange(3, dtype=np.int64), "raw": b"ab"}, True),
        ([np.ones((2, 2), dtype=np.float64), b"x"], True),
    ],
    ids=["bytes", "map-of-bytes", "list-of-bytes", "array", "map-with-array", "list-with-array"],
)
def test_a_reply_of_bytes_or_arrays_is_written_in_one_pass_at_c_speed(
    monkeypatch: pytest.MonkeyPatch, output: object, has_array: bool
) -> None:
    """Nearly every model answers with bytes, an array, or a flat map or list of them: such
    a reply is written by msgspec in one pass (each array then put in place, aligned, by
    aligned.pack_plain), never by msgpack's Packer (which copies a payload twice) nor by
    the general writer (aligned.pack, Python-level). Those write the same bytes (checked
    here and in tests/unit/wire/test_aligned.py), so only this can tell a lost fast path."""
    meta = {"batch_size": 2, "worker": "h/0/1", "infer_ms": 0.5}
    expected = codec.ok_reply(3, output, meta)
    assert expected == aligned.pack({"id": 3, "ok": True, "output": output, **meta})

    def general_writer(*args: object) -> bytes:
        raise AssertionError("a plain reply went to a general writer")

    monkeypatch.setattr(codec, "_packer_pack", general_writer)
    monkeypatch.setattr(aligned, "pack", general_writer)
    if not has_array:  # nothing to align: not even the mark-and-replace pass
        monkeypatch.setattr(aligned, "pack_plain", general_writer)
    assert codec.ok_reply(3, output, meta) == expected
