"""Facts the docs state about the code, checked against the code (issue 28 item 20), so
that they cannot drift again: protocol.md's `stats` example has exactly the keys of a
live broker's snapshot, the constants the docs quote are the code's, and the README's
list of the options that read no variable is the CLI's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest

import batcher.cli.commands
from batcher.broker.loop import HARD_LIMIT_FACTOR
from batcher.core.scheduler import PREFETCH_GRACE_S

ROOT = Path(__file__).resolve().parents[3]


def read(name: str) -> str:
    return (ROOT / name).read_text()


def stats_example() -> dict:
    text = read("docs/protocol.md")
    section = text[text.index("### 4.4 Control request: `stats`") :]
    return json.loads(section[section.index("```json") + len("```json") : section.index("\n```\n")])


@pytest.mark.integration
def test_the_stats_example_has_exactly_the_keys_of_a_live_snapshot(serve, client) -> None:
    s = serve("--model", "echo", "--workers", "1", workers=1)
    c = client(s.frontend)
    c.request_many([1, 2, 3], model="echo")
    live = c.control("stats")
    example = stats_example()
    assert sorted(example) == sorted(live)
    assert sorted(example["models"]["echo"]) == sorted(live["models"]["echo"])
    assert sorted(example["models"]["echo"]["worker_list"][0]) == sorted(
        live["models"]["echo"]["worker_list"][0]
    )


def test_the_quoted_constants_are_the_codes() -> None:
    scheduling = read("docs/scheduling.md")
    assert f"plus {PREFETCH_GRACE_S * 1000:g} ms (`PREFETCH_GRACE_S`)" in scheduling
    assert "applies to requests that arrive after it" not in scheduling
    (max_message,) = [
        p for p in batcher.cli.commands.main.commands["serve"].params if p.name == "max_message_bytes"
    ]
    assert "too_large" in (max_message.help or "") and "bad_request" not in (max_message.help or "")
    assert f"{HARD_LIMIT_FACTOR} x this (the hard limit)" in (max_message.help or "")


def test_the_request_path_names_methods_that_exist() -> None:
    import batcher.broker.backend
    import batcher.broker.loop

    modules = {"Backend": batcher.broker.backend, "Broker": batcher.broker.loop}
    named = re.findall(r"`(Broker|Backend)\.(_?\w+)`", read("README.md"))
    assert named
    for cls, method in named:
        assert hasattr(getattr(modules[cls], cls), method), f"README names {cls}.{method}"


def test_the_readme_lists_exactly_the_options_that_read_no_variable() -> None:
    unread = {
        (name, p.opts[0])
        for name, command in batcher.cli.commands.main.commands.items()
        for p in command.params
        if isinstance(p, click.Option) and not p.envvar and not p.hidden and p.opts[0] != "--help"
    }
    text = " ".join(read("README.md").split())
    sentence = text[text.index("read none:") : text.index("(a variable left set")]
    listed: set[tuple[str, str]] = set()
    command = None
    for token in re.findall(r"`([^`]+)`", sentence):
        words = token.split()
        if len(words) == 2:
            command, flag = words
        else:
            (flag,) = words
        listed.add((command, flag))
    assert listed == unread
    words = {3: "three", 6: "six", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    assert f"except {words.get(len(unread), len(unread))} that are choices" in text
