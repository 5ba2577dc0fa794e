"""The command line's one-line errors for what a user gets wrong before any socket
opens: an address of the wrong form (every address option, one validator:
batcher.transport.addresses), and an extra that is not installed (the `pip install` that fixes it).

Run through `python -m batcher` (the `cli` fixture), as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys

import click
import pytest

import batcher.cli.commands
from batcher.client.sync import BatcherError, Client
from batcher.serve.launcher import free_tcp_address
from batcher.transport.addresses import EXPECTED, check_address
from tests.helpers import model_stats, wait_until
from workers.supervisor import child_environment


def free_port() -> int:
    return int(free_tcp_address().rsplit(":", 1)[1])


#: Arguments a command needs before its options (reload's MODEL).
ARGUMENTS = {"reload": ["m"]}


def address_options() -> list[tuple[str, str]]:
    """(command, --option) of every option typed as a ZeroMQ address."""
    found = []
    for name, command in sorted(batcher.cli.commands.main.commands.items()):
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, batcher.cli.commands.ZmqAddress):
                found.append((name, p.opts[0]))
    return found


def test_every_address_option_is_checked_by_the_one_validator() -> None:
    named = {
        (name, p.opts[0])
        for name, command in batcher.cli.commands.main.commands.items()
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


# --- extras that are not installed --------------------------------------------------------------

#: A sitecustomize that makes the modules named in $BATCHER_TEST_BLOCKED unimportable in
#: every process started with its directory on PYTHONPATH (serve's workers and gateway
#: too), as if they were not installed.
BLOCKER = """
import os
import sys

BLOCKED = set(filter(None, os.environ.get("BATCHER_TEST_BLOCKED", "").split(",")))


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Blocker())
"""


@pytest.fixture
def without(tmp_path, monkeypatch):
    """`without("uvicorn", ...)`: the processes started next cannot import those modules
    (checked: a `python -c "import M"` of each fails)."""

    def block(*modules: str) -> None:
        site = tmp_path / "blocker"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER)
        monkeypatch.setenv("PYTHONPATH", str(site))
        monkeypatch.setenv("BATCHER_TEST_BLOCKED", ",".join(modules))
        for module in modules:
            probe = subprocess.run(
                [sys.executable, "-c", f"import {module}"],
                env=child_environment(),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe

    return block


def assert_one_line_error(result, *expected: str) -> None:
    """Exit 1, no traceback, the error one line holding each of `expected`."""
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for text in expected:
        assert text in errors[0], result.stderr


@pytest.mark.integration
@pytest.mark.parametrize("module", ["uvicorn", "grpc", "google.protobuf"])
def test_the_gateway_without_its_extra_names_the_pip_install(cli, without, module: str) -> None:
    without(module)
    result = cli("gateway", "--connect", free_tcp_address(), "--http-port", str(free_port()), timeout_s=30)
    assert_one_line_error(result, "batcher gateway needs the gateway extra", "pip install 'batcher[gateway]'")
    assert result.stderr.splitlines()[-1].startswith("Error:"), result.stderr


@pytest.mark.integration
@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_serve_with_a_gateway_port_but_no_extra_names_the_pip_install_before_starting(
    cli, without, flag: str
) -> None:
    without("uvicorn", "grpc")
    addresses = ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]
    result = cli("serve", *addresses, flag, str(free_port()), timeout_s=30)
    assert_one_line_error(result, "needs the gateway extra", "pip install 'batcher[gateway]'")
    assert "broker listening" not in result.stderr  # refused before anything started


@pytest.mark.integration
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_onnx_model_without_onnxruntime_names_the_pip_install(cli, without, tmp_path, command) -> None:
    onnx_models = pytest.importorskip("tests.onnx_models", reason="the onnx package builds the test model")
    path = onnx_models.linear(tmp_path / "digits.onnx")
    without("onnxruntime")
    addresses = (
        ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]
        if command == "serve"
        else ["--connect", free_tcp_address()]
    )
    result = cli(command, "--model", f"onnx:{path}", *addresses, timeout_s=30)
    assert_one_line_error(result, f"--model onnx:{path} needs the onnx extra", "pip install 'batcher[onnx]'")


@pytest.mark.integration
def test_a_worker_without_numpy_answers_a_tensor_naming_the_pip_install(spawn, zctx, without) -> None:
    without("numpy")
    frontend, backend = free_tcp_address(), free_tcp_address()
    spawn("serve", "--model", "echo", "--workers", "1", "--frontend", frontend, "--backend", backend)
    wait_until(lambda: model_stats(frontend, zctx, "echo").get("workers") == 1, 30, "echo's worker")
    with Client(frontend, timeout_s=10, context=zctx) as c, pytest.raises(BatcherError) as refused:
        c.request({"datatype": "FP32", "shape": [1], "data": b"\0\0\0\0"})
    assert refused.value.code == "bad_request"
    assert "numpy is not installed here (pip install 'batcher[tensors]')" in refused.value.message


@pytest.mark.integration
def test_a_stacked_model_without_numpy_stops_serve_naming_the_pip_install(cli, without) -> None:
    without("numpy")
    addresses = ["--frontend", free_tcp_address(), "--backend", free_tcp_address()]
    result = cli(
        "serve", "--model", "s=tests.fixture_models:LengthSpan", "--workers", "1", *addresses, timeout_s=60
    )
    assert_one_line_error(result, "model 's' could not be loaded")
    (load_error,) = [line for line in result.stderr.splitlines() if "cannot load model" in line]
    assert "No module named 'numpy'" in load_error and "(pip install 'batcher[tensors]')" in load_error
    assert "Traceback" not in result.stderr
