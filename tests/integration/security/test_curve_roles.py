"""CurveZMQ roles (hardening v1): --curve-clients admits on the frontend only,
--curve-workers on the backend only, so a client's key cannot be used to register as a
worker and read (and answer) other clients' requests.

Everything runs as real processes: `batcher keygen`, `batcher serve`, `batcher worker`.
Keys are laid out as docs/deployment.md says: each secret key in a directory of its
own, the allow-lists holding copies of public keys only.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from batcher.client.sync import BadRequest, Client, ClientTimeout, Forbidden, UnknownModel
from batcher.serve.launcher import free_tcp_address
from tests.helpers import curve_broker_stats, wait_until

pytestmark = pytest.mark.integration


class Keys:
    """Key pairs made with `batcher keygen`, and allow-list directories of public keys."""

    def __init__(self, root: Path, cli: Callable[..., Any]) -> None:
        self.root = root
        self.cli = cli

    def make(self, name: str) -> Path:
        """A key pair in secrets/NAME/; returns the secret key file."""
        result = self.cli("keygen", str(self.root / "secrets" / name), "--name", name)
        assert result.returncode == 0, result.stderr
        return self.root / "secrets" / name / f"{name}.key_secret"

    def allow(self, listing: str, *names: str) -> Path:
        """A directory holding copies of the public keys of `names`."""
        directory = self.root / listing
        directory.mkdir()
        for name in names:
            shutil.copy(self.public_file(name), directory)
        return directory

    def public_file(self, name: str) -> Path:
        return self.root / "secrets" / name / f"{name}.key"

    def secret_file(self, name: str) -> Path:
        return self.root / "secrets" / name / f"{name}.key_secret"

    def z85(self, name: str) -> str:
        public, _ = zmq.auth.load_certificate(str(self.public_file(name)))
        return public.decode()


@pytest.fixture
def keys(tmp_path: Path, cli: Callable[..., Any]) -> Keys:
    k = Keys(tmp_path, cli)
    for name in ("broker", "alice", "gpuhost", "stranger"):
        k.make(name)
    return k


def stats_as(
    frontend: str, keys: Keys, who: str, ctx: zmq.Context[Any], timeout_s: float = 1.0
) -> dict[str, Any]:
    """The broker's stats asked over CURVE with `who`'s key pair, or {} if no answer."""
    return curve_broker_stats(
        frontend, ctx, str(keys.public_file("broker")), str(keys.secret_file(who)), timeout_s
    )


def start_serve(spawn: Callable[..., Any], keys: Keys, *allow: str) -> tuple[Any, str, str]:
    """`batcher serve` with one echo worker, CURVE on and the allow-list options `allow`."""
    frontend, backend = free_tcp_address(), free_tcp_address()
    proc = spawn(
        "serve", "--frontend", frontend, "--backend", backend, "--workers", "1", "--model", "echo",
        "--heartbeat-ms", "200", "--curve-secret-key", str(keys.secret_file("broker")), *allow,
    )  # fmt: skip
    return proc, frontend, backend


def start_worker(spawn: Callable[..., Any], keys: Keys, backend: str, who: str) -> Any:
    """`batcher worker` for echo, connecting to the backend with `who`'s key pair."""
    return spawn(
        "worker", "--connect", backend, "--model", "echo", "--gpu", "7", "--heartbeat-ms", "200",
        "--curve-server-key", str(keys.public_file("broker")),
        "--curve-secret-key", str(keys.secret_file(who)),
    )  # fmt: skip


def log_lines(proc: Any, text: str) -> list[str]:
    return [line for line in proc.stderr_path.read_text(errors="replace").splitlines() if text in line]


def worker_names(snapshot: dict[str, Any]) -> list[str]:
    return [w["worker"] for w in snapshot.get("models", {}).get("echo", {}).get("worker_list", [])]


