"""The commands that ask a running broker over its control operations: `stats` (the
table is `batcher.cli.stats_table`), `ready` and `reload`."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import click

from batcher.cli.option_groups import ClientKeys, connect_option, curve_client_options
from batcher.cli.options import (
    MAX_REFRESHES,
    MAX_STATS_S,
    READY_POLL_S,
    Decorator,
    LogOptions,
    float_range,
    int_range,
    local_option,
    logging_options,
    option,
    setup,
)
from batcher.cli.send_command import strict_json
from batcher.client.sync import BatcherError, ClientTimeout, Unreachable


@click.command()
@connect_option
@local_option("--watch", is_flag=True, help="Refresh in place until Ctrl-C, with rates per second.")
@local_option(
    "--interval-s",
    type=float_range(0.1, MAX_STATS_S),
    default=1.0,
    help="With --watch: seconds between refreshes.",
)
@local_option(
    "--count",
    type=int_range(1, MAX_REFRESHES),
    default=None,
    help="With --watch: stop after this many refreshes (default: until Ctrl-C).",
)
@local_option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@option(
    "--timeout-s",
    envvar="BATCHER_STATS_TIMEOUT_S",
    old_envvar="BATCHER_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=5.0,
    help="How long to wait for the broker.",
)
@curve_client_options
@logging_options
def stats(
    connect: str,
    watch: bool,
    interval_s: float,
    count: int | None,
    as_json: bool,
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Ask a running broker for its queues, workers, batches and recent latencies.

    --watch adds, per model, requests answered, ok and errors per second and batches per
    second, each over the last refresh interval (`-` until the second refresh)."""
    from batcher.cli.stats_table import compute_rates, format_stats

    setup(logs)
    if count is not None and not watch:
        raise click.UsageError("--count goes with --watch")
    previous: tuple[float, dict[str, Any]] | None = None
    shown = 0
    with curve.client(connect, timeout_s) as c:
        try:
            while True:
                try:
                    snapshot = c.control("stats")
                except BatcherError as exc:
                    raise click.ClickException(f"no stats from {connect}: {exc}") from None
                now = time.monotonic()
                if as_json:
                    text = strict_json(snapshot, indent=2)
                elif watch:
                    rates = compute_rates(previous[1], snapshot, now - previous[0]) if previous else {}
                    text = format_stats(snapshot, rates)
                else:
                    text = format_stats(snapshot)
                if not watch:
                    click.echo(text)
                    return
                click.clear()
                click.echo(f"{connect}  {time.strftime('%H:%M:%S')}\n{text}")
                shown += 1
                if count is not None and shown >= count:
                    return
                previous = (now, snapshot)
                time.sleep(interval_s)  # the refresh interval of --watch
        except KeyboardInterrupt:
            return


def readiness(snapshot: Mapping[str, Any], wanted: Iterable[str]) -> tuple[list[str], list[str]]:
    """What `batcher ready` says of a `stats` snapshot: (one line per ready model, one
    per problem). `wanted` empty means every model the broker was configured with."""
    models = snapshot.get("models")
    models = models if isinstance(models, dict) else {}
    names = list(wanted) or [
        name for name, m in models.items() if not isinstance(m, dict) or m.get("configured", True)
    ]
    if not names:
        return [], ["the broker serves no model"]
    ready_lines, problems = [], []
    for name in dict.fromkeys(names):
        m = models.get(name)
        if m is None:
            served = ", ".join(map(str, models)) or "none"
            problems.append(f"unknown model {name!r} (served: {served})")
            continue
        workers = m.get("workers") if isinstance(m, dict) else None
        n = workers if isinstance(workers, int) and not isinstance(workers, bool) else 0
        if n >= 1:
            ready_lines.append(f"ready: {name} ({n} worker{'' if n == 1 else 's'})")
        else:
            problems.append(f"{name} has no worker")
    return ready_lines, problems


