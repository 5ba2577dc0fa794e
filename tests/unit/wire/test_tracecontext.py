"""Unit and property tests of batcher.wire.tracecontext (W3C trace context, pure) and of
the trace settings read from options and OTEL_* variables (batcher.observe.settings)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batcher.errors import SettingsError
from batcher.observe.settings import TraceSettings, trace_settings
from batcher.wire import protocol
from batcher.wire.tracecontext import (
    MAX_TRACEPARENT_CHARS,
    MAX_TRACESTATE_CHARS,
    MAX_TRACESTATE_MEMBERS,
    TraceParent,
    format_traceparent,
    parse_traceparent,
    parse_tracestate,
    should_sample,
)

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

hex32 = st.text("0123456789abcdef", min_size=32, max_size=32).filter(lambda t: t != "0" * 32)
hex16 = st.text("0123456789abcdef", min_size=16, max_size=16).filter(lambda t: t != "0" * 16)


def test_the_specifications_example_is_read() -> None:
    parent = parse_traceparent(GOOD)
    assert parent == TraceParent("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    assert parent.sampled and parent.header() == GOOD
    assert parse_traceparent(GOOD.encode()) == parent
    assert not parse_traceparent(GOOD[:-2] + "00").sampled  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        None,
        42,
        "",
        "garbage",
        GOOD.upper(),  # hex is lowercase only
        GOOD.replace("-", "_"),
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # all-zero span id
        "ff" + GOOD[2:],  # version ff is invalid
        GOOD + "-extra",  # version 00 has exactly four fields
        "01" + GOOD[2:] + "x",  # a later version's extra field must follow a dash
        GOOD[:-1],
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        b"\xff" * 55,
        "0" * 10_000,
    ],
)
def test_a_malformed_traceparent_reads_as_none(bad: object) -> None:
    assert parse_traceparent(bad) is None


def test_a_later_version_may_append_fields() -> None:
    assert parse_traceparent("01" + GOOD[2:] + "-whatever") == parse_traceparent(GOOD)


@given(hex32, hex16, st.integers(0, 255))
def test_format_and_parse_round_trip(trace_id: str, span_id: str, flags: int) -> None:
    text = format_traceparent(trace_id, span_id, flags)
    assert parse_traceparent(text) == TraceParent(trace_id, span_id, flags)
    assert format_traceparent(int(trace_id, 16), int(span_id, 16), flags) == text


@given(st.one_of(st.text(max_size=80), st.binary(max_size=80), st.integers(), st.none()))
def test_any_value_is_read_or_refused_never_raised(value: object) -> None:
    parent = parse_traceparent(value)
    assert parent is None or parse_traceparent(parent.header()) == parent


def test_tracestate_is_kept_when_well_formed_and_dropped_otherwise() -> None:
    assert (
        parse_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7")
        == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )
    assert parse_tracestate("vendor@tenant=x,,") == "vendor@tenant=x"
    assert parse_tracestate("a=1," * 33) is None  # more than 32 members
    assert parse_tracestate("a=" + "x" * MAX_TRACESTATE_CHARS) is None  # too long
    assert parse_tracestate("a=1,a=2") is None  # a key twice
    assert parse_tracestate("Upper=1") is None
    assert parse_tracestate("novalue") is None
    assert parse_tracestate(7) is None
    assert parse_tracestate("") is None


@given(st.text(max_size=700))
def test_a_kept_tracestate_is_short_and_keeps_itself(value: str) -> None:
    kept = parse_tracestate(value)
    assert kept is None or (len(kept) <= MAX_TRACESTATE_CHARS and parse_tracestate(kept) == kept)


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 255))
def test_sampling_follows_a_parent_and_else_the_ratio(ratio: float, draw: float, flags: int) -> None:
    parent = TraceParent("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", flags)
    assert should_sample(parent, ratio, draw) is bool(flags & 1)
    assert should_sample(None, ratio, draw) is (draw < ratio)
    assert should_sample(parent, ratio, draw, parent_based=False) is (draw < ratio)
    assert not should_sample(None, 0.0, draw)
    assert should_sample(None, 1.0, draw)


def test_the_request_header_carries_the_context_fields_unchecked() -> None:
    body = protocol.pack({"id": 1, "input": [1], "traceparent": GOOD, "tracestate": {"not": "a str"}})
    header = protocol.read_header(body)
    assert header.traceparent == GOOD and header.tracestate == {"not": "a str"}
    assert protocol.read_header(protocol.pack({"id": 1, "input": 1})).traceparent is None
    # the slow path (a body the fast reader hands over) reads them too
    slow = protocol.parse_request(body)[0]
    assert slow.traceparent == GOOD


def test_the_batch_header_carries_the_batch_spans_traceparent_only_when_traced() -> None:
    plain = protocol.batch_frames(7, [0.5], [b"\x80"])
    traced = protocol.batch_frames(7, [0.5], [b"\x80"], GOOD)
    assert protocol.unpack(plain[2]) == [7, [0.5], [1]]
    assert protocol.unpack(traced[2]) == [7, [0.5], [1], GOOD]


def test_settings_read_the_options_over_the_otel_variables() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": "mine",
    }
    s = trace_settings(None, None, env)
    assert (s.endpoint, s.sample_ratio, s.parent_based, s.service_name) == (
        "http://collector:4318",
        0.25,
        True,
        "mine",
    )
    assert s.traces_url == "http://collector:4318/v1/traces"
    s = trace_settings("http://other:4318/custom", 0.5, env)
    assert (s.traces_url, s.sample_ratio) == ("http://other:4318/custom", 0.5)
    assert trace_settings(None, None, {}).enabled is False
    assert trace_settings(None, None, {**env, "OTEL_SDK_DISABLED": "true"}).enabled is False
    assert trace_settings(None, None, {**env, "OTEL_TRACES_EXPORTER": "none"}).enabled is False
    assert trace_settings(None, None, {**env, "OTEL_TRACES_SAMPLER": "always_off"}).sample_ratio == 0.0
    assert trace_settings(None, None, {**env, "OTEL_TRACES_SAMPLER": "traceidratio"}).parent_based is False


def test_bad_trace_settings_are_refused_with_a_precise_message() -> None:
    with pytest.raises(SettingsError, match=r"trace_sample_ratio must be in \[0, 1\], got 2"):
        TraceSettings("http://x:4318", sample_ratio=2)
    with pytest.raises(
        SettingsError, match="trace_endpoint must be an http:// or https:// URL, got 'x:4318'"
    ):
        TraceSettings("x:4318")
    with pytest.raises(SettingsError, match="OTEL_TRACES_SAMPLER must be one of"):
        trace_settings("http://x:4318", None, {"OTEL_TRACES_SAMPLER": "sometimes"})
    with pytest.raises(SettingsError, match="OTEL_TRACES_SAMPLER_ARG must be a number, got 'half'"):
        trace_settings(
            "http://x:4318", None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}
        )


def test_json_log_lines_carry_the_trace_and_request_ids() -> None:
    import json
    import logging

    from opentelemetry.sdk.trace import TracerProvider

    from batcher.logs import JsonFormatter

    formatter = JsonFormatter()

    def line(**extra: object) -> dict[str, object]:
        record = logging.LogRecord("batcher.worker", logging.WARNING, __file__, 1, "model raised", (), None)
        record.__dict__.update(extra)
        entry: dict[str, object] = json.loads(formatter.format(record))
        return entry

    given = line(
        trace_id="4bf92f3577b34da6a3ce929d0e0e4736", span_id="00f067aa0ba902b7", request_id=7, model="sim"
    )
    assert given["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and given["span_id"] == "00f067aa0ba902b7"
    assert (given["request_id"], given["model"], given["message"]) == (7, "sim", "model raised")
    assert "trace_id" not in line()  # no span, no ids
    with TracerProvider().get_tracer("t").start_as_current_span("s") as span:
        ctx = span.get_span_context()
        current = line()
    assert (current["trace_id"], current["span_id"]) == (f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}")


@pytest.mark.parametrize("dash", [2, 35, 52])
def test_each_dash_of_a_traceparent_is_checked(dash: int) -> None:
    assert parse_traceparent(GOOD[:dash] + "a" + GOOD[dash + 1 :]) is None


def test_a_later_version_is_read_up_to_the_longest_traceparent() -> None:
    longest = "01" + GOOD[2:] + "-" + "x" * (MAX_TRACEPARENT_CHARS - len(GOOD) - 1)
    assert len(longest) == MAX_TRACEPARENT_CHARS
    assert parse_traceparent(longest) == parse_traceparent(GOOD)
    assert parse_traceparent(longest + "x") is None


def test_tracestate_at_its_limits_is_kept() -> None:
    most = ",".join(f"k{i}=v" for i in range(MAX_TRACESTATE_MEMBERS))
    assert parse_tracestate(most) == most
    longest = "a=" + "x" * 254 + ",b=" + "y" * (MAX_TRACESTATE_CHARS - 259)  # a value is <= 256
    assert len(longest) == MAX_TRACESTATE_CHARS and parse_tracestate(longest) == longest


def test_tracestate_members_are_trimmed_of_spaces_and_tabs_only() -> None:
    assert parse_tracestate(" a=X\t, b=Y ") == "a=X,b=Y"
    assert parse_tracestate("a=1\n") is None  # a newline is no optional white space