def test_curve_client_key_is_refused_as_a_worker_on_the_backend(spawn, keys, zctx):
    """The defect: a key allowed as a client registered on the backend as an echo worker."""
    clients = keys.allow("allowed-clients", "alice")
    workers = keys.allow("allowed-workers", "gpuhost")
    serve, frontend, backend = start_serve(
        spawn, keys, "--curve-clients", str(clients), "--curve-workers", str(workers)
    )
    wait_until(lambda: stats_as(frontend, keys, "alice", zctx).get("models"), 20, "serve answering alice")
    impostor = start_worker(spawn, keys, backend, "alice")
    listed = start_worker(spawn, keys, backend, "gpuhost")

    refusal = (
        f"refused a connection on the backend: key {keys.z85('alice')} is a client key, "
        "not in --curve-workers"
    )
    wait_until(lambda: log_lines(serve, refusal), 15, "the broker logging the client key refused")
    # The listed worker key does join (next to serve's own worker, on the broker's key)...
    # (serve's own worker may join after it: wait for both, not for the listed one alone)
    snapshot = wait_until(
        lambda: (
            (s := stats_as(frontend, keys, "alice", zctx))
            and any(f"pid{listed.pid}/" in n for n in worker_names(s))
            and s["models"]["echo"]["workers"] >= 2
            and s
        ),
        15,
        "the listed worker and serve's own joining",
    )
    # ...and the impostor never did.
    assert snapshot["models"]["echo"]["workers"] == 2, worker_names(snapshot)
    assert not any(f"pid{impostor.pid}/" in n for n in worker_names(snapshot)), worker_names(snapshot)
    assert len(log_lines(serve, refusal)) == 1, "one warning per refused key, however often it retries"

    # A client key on the frontend works, and its requests are served by admitted workers only.
    with Client(
        frontend,
        timeout_s=10,
        context=zctx,
        curve_server_key=str(keys.public_file("broker")),
        curve_secret_key=str(keys.secret_file("alice")),
    ) as alice:
        replies = [p.wait() for p in [alice.submit(i, model="echo") for i in range(20)]]
    assert [r["output"] for r in replies] == list(range(20)), replies
    assert not any(r["worker"].endswith(f"/{impostor.pid}") for r in replies), replies

    # A worker key on the frontend is refused, and the log says why.
    with (
        Client(
            frontend,
            timeout_s=1.0,
            context=zctx,
            curve_server_key=str(keys.public_file("broker")),
            curve_secret_key=str(keys.secret_file("gpuhost")),
        ) as as_client,
        pytest.raises(ClientTimeout),
    ):
        as_client.request("let me in", model="echo")
    wrong_side = (
        f"refused a connection on the frontend: key {keys.z85('gpuhost')} is a worker key, "
        "not in --curve-clients"
    )
    wait_until(lambda: log_lines(serve, wrong_side), 5, "the broker logging the worker key refused")


def test_curve_clients_only_admits_no_remote_worker(spawn, keys, zctx):
    """Only --curve-clients: the backend admits the broker's own key (serve's workers) and
    nothing else, so authenticated clients never meet an unauthenticated worker."""
    clients = keys.allow("allowed-clients", "alice")
    serve, frontend, backend = start_serve(spawn, keys, "--curve-clients", str(clients))
    # serve's own worker joined through the authenticated backend: it has the broker's key.
    wait_until(
        lambda: stats_as(frontend, keys, "alice", zctx).get("models", {}).get("echo", {}).get("workers") == 1,
        20,
        "serve's own worker joining",
    )
    start_worker(spawn, keys, backend, "alice")
    start_worker(spawn, keys, backend, "stranger")
    wait_until(
        lambda: log_lines(serve, f"backend: key {keys.z85('alice')} is a client key, not in --curve-workers"),
        15,
        "the client key refused on the backend",
    )
    wait_until(
        lambda: log_lines(serve, f"backend: public key {keys.z85('stranger')} is not in --curve-workers"),
        15,
        "the unlisted key refused on the backend",
    )
    assert stats_as(frontend, keys, "alice", zctx, timeout_s=10)["models"]["echo"]["workers"] == 1
    assert log_lines(serve, "backend admits only the broker's own key (no --curve-workers)")