@click.command()
@connect_option
@option(
    "--model",
    "models",
    envvar="BATCHER_READY_MODEL",
    multiple=True,
    help="A model that must have a worker (repeat for several). Default: every model the "
    "broker was configured with.",
)
@option(
    "--timeout-s",
    envvar="BATCHER_READY_TIMEOUT_S",
    type=float_range(0.1, MAX_STATS_S),
    default=5.0,
    help="How long to wait for every model to have a worker.",
)
@curve_client_options
@logging_options
def ready(
    connect: str,
    models: tuple[str, ...],
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Wait until the broker answers and each model has at least one worker: a readiness
    check for a supervisor, a container or a deployment script.

    Exits 0 printing `ready: MODEL (N workers)` per model; exits 1 after --timeout-s
    saying what is missing, or that no broker answered."""
    setup(logs)
    deadline = time.monotonic() + timeout_s
    problems: list[str] | None = None  # None: the broker has not answered yet
    unanswered = ""  # why no broker can be reached, when that is known
    with curve.client(connect, timeout_s) as client:
        while True:
            client.timeout_s = max(0.01, deadline - time.monotonic())
            try:
                ready_lines, problems = readiness(client.control("stats"), models)
            except ClientTimeout as exc:  # no broker answered: yet, or none can (Unreachable)
                unanswered = exc.message if isinstance(exc, Unreachable) else unanswered
            except BatcherError as exc:
                if problems is None:
                    problems = [f"the broker answered {exc}"]
            else:
                if not problems:
                    click.echo("\n".join(ready_lines))
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(READY_POLL_S, remaining))  # between asks: a worker takes time to join
    if problems is None:
        raise click.ClickException(
            f"no broker answered at {connect} within {timeout_s}s: "
            + (unanswered or "is it running, and are the CURVE keys right?")
        )
    raise click.ClickException(f"not ready after {timeout_s}s: {'; '.join(problems)}")


def _timeout_option(op: str, default_s: float, waited_for: str) -> Decorator:
    """`--timeout-s` of a control command (`BATCHER_<OP>_TIMEOUT_S`): how long it waits."""
    return option(
        "--timeout-s",
        envvar=f"BATCHER_{op.upper()}_TIMEOUT_S",
        type=float_range(0.1, MAX_STATS_S),
        default=default_s,
        help=f"How long to wait for {waited_for}.",
    )


@click.command("reload")
@click.argument("model")
@connect_option
@_timeout_option("reload", 120.0, "the reload: new workers loading the model, then the old draining")
@curve_client_options
@logging_options
def reload_model(
    model: str,
    connect: str,
    timeout_s: float,
    curve: ClientKeys,
    logs: LogOptions,
) -> None:
    """Reload MODEL with no request refused or lost: serve starts new workers of it,
    waits until they are ready, then drains and stops the old ones.

    Prints the broker's answer as JSON; exits 1 with its error code and message if the
    reload failed or no answer came within --timeout-s."""
    setup(logs)
    _ask("reload", model, connect, timeout_s, curve)


def _ask(op: str, model: str, connect: str, timeout_s: float, curve: ClientKeys, **fields: Any) -> None:
    """Send the control request `op` for `model`, print its answer as JSON; exit 1 with the
    error code and message if it failed or no answer came within `timeout_s`."""
    with curve.client(connect, timeout_s) as client:
        try:
            output = client.control(op, model=model, **fields)
        except BatcherError as exc:
            raise click.ClickException(f"{op} of {model!r} failed: {exc.code}: {exc.message}") from None
    click.echo(strict_json(output, indent=2))


def parse_split(weights: Iterable[str]) -> dict[str, int] | None:
    """`2=90 3=10` as the `split` op's traffic map; none given: None (all to the newest)."""
    out: dict[str, int] = {}
    for text in weights:
        version, sep, weight = text.partition("=")
        if not sep or not version.strip().isdigit() or not weight.strip().isdigit():
            raise click.BadParameter(
                f"a weight is VERSION=WEIGHT, like 2=90, got {text!r}", param_hint="WEIGHTS"
            )
        out[version.strip()] = int(weight)
    return out or None


@click.command("split")
@click.argument("model")
@click.argument("weights", nargs=-1)
@connect_option
@_timeout_option("split", 5.0, "the broker")
@curve_client_options
@logging_options
def split_model(
    model: str, weights: tuple[str, ...], connect: str, timeout_s: float, curve: ClientKeys, logs: LogOptions
) -> None:
    """Split MODEL's requests that name no version between its served versions by weight:
    `batcher split digits 2=90 3=10`. No weights: all go to the newest again. It takes
    effect at the next request; `batcher stats` shows each version's share."""
    setup(logs)
    _ask("split", model, connect, timeout_s, curve, traffic=parse_split(weights))


def _repository_command(op: str, doc: str) -> click.Command:
    @click.command(op, help=doc)
    @click.argument("model")
    @connect_option
    @_timeout_option(op, 120.0, f"the {op}: new workers loading, or old ones draining")
    @curve_client_options
    @logging_options
    def command(model: str, connect: str, timeout_s: float, curve: ClientKeys, logs: LogOptions) -> None:
        setup(logs)
        _ask(op, model, connect, timeout_s, curve)

    return command


load_model = _repository_command(
    "load",
    "Load MODEL from serve's --model-repository (again): the versions its policy picks start, "
    "warm up and join, then the versions no longer picked drain and stop. Nothing in flight is lost.",
)
unload_model = _repository_command(
    "unload",
    "Unload MODEL: no new request reaches it, its queued and running requests are answered, then "
    "its workers stop. A poll of the repository leaves it unloaded until `batcher load MODEL`.",
)
