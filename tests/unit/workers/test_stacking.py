"""Batched arrays for models (workers/stacking.py): stacking, padding and unpadding agree
with numpy, inputs that do not fit are answered alone, and a stacked model is served
end to end."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.wire import protocol, tensor
from tests.unit.wire.test_tensor import batch, replies_of
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


def test_inputs_of_other_forms_run_in_their_own_call_and_only_unstackable_ones_are_refused() -> None:
    calls: list[tuple[str, tuple[int, ...]]] = []

    def model(batch: Any) -> Any:
        calls.append((batch.dtype.str, batch.shape))
        return batch + 1

    frames = run_batch(
        wrap(model, Stack()),
        *batch(
            "text",  # not a tensor
            tensor.from_array(np.zeros((2, 2), np.float32)),
            tensor.from_array(np.zeros((2, 3), np.float32)),  # another shape
            tensor.from_array(np.zeros((2, 2), np.float64)),  # another dtype
            tensor.from_array(np.ones((2, 2), np.float32)),
        ),
        "w",
    )
    out = replies_of(frames)
    assert [r["ok"] for r in out] == [False, True, True, True, True]
    assert out[0]["error"] == {
        "code": "bad_request",
        "message": "input must be a tensor or a map of tensors, got str",
    }
    assert out[2]["output"].tolist() == [[1, 1, 1], [1, 1, 1]]
    assert out[3]["output"].dtype == np.float64 and out[3]["output"].tolist() == [[1, 1], [1, 1]]
    assert out[4]["output"].tolist() == [[2, 2], [2, 2]]
    assert sorted(calls) == [("<f4", (1, 2, 3)), ("<f4", (2, 2, 2)), ("<f8", (1, 2, 2))]
    assert out[1]["batch_size"] == 5  # the batch the broker sent; the model ran per form


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


def test_an_odd_input_first_in_the_batch_is_served_as_it_would_be_alone() -> None:
    out = wrap(lambda b: b + 1, Stack())(
        [np.zeros(2, np.float64), np.zeros(2, np.float32), np.ones(2, np.float32)]
    )
    assert out[0].dtype == np.float64 and out[0].tolist() == [1, 1]
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


# --- issue 28 items 9 and 10: forms never mix, padding is bounded ---------------------------------------

forms = st.lists(
    st.tuples(
        st.sampled_from(["<f4", "<f8", "<i8"]),  # dtype
        st.integers(0, 5),  # length along the padded axis
        st.integers(1, 3),  # width: another width is another form
        st.booleans(),  # a map of one named tensor rather than a tensor
    ),
    min_size=1,
    max_size=8,
)


def _input(dtype: str, length: int, width: int, named: bool, seed: int) -> Any:
    x = np.random.default_rng(seed).integers(-9, 9, (length, width)).astype(np.dtype(dtype))
    return {"x": x} if named else x


@given(forms)
def test_a_request_gets_the_answer_it_gets_alone_whatever_its_batch_mates(specs: list[Any]) -> None:
    """Item 10: a stacked batch of mixed dtypes, widths and map forms answers each request
    as a batch of that request alone does (the old batch took its majority's form and
    refused or failed the others)."""

    def model(batch: Any, lengths: Any) -> Any:
        if isinstance(batch, dict):
            return {"y": batch["x"] * 2 + lengths[:, :1, None]}
        return batch * 2 + lengths[:, :1, None]

    wrapped = wrap(model, Stack(pad_axes=(0,), pad_value=0, unpad_axes=(0,)))
    inputs = [_input(*spec, seed=i) for i, spec in enumerate(specs)]
    together = wrapped(inputs)
    for x, got in zip(inputs, together, strict=True):
        (alone,) = wrapped([x])
        if isinstance(alone, dict):
            assert got.keys() == alone.keys() and np.array_equal(got["y"], alone["y"])
            assert got["y"].dtype == alone["y"].dtype
        else:
            assert np.array_equal(got, alone) and got.dtype == alone.dtype


extents = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=12)


@given(extents, st.integers(1, 2000))
def test_planned_runs_stay_within_the_budget_and_hold_every_input_once(
    shapes2: list[tuple[int, int]], budget: int
) -> None:
    from workers.stacking import padded_size, plan_runs

    ext = [(s,) for s in shapes2]
    runs, alone_over = plan_runs(ext, budget)
    placed = sorted([i for run in runs for i in run] + alone_over)
    assert placed == list(range(len(ext)))
    assert all(padded_size([ext[i] for i in run]) <= budget for run in runs)
    assert alone_over == [i for i in range(len(ext)) if padded_size([ext[i]]) > budget]


def test_padded_size_is_n_times_the_longest_shape_summed_over_named_tensors() -> None:
    from workers.stacking import padded_size

    assert padded_size([((2, 3),), ((4, 1),)]) == 2 * 4 * 3
    assert padded_size([((2, 3), (5,)), ((4, 1), (1,))]) == 2 * 4 * 3 + 2 * 5
    assert padded_size([((2**40, 0),), ((0, 2**40),)]) == 2 * 2**80


def test_two_empty_tensors_padded_along_two_axes_no_longer_spoil_the_batch() -> None:
    """Item 9 (f_pad_two_axes_empty_spoils_batch.py): FP32 [2**40, 0] and [0, 2**40] once
    padded the batch to (n, 2**40, 2**40) and every request got model_error. Each now runs
    apart from the rest, and the well-formed requests share their own call."""
    calls: list[tuple[int, ...]] = []

    def total(batch: Any, lengths: Any) -> Any:
        calls.append(batch.shape)
        return batch.reshape(batch.shape[0], -1).sum(axis=1)

    wrapped = wrap(total, Stack(pad_axes=(0, 1)))
    good = [tensor.from_array(np.full((2, 3), i, np.float32)) for i in range(4)]
    empty = [tensor.from_array(np.zeros(s, np.float32)) for s in ((2**40, 0), (0, 2**40))]
    out = replies_of(run_batch(wrapped, *batch(good[0], empty[0], good[1], empty[1], good[2], good[3]), "w"))
    assert all(r["ok"] for r in out), out
    assert [float(out[i]["output"]) for i in (0, 2, 4, 5)] == [0.0, 6.0, 12.0, 18.0]
    assert sorted(calls) == [(1, 0, 2**40), (1, 2**40, 0), (4, 2, 3)]


def test_a_request_alone_over_the_budget_is_refused_and_its_batch_mates_served() -> None:
    wrapped = wrap(lambda b, lengths: b.sum(axis=1), Stack(pad_axes=(0,)), max_padded_elements=100)
    out = replies_of(
        run_batch(
            wrapped,
            *batch(*[tensor.from_array(np.ones(n, np.float32)) for n in (10, 101, 40, 60)]),
            "w",
        )
    )
    assert [r["ok"] for r in out] == [True, False, True, True]
    assert out[1]["error"] == {
        "code": "bad_request",
        "message": "its stacked array would hold 101 elements, more than the 100 a batch may "
        "(--max-padded-elements)",
    }
    # 10, 40 and 60 pad to 3 x 60 = 180 > 100: they ran as (10, 40) = 80 and (60) = 60
    assert [float(out[i]["output"]) for i in (0, 2, 3)] == [10.0, 40.0, 60.0]
    assert wrapped.last_padding == (2 * 40 - 50, 110)


def test_max_padded_elements_is_checked_where_it_is_set() -> None:
    from workers.models import check_max_padded_elements
    from workers.worker import WorkerSettings

    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_padded_elements must be an int >= 1, got"):
            check_max_padded_elements(bad)
    with pytest.raises(ValueError, match="max_padded_elements must be an int >= 1, got 0"):
        WorkerSettings(max_padded_elements=0)