def test_curve_workers_only_leaves_the_frontend_encrypted_but_open(spawn, keys, zctx):
    """Only --curve-workers: any client with the broker's public key may send requests
    (encrypted, not authenticated), only listed workers may serve them."""
    workers = keys.allow("allowed-workers", "gpuhost")
    serve, frontend, backend = start_serve(spawn, keys, "--curve-workers", str(workers))
    wait_until(lambda: stats_as(frontend, keys, "stranger", zctx).get("models"), 20, "serve answering")
    listed = start_worker(spawn, keys, backend, "gpuhost")
    start_worker(spawn, keys, backend, "alice")
    wait_until(
        lambda: any(
            f"pid{listed.pid}/" in n for n in worker_names(stats_as(frontend, keys, "stranger", zctx))
        ),
        15,
        "the listed worker joining",
    )
    wait_until(
        lambda: log_lines(serve, f"backend: public key {keys.z85('alice')} is not in --curve-workers"),
        15,
        "the unlisted key refused on the backend",
    )
    # A throwaway key pair (no --curve-secret-key) is admitted on the frontend.
    with Client(frontend, timeout_s=10, context=zctx, curve_server_key=str(keys.public_file("broker"))) as c:
        assert c.request_many(range(5), model="echo") == list(range(5))
    # serve's own worker and the listed one (serve's may join after the listed one)
    wait_until(
        lambda: (
            stats_as(frontend, keys, "stranger", zctx, timeout_s=2)
            .get("models", {})
            .get("echo", {})
            .get("workers")
            == 2
        ),
        20,
        "two workers serving echo",
    )
    assert not log_lines(serve, "on the frontend")


def test_curve_secret_key_in_an_allow_list_is_warned_about(keys, caplog):
    """README's layout rule: an allow-list holds public keys only; a secret found there
    is named at start (the keys still load: the .key files are what counts)."""
    from batcher.transport.security import load_allow_list

    sloppy = keys.allow("sloppy", "alice")
    shutil.copy(keys.secret_file("alice"), sloppy)
    with caplog.at_level(logging.WARNING, logger="batcher.security"):
        allowed = load_allow_list(str(sloppy), "--curve-clients")
    assert allowed == {keys.z85("alice").encode()}
    assert any("holds secret key files (alice.key_secret)" in r.getMessage() for r in caplog.records)


def test_curve_refusals_are_logged_at_a_bounded_rate(caplog):
    """One WARNING per refused key, however often it retries, and none past
    MAX_REMEMBERED_REFUSALS distinct keys, so made-up keys cannot flood the log."""
    from batcher.transport import security

    check = security._RoleCheck("backend", {b"w" * 40}, "--curve-workers", {b"c" * 40}, "client")
    made_up = [f"{i:040d}".encode() for i in range(security.MAX_REMEMBERED_REFUSALS + 50)]
    with caplog.at_level(logging.DEBUG, logger="batcher.security"):
        assert check.callback("backend", b"w" * 40)
        for _ in range(3):
            assert not check.callback("backend", b"c" * 40)
        for key in made_up:
            assert not check.callback("backend", key)
            assert not check.callback("backend", key)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        warnings[0]
        == f"refused a connection on the backend: key {'c' * 40} is a client key, not in --curve-workers"
    )
    assert len(warnings) == security.MAX_REMEMBERED_REFUSALS
    assert len(check.refused) == security.MAX_REMEMBERED_REFUSALS


# --- SIGHUP reads the allow-lists again (issue 14) -------------------------------------------------


@pytest.mark.parametrize("command", ["broker", "serve"])
def test_sighup_reads_the_allow_list_again(spawn, keys, zctx, command):
    """A key added to --curve-clients is admitted after SIGHUP; a removed one is refused
    at its next connection; a directory that cannot be read keeps the lists as they were."""
    clients = keys.allow("allowed-clients", "alice")
    frontend, backend = free_tcp_address(), free_tcp_address()
    args = ["--frontend", frontend, "--backend", backend, "--model", "echo"]
    if command == "serve":
        args += ["--workers", "1"]
    proc = spawn(
        command, *args, "--curve-secret-key", str(keys.secret_file("broker")), "--curve-clients", str(clients)
    )
    wait_until(lambda: stats_as(frontend, keys, "alice", zctx).get("models"), 20, "alice admitted")
    assert stats_as(frontend, keys, "stranger", zctx) == {}  # not listed yet

    shutil.copy(keys.public_file("stranger"), clients)
    (clients / "alice.key").unlink()
    os.kill(proc.pid, signal.SIGHUP)
    wait_until(lambda: stats_as(frontend, keys, "stranger", zctx).get("models"), 20, "stranger admitted")
    assert stats_as(frontend, keys, "alice", zctx) == {}  # a fresh connection of alice's: refused
    assert "SIGHUP: allow-lists read again; frontend admits 1 client keys" in proc.stderr_path.read_text()

    shutil.rmtree(clients)
    os.kill(proc.pid, signal.SIGHUP)
    wait_until(
        lambda: "the allow-lists are unchanged" in proc.stderr_path.read_text(), 20, "the error logged"
    )
    assert stats_as(frontend, keys, "stranger", zctx).get("models")  # still admitted


