"""`batcher send`: JSON inputs in, one strict-JSON line per reply out; and the JSON
reading and printing other commands share (`parse_input`, `strict_json`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterable
from typing import Any

import click

from batcher.cli.option_groups import ClientKeys, connect_option, curve_client_options
from batcher.cli.options import (
    MAX_TIMEOUT_MS,
    MAX_TIMEOUT_S,
    LogOptions,
    float_range,
    local_option,
    logging_options,
    option,
    setup,
)
from batcher.client.sync import TIMEOUT, UNREACHABLE
from batcher.wire import tensor


def _json_key(key: object) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        return key.hex()
    if key is None or isinstance(key, bool | int) or (isinstance(key, float) and math.isfinite(key)):
        return json.dumps(key)
    return repr(key)


def jsonable(value: Any) -> Any:
    """`value` (a decoded msgpack reply) made printable as strict JSON: NaN and infinities
    become null (JSON has neither), bytes hex, tensors their JSON form (docs/protocol.md),
    other keys and types strings."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, bytes):
        return value.hex()
    if tensor.is_array(value):
        return jsonable(tensor.to_json(value))
    if isinstance(value, dict):
        if tensor.is_tensor(value):
            with contextlib.suppress(tensor.TensorError):
                return jsonable(tensor.to_json(value))
        return {_json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return repr(value)


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON that any parser takes: no NaN or Infinity tokens, whatever `value` holds."""
    return json.dumps(jsonable(value), indent=indent, allow_nan=False)


class _NotStrictJSON(ValueError):
    """NaN, Infinity or a number too big for a float: accepted by Python's json, not JSON."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotStrictJSON(f"{text} is too large for a 64-bit float")
    return value


def _no_constant(name: str) -> Any:
    raise _NotStrictJSON(f"{name} is not JSON (JSON has no NaN or Infinity)")


def parse_input(text: str) -> Any:
    """One `batcher send` input: strict JSON (no NaN or Infinity, so what is sent is what
    any other JSON tool would read) that msgpack can encode, its JSON tensors sent as
    tensors; click.BadParameter if not."""
    import msgpack

    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _NotStrictJSON as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="INPUTS") from None
    except json.JSONDecodeError as exc:
        hint = ""
        if text.strip()[:1] not in ('"', "{", "["):
            hint = f"; to send it as a string, quote it: '{json.dumps(text)}'"
        raise click.BadParameter(f"not JSON: {text!r} ({exc.msg}){hint}", param_hint="INPUTS") from None
    try:
        value = tensor.json_tensors(value)
    except tensor.TensorError as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="INPUTS") from None
    try:
        msgpack.packb(value, use_bin_type=True)
    except OverflowError:
        raise click.BadParameter(
            f"{text!r}: an integer outside msgpack's range -2**63 .. 2**64-1", param_hint="INPUTS"
        ) from None
    except UnicodeEncodeError:
        raise click.BadParameter(
            f"{text!r}: a string that is not valid Unicode (a lone surrogate)", param_hint="INPUTS"
        ) from None
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(f"{text!r} cannot be sent as msgpack: {exc}", param_hint="INPUTS") from None
    return value


@click.command()
@connect_option
@option(
    "--model",
    envvar="BATCHER_REQUEST_MODEL",
    old_envvar="BATCHER_MODEL",
    default=None,
    help="Model to ask (the broker's default when absent).",
)
@option(
    "--timeout-ms",
    type=float_range(0, MAX_TIMEOUT_MS),
    default=None,
    help="Deadline per request, kept by the broker (answered deadline_exceeded past it).",
)
@option(
    "--timeout-s",
    envvar="BATCHER_SEND_TIMEOUT_S",
    type=float_range(0, MAX_TIMEOUT_S, min_open=True),
    default=30.0,
    help="How long to wait for each reply, here: a request unanswered by then is reported "
    "as a timeout (the broker may be down or unreachable).",
)
@local_option(
    "--stream",
    is_flag=True,
    default=False,
    help='Ask for streamed replies ("stream": true): each chunk prints as it comes, one JSON '
    "line each, every input's chunks together, in order.",
)
@curve_client_options
@logging_options
@click.argument("inputs", nargs=-1)
def send(
    connect: str,
    model: str | None,
    timeout_ms: float | None,
    timeout_s: float,
    stream: bool,
    curve: ClientKeys,
    logs: LogOptions,
    inputs: tuple[str, ...],
) -> None:
    """Send JSON INPUTS (or one JSON value per stdin line) and print each reply as JSON.

    All inputs are sent at once, so they can share a batch. A string is JSON in quotes:
    '"hello"'. NaN and Infinity are refused (they are not JSON); in a reply they print
    as null, so every line is strict JSON. Exits 1 if any reply is an error; a request
    with no reply within --timeout-s prints as a `timeout` error, its reason on stderr.
    """
    setup(logs)
    if inputs:
        texts = list(inputs)
    else:
        try:
            stdin = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(f"stdin is not UTF-8 text: {exc}", param_hint="INPUTS") from None
        texts = [line for line in stdin.splitlines() if line.strip()]
    values = [parse_input(t) for t in texts]
    failed = False
    timeouts: dict[str, None] = {}  # the client's messages, each said once, in order
    with curve.client(connect, timeout_s) as client:
        if stream:
            streams = [client.stream(v, model=model, timeout_ms=timeout_ms) for v in values]
            replies: Iterable[dict[str, Any]] = (r for st in streams for r in st.replies())
        else:
            pendings = [client.submit(v, model=model, timeout_ms=timeout_ms) for v in values]
            replies = (p.wait() for p in pendings)
        for reply in replies:
            failed |= not reply.get("ok")
            click.echo(strict_json(reply))
            error = reply.get("error")
            if isinstance(error, dict) and error.get("code") in (TIMEOUT, UNREACHABLE):
                timeouts[f"{error['code']}: {error.get('message', '')}"] = None
    for message in timeouts:
        click.echo(message, err=True)
    sys.exit(1 if failed else 0)
