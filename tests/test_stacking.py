"""Batched arrays for models (workers/stacking.py): stacking, padding and unpadding agree
with numpy, inputs that do not fit are answered alone, and a stacked model is served
end to end."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from batcher import protocol, tensor
from tests.helpers import recv_replies
from tests.test_tensor import batch, replies_of
from workers.stacking import BadInput, Stack, pad, stacking_of, unpad, wrap
from workers.worker import run_batch

# --- pad and unpad ----------------------------------------------------------------------------------

shapes = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=6)


@given(shapes, st.integers(-3, 3))
def test_pad_then_unpad_gives_back_every_array(sizes: list[tuple[int, int]], value: int) -> None:
    """Arrays (length, 3, width) padded along axes 0 and 2 to the longest, then cut back."""
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.integers(-9, 9, (n, 3, w)) for n, w in sizes]
    batched, lengths = pad(arrays, (0, 2), value)
    longest = (max(n for n, _ in sizes), 3, max(w for _, w in sizes))
    assert batched.shape == (len(arrays), *longest) and batched.dtype == arrays[0].dtype
    assert lengths.tolist() == [[n, w] for n, w in sizes]
    for row, a in zip(batched, arrays, strict=True):
        assert np.array_equal(
            row,
            np.pad(
                a, [(0, longest[0] - a.shape[0]), (0, 0), (0, longest[2] - a.shape[2])], constant_values=value
            ),
        )
    back = unpad(batched, lengths, (0, 2))
    assert all(np.array_equal(b, a) for b, a in zip(back, arrays, strict=True))


def test_stacking_without_padding_is_np_stack() -> None:
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(4)]
    batched, lengths = pad(arrays, (), 0)
    assert np.array_equal(batched, np.stack(arrays)) and lengths.shape == (4, 0)


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        (dict(pad_axes=(-1,)), "pad_axes must be axes >= 0, got (-1,)"),
        (dict(pad_axes=(0, 0)), "pad_axes must not repeat an axis, got (0, 0)"),
        (dict(pad_axes=(0,), unpad_axes=(0, 1)), "unpad_axes must match pad_axes one for one"),
    ],
)
def test_a_bad_declaration_is_refused_saying_why(stack: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Stack(**stack)


def test_what_a_model_declares() -> None:
    class Plain:
        pass

    class Yes:
        stack = True

    class Padded:
        stack = Stack(pad_axes=(0,))

    class Wrong:
        stack = "yes"

    assert stacking_of(Plain()) is None and stacking_of(Yes()) == Stack()
    assert stacking_of(Padded()) == Stack(pad_axes=(0,))
    with pytest.raises(TypeError, match="a model's `stack` must be True or a Stack"):
        stacking_of(Wrong())


# --- the worker: batched arrays in, one reply per request out ---------------------------------------


def test_the_model_sees_one_padded_array_and_each_request_gets_its_own_rows_back() -> None:
    seen: list[Any] = []

    def double(tokens: Any, lengths: Any) -> Any:
        seen.append((tokens.copy(), lengths.copy()))
        return tokens * 2

    model = wrap(double, Stack(pad_axes=(0,), pad_value=-1, unpad_axes=(0,)))
    inputs = [np.array([1, 2, 3], np.int32), np.array([4], np.int32), np.array([], np.int32)]
    out = replies_of(run_batch(model, *batch(*map(tensor.from_array, inputs)), "w"))
    ((tokens, lengths),) = seen
    assert tokens.tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]] and lengths.tolist() == [[3], [1], [0]]
    assert [r["output"].tolist() for r in out] == [[2, 4, 6], [8], []]
    assert all(r["batch_size"] == 3 for r in out)


def test_named_tensors_are_stacked_by_name_and_outputs_split_by_name() -> None:
    def model(batch: dict[str, Any]) -> dict[str, Any]:
        return {"sum": batch["a"] + batch["b"], "first": batch["a"][:, 0]}

    wrapped = wrap(model, Stack())
    inputs = [{"a": np.full(2, i, np.float64), "b": np.ones(2)} for i in range(3)]
    out = wrapped(inputs)
    assert [o["sum"].tolist() for o in out] == [[1, 1], [2, 2], [3, 3]]
    assert [float(o["first"]) for o in out] == [0, 1, 2]


def test_inputs_that_do_not_fit_the_batch_are_answered_alone_and_the_rest_served() -> None:
    def model(batch: Any) -> Any:
        return batch + 1

    frames = run_batch(
        wrap(model, Stack()),
        *batch(
            "text",  # not a tensor
            tensor.from_array(np.zeros((2, 2), np.float32)),  # the batch's form
            tensor.from_array(np.zeros((2, 3), np.float32)),  # another shape
            tensor.from_array(np.zeros((2, 2), np.float64)),  # another dtype
            tensor.from_array(np.ones((2, 2), np.float32)),
        ),
        "w",
    )
    out = replies_of(frames)
    assert [r["ok"] for r in out] == [False, True, False, False, True]
    assert out[0]["error"] == {
        "code": "bad_request",
        "message": "input must be a tensor or a map of tensors, got str",
    }
    assert out[2]["error"]["message"] == "shape [2, 3] differs from the batch's [2, 2]"
    assert out[3]["error"]["message"] == "float64 of rank 2, the batch is float32 of rank 2"
    assert out[4]["output"].tolist() == [[2, 2], [2, 2]]
    assert out[1]["batch_size"] == 5  # the batch the broker sent; the model ran on the 2 that fit


def test_a_model_returning_the_wrong_batch_fails_the_batch_as_a_model_error() -> None:
    out = replies_of(
        run_batch(wrap(lambda b: b[:1], Stack()), *batch(*[tensor.from_array(np.zeros(2))] * 3), "w")
    )
    assert {r["error"]["code"] for r in out} == {"model_error"}
    assert (
        "a stacked model must return a batch of 3 along axis 0, got shape [1, 2]"
        in out[0]["error"]["message"]
    )


def test_bad_input_is_a_tensor_error_so_the_worker_answers_bad_request() -> None:
    assert issubclass(BadInput, tensor.TensorError)


# --- end to end, with the example models ---------------------------------------------------------------


@pytest.mark.integration
def test_example_mean_pool_and_token_doubler_through_serve(serve, connect):
    s = serve(
        "--model", "pool=examples.python.mymodels:MeanPool",
        "--model", "tokens=examples.python.mymodels:TokenDoubler",
        "--workers", "1", "--max-batch-size", "8", "--max-wait-ms", "100", "--policy", "window",
        workers=2,
    )  # fmt: skip
    sock = connect(zmq.DEALER, s.frontend)
    rows = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) for n in (1, 3, 2)]
    for i, r in enumerate(rows):
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "pool", "input": r})])
    got = {r["id"]: r for r in recv_replies(sock, 3)}
    for i, r in enumerate(rows):
        assert got[i]["ok"], got[i]
        assert np.allclose(tensor.to_array(got[i]["output"]), r.mean(axis=0))
    assert {got[i]["batch_size"] for i in got} == {3}
    ids = [np.array([5, 6, 7], np.int64), np.array([1], np.int64)]
    for i, t in enumerate(ids):
        sock.send_multipart([b"", protocol.pack({"id": i, "model": "tokens", "input": t})])
    got = {r["id"]: r for r in recv_replies(sock, 2)}
    assert [tensor.to_array(got[i]["output"]).tolist() for i in range(2)] == [[10, 12, 14], [2]]


def test_an_odd_input_first_in_the_batch_is_the_one_refused() -> None:
    out = wrap(lambda b: b + 1, Stack())(
        [np.zeros(2, np.float64), np.zeros(2, np.float32), np.ones(2, np.float32)]
    )
    assert isinstance(out[0], BadInput) and str(out[0]) == "float64 of rank 1, the batch is float32 of rank 1"
    assert [o.tolist() for o in out[1:]] == [[1, 1], [2, 2]]


def test_a_model_returning_a_tuple_fails_rather_than_mixing_requests() -> None:
    two = [tensor.from_array(np.zeros(2)), tensor.from_array(np.ones(2))]
    out = replies_of(run_batch(wrap(lambda b: (b, b), Stack()), *batch(*two), "w"))
    assert {r["error"]["code"] for r in out} == {"model_error"}
    assert "a stacked model must return an array or a dict of arrays, got tuple" in out[0]["error"]["message"]


@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 3))
def test_a_padded_batch_reports_its_padded_and_real_elements(lengths: list[int], width: int) -> None:
    arrays = [np.ones((n, width), np.float32) for n in lengths]
    model = wrap(lambda b, lengths: b.sum(axis=1), Stack(pad_axes=(0,)))
    frames = run_batch(model, *batch(*map(tensor.from_array, arrays)), "w")
    real = sum(lengths) * width
    padded = len(lengths) * max(lengths) * width - real
    assert model.last_padding == (padded, real)
    assert protocol.parse_reply_header(frames[2]).padding == (padded, real)


def test_a_model_that_does_not_stack_reports_no_padding() -> None:
    frames = run_batch(lambda xs: xs, *batch(1, 2), "w")
    assert protocol.parse_reply_header(frames[2]).padding is None


def test_padding_a_model_reported_once_is_not_reported_again_for_later_batches() -> None:
    class Once:
        last_padding: tuple[int, int] | None = None
        calls = 0

        def __call__(self, inputs: list[Any]) -> list[Any]:
            self.calls += 1
            if self.calls == 1:
                self.last_padding = (4, 6)
            return inputs

    model = Once()
    first = run_batch(model, *batch(1, 2), "w")
    second = run_batch(model, *batch(1, 2), "w")
    assert protocol.parse_reply_header(first[2]).padding == (4, 6)
    assert protocol.parse_reply_header(second[2]).padding is None