# --- the admin role: --curve-admins (issue 28 item 19) -------------------------------------------


def client_as(frontend: str, keys: Keys, who: str, ctx: zmq.Context[Any], timeout_s: float = 60.0) -> Client:
    """A Client of the CURVE broker with `who`'s key pair."""
    return Client(
        frontend,
        timeout_s=timeout_s,
        context=ctx,
        curve_server_key=str(keys.public_file("broker")),
        curve_secret_key=str(keys.secret_file(who)),
    )


def echo_pids(snapshot: dict[str, Any]) -> list[str]:
    """The pid part of each echo worker's name in a stats snapshot."""
    return [part for name in worker_names(snapshot) for part in name.split("/") if part.startswith("pid")]


def test_only_an_admin_key_may_reload_and_others_see_no_worker_pids(spawn, keys, zctx, cli):
    """With --curve-admins, a listed client's `reload` is answered `forbidden` (by the
    Python client, the CLI, and logged with its key) and changes nothing, and its `stats`
    name the workers without their pids; an admin's key, admitted on the frontend though
    not in --curve-clients, reloads and sees the pids; so does the broker's own key
    (serve's gateway, bench --spawn); and SIGHUP to serve still reloads every model."""
    keys.make("ops")
    clients = keys.allow("allowed-clients", "alice")
    admins = keys.allow("admins", "ops")
    serve, frontend, _ = start_serve(
        spawn, keys, "--curve-clients", str(clients), "--curve-admins", str(admins)
    )
    as_ops = wait_until(
        lambda: (
            (s := stats_as(frontend, keys, "ops", zctx)).get("models", {}).get("echo", {}).get("workers") == 1
            and s
        ),
        20,
        "serve's worker joining, seen by the admin",
    )
    (first_pid,) = echo_pids(as_ops)
    as_alice = stats_as(frontend, keys, "alice", zctx)
    assert as_alice["models"]["echo"]["workers"] == 1
    assert echo_pids(as_alice) == [], worker_names(as_alice)
    (ops_name,), (alice_name,) = worker_names(as_ops), worker_names(as_alice)
    assert alice_name == ops_name.replace(f"/{first_pid}/", "/"), (alice_name, ops_name)
    assert stats_as(frontend, keys, "stranger", zctx) == {}  # neither list: refused as before

    with client_as(frontend, keys, "alice", zctx) as alice:
        with pytest.raises(Forbidden) as refused:
            alice.control("reload", model="echo")
        assert refused.value.code == "forbidden"
        assert "--curve-admins" in refused.value.message
        assert alice.request("still served", model="echo") == "still served"  # a client, still
    result = cli(
        "reload", "echo", "--connect", frontend, "--curve-server-key", str(keys.public_file("broker")),
        "--curve-secret-key", str(keys.secret_file("alice")), "--timeout-s", "10",
    )  # fmt: skip
    assert result.returncode == 1, result
    assert "reload of 'echo' failed: forbidden:" in result.stderr, result.stderr
    assert log_lines(serve, f"refused reload from key {keys.z85('alice')}: not in --curve-admins")
    assert echo_pids(stats_as(frontend, keys, "ops", zctx)) == [first_pid]  # nothing was reloaded

    result = cli(
        "reload", "echo", "--connect", frontend, "--curve-server-key", str(keys.public_file("broker")),
        "--curve-secret-key", str(keys.secret_file("ops")), "--timeout-s", "60",
        timeout_s=90,
    )  # fmt: skip
    assert result.returncode == 0, result
    assert '"replaced": 1' in result.stdout, result.stdout
    (second_pid,) = echo_pids(stats_as(frontend, keys, "ops", zctx))
    assert second_pid != first_pid

    with client_as(frontend, keys, "broker", zctx) as own:  # the broker's own key pair
        assert own.control("reload", model="echo")["replaced"] == 1
        (third_pid,) = echo_pids(own.control("stats"))
    assert third_pid not in (first_pid, second_pid)

    os.kill(serve.pid, signal.SIGHUP)  # serve's own reload, no key involved
    wait_until(
        lambda: (p := echo_pids(stats_as(frontend, keys, "ops", zctx))) and third_pid not in p,
        60,
        "SIGHUP replacing the worker",
    )


