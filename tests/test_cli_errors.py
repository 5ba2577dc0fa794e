"""The command line's one-line errors for what a user gets wrong before any socket
opens: an address of the wrong form (every address option, one validator:
batcher.addresses), and an extra that is not installed (the `pip install` that fixes it).

Run through `python -m batcher` (the `cli` fixture), as a user runs it.
"""

from __future__ import annotations

import click
import pytest

import batcher.cli
from batcher.addresses import EXPECTED, check_address

#: Arguments a command needs before its options (reload's MODEL).
ARGUMENTS = {"reload": ["m"]}


def address_options() -> list[tuple[str, str]]:
    """(command, --option) of every option typed as a ZeroMQ address."""
    found = []
    for name, command in sorted(batcher.cli.main.commands.items()):
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, batcher.cli.ZmqAddress):
                found.append((name, p.opts[0]))
    return found


def test_every_address_option_is_checked_by_the_one_validator() -> None:
    named = {
        (name, p.opts[0])
        for name, command in batcher.cli.main.commands.items()
        for p in command.params
        if isinstance(p, click.Option) and p.opts[0] in ("--connect", "--frontend", "--backend")
    }
    assert named == set(address_options())
    assert {"send", "stats", "ready", "reload", "gateway", "worker", "bench", "serve", "broker"} <= {
        c for c, _ in named
    }


@pytest.mark.parametrize(
    "text",
    ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:65535", "ipc:///tmp/b.sock", " tcp://h:80 "],
)
def test_addresses_of_both_forms_pass(text: str) -> None:
    assert check_address(text, bind=False) == text.strip()
    assert check_address("tcp://*:5555", bind=True) == "tcp://*:5555"


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1:5555",
        "localhost",
        "",
        "http://127.0.0.1:5555",
        "tcp://127.0.0.1",
        "tcp://:5555",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:port",
        "tcp://127.0.0.1:*",
        "tcp://*:5555",
        "tcp://[::1:5555",
        "ipc://",
    ],
)
def test_anything_else_is_refused_naming_the_expected_form(text: str) -> None:
    with pytest.raises(ValueError, match=EXPECTED.replace("/", ".")):
        check_address(text, bind=False)


@pytest.mark.integration
@pytest.mark.parametrize(("command", "flag"), address_options())
def test_an_address_without_a_scheme_is_a_one_line_usage_error(cli, command: str, flag: str) -> None:
    result = cli(command, *ARGUMENTS.get(command, []), flag, "127.0.0.1:5555", timeout_s=30)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(result.stderr.splitlines()) <= 4, result.stderr
    assert errors[0].startswith(f"Error: Invalid value for '{flag}'"), result.stderr
    assert errors[0].endswith(f"expected {EXPECTED}, got '127.0.0.1:5555' (no scheme)"), result.stderr


@pytest.mark.integration
def test_a_config_files_address_is_checked_as_the_flag_is(cli, tmp_path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('frontend = "127.0.0.1:5555"\n')
    result = cli("broker", "--config", str(config), timeout_s=30)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert f"expected {EXPECTED}" in result.stderr, result.stderr