def test_a_key_gains_and_loses_the_admin_role_at_its_next_request_after_sighup(spawn, keys, zctx):
    """`batcher broker --curve-admins` alone: the frontend stays open to any key (and the
    backend too, as without lists), a non-admin gets `forbidden` before the op is
    judged; the admin list is read again on SIGHUP and applies to connections already up."""
    admins = keys.allow("admins", "alice")
    frontend, backend = free_tcp_address(), free_tcp_address()
    broker = spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", "echo",
        "--curve-secret-key", str(keys.secret_file("broker")), "--curve-admins", str(admins),
    )  # fmt: skip
    wait_until(lambda: stats_as(frontend, keys, "stranger", zctx).get("models"), 20, "the broker answering")
    start_worker(spawn, keys, backend, "gpuhost")  # not listed anywhere: the backend is open
    wait_until(
        lambda: stats_as(frontend, keys, "alice", zctx).get("models", {}).get("echo", {}).get("workers") == 1,
        20,
        "an unlisted worker joining",
    )
    with (
        client_as(frontend, keys, "alice", zctx, 10) as alice,
        client_as(frontend, keys, "stranger", zctx, 10) as stranger,
    ):
        assert echo_pids(stranger.control("stats")) == []
        assert len(echo_pids(alice.control("stats"))) == 1
        with pytest.raises(Forbidden):
            stranger.control("reload", model="echo")
        with pytest.raises(BadRequest, match="reload needs `batcher serve`"):  # an admin: judged
            alice.control("reload", model="echo")

        # alice leaves the list, stranger joins it; both stay connected.
        (admins / "alice.key").unlink()
        shutil.copy(keys.public_file("stranger"), admins)
        os.kill(broker.pid, signal.SIGHUP)
        wait_until(lambda: log_lines(broker, "SIGHUP: allow-lists read again"), 20, "the lists read again")
        with pytest.raises(BadRequest, match="reload needs `batcher serve`"):
            stranger.control("reload", model="echo")
        with pytest.raises(Forbidden):
            alice.control("reload", model="echo")
        assert len(echo_pids(stranger.control("stats"))) == 1
        assert echo_pids(alice.control("stats")) == []
    assert log_lines(broker, "1 admin keys from")


def test_without_curve_admins_every_listed_client_may_reload_and_see_pids(spawn, keys, zctx):
    """No --curve-admins: as before, any client admitted may reload and reads the pids."""
    clients = keys.allow("allowed-clients", "alice")
    _serve, frontend, _ = start_serve(spawn, keys, "--curve-clients", str(clients))
    wait_until(
        lambda: stats_as(frontend, keys, "alice", zctx).get("models", {}).get("echo", {}).get("workers") == 1,
        20,
        "serve's worker joining",
    )
    with client_as(frontend, keys, "alice", zctx) as alice:
        (first_pid,) = echo_pids(alice.control("stats"))
        assert alice.control("reload", model="echo")["replaced"] == 1
        (second_pid,) = echo_pids(alice.control("stats"))
    assert second_pid != first_pid


def test_split_load_and_unload_are_an_admins_alone(spawn, keys, zctx):
    """The model repository's ops change the service (docs/models.md): with --curve-admins
    a non-admin's `split`, `load` and `unload` are `forbidden` before they are judged; an
    admin's are judged (a plain broker has no repository and no versioned model)."""
    admins = keys.allow("admins", "alice")
    frontend, backend = free_tcp_address(), free_tcp_address()
    spawn(
        "broker", "--frontend", frontend, "--backend", backend, "--model", "echo",
        "--curve-secret-key", str(keys.secret_file("broker")), "--curve-admins", str(admins),
    )  # fmt: skip
    wait_until(lambda: stats_as(frontend, keys, "stranger", zctx).get("models"), 20, "the broker answering")
    with (
        client_as(frontend, keys, "alice", zctx, 10) as alice,
        client_as(frontend, keys, "stranger", zctx, 10) as stranger,
    ):
        for op, fields in (("split", {"traffic": {"2": 1}}), ("load", {}), ("unload", {})):
            with pytest.raises(Forbidden, match="--curve-admins"):
                stranger.control(op, model="echo", **fields)
        with pytest.raises(UnknownModel, match="no versioned model 'echo'"):
            alice.control("split", model="echo", traffic={"2": 1})
        with pytest.raises(BadRequest, match="needs `batcher serve --model-repository`"):
            alice.control("load", model="echo")
        with pytest.raises(BadRequest, match="needs `batcher serve --model-repository`"):
            stranger.control("repository_index")  # reading only: anyone's, judged
