"""What tests/unit/cli/test_deploy.py and tests/integration/cluster/test_cluster.py read
of the Dockerfile and of deploy/kubernetes/: the manifests' documents, the commands their
containers and probes run, and the same commands rewritten for a simulated node
(tests/netns.py)."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml

from batcher.cli.commands import main

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
#: The reason the multi-broker gateway's checks wait for it.
GATEWAY_OVER_MANY = "the gateway over many brokers (issue 31 item 1)"


def gateway_has_discover() -> bool:
    """Whether `batcher gateway` takes --discover (issue 31 item 1 is in)."""
    return any("--discover" in p.opts for p in main.commands["gateway"].params)


def documents() -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, document) of every manifest of deploy/kubernetes/."""
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def find(kind: str, name: str) -> dict[str, Any]:
    """The manifest of `kind` named `name`."""
    for _, doc in documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} {name} in {MANIFESTS}")


@dataclass(frozen=True)
class Command:
    """A batcher command line a manifest or the Dockerfile runs: where, and its argv
    after `batcher`."""

    where: str
    argv: tuple[str, ...]

    @property
    def subcommand(self) -> str:
        return self.argv[0]

    def __str__(self) -> str:
        return f"{self.where}: batcher {shlex.join(self.argv)}"


def _container_commands(file: str, doc: dict[str, Any]) -> Iterator[Command]:
    spec = doc["spec"]["template"]["spec"]
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        where = f"{file} {doc['metadata']['name']}/{c['name']}"
        command = c.get("command", ["batcher"])  # the image's ENTRYPOINT is batcher
        assert command == ["batcher"], f"{where}: runs {command}, not the image's batcher"
        yield Command(where, tuple(c["args"]))
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            exec_ = c.get(probe, {}).get("exec")
            if exec_:
                argv = exec_["command"]
                assert argv[0] == "batcher", f"{where} {probe}: {argv}"
                yield Command(f"{where} {probe}", tuple(argv[1:]))


def manifest_commands() -> list[Command]:
    """Every batcher command line of the manifests' containers and exec probes."""
    out = []
    for file, doc in documents():
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            out.extend(_container_commands(file, doc))
    return out


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile, continuation lines joined."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += (" " if current else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current)
            current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_args() -> dict[str, str]:
    """The Dockerfile's ARG defaults."""
    out = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            out[name] = value
    return out


def dockerfile_commands() -> list[Command]:
    """ENTRYPOINT + CMD, and the HEALTHCHECK's command, as batcher command lines."""
    entry: list[str] = []
    cmd: list[str] = []
    health: list[str] = []
    for word, rest in dockerfile_instructions():
        if word == "ENTRYPOINT":
            entry = yaml.safe_load(rest)
        elif word == "CMD":
            cmd = yaml.safe_load(rest)
        elif word == "HEALTHCHECK":
            health = yaml.safe_load(rest[rest.index("CMD ") + 4 :])
    assert entry == ["batcher"], entry
    assert health[0] == "batcher", health
    return [Command("Dockerfile CMD", tuple(cmd)), Command("Dockerfile HEALTHCHECK", tuple(health[1:]))]


def parse(command: Command) -> dict[str, Any]:
    """Parse `command` as batcher's CLI does (unknown flags and missing values raise
    click.UsageError); every value is converted by its option's type, but for paths,
    which name files of the pod (checked against its mounts elsewhere)."""
    sub = main.commands.get(command.subcommand)
    if sub is None:
        raise click.UsageError(f"no command {command.subcommand!r}")
    ctx = click.Context(sub, info_name=command.subcommand)
    values, extra, order = sub.make_parser(ctx).parse_args(list(command.argv[1:]))
    if extra and not any(isinstance(p, click.Argument) for p in sub.params):
        raise click.UsageError(f"unexpected arguments {extra}")
    for param in order:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        value = values[param.name]
        if param.is_flag or isinstance(param.type, click.Path):
            continue
        for v in value if isinstance(value, list) else [value]:
            param.type.convert(v, param, ctx)
    return values


def uses_many_brokers(command: Command) -> bool:
    """Whether `command` needs the gateway over many brokers: --discover, or --connect
    given more than once."""
    argv = command.argv
    if command.subcommand != "gateway":
        return False
    return any(a.startswith("--discover") for a in argv) or argv.count("--connect") > 1


def mounts(container: dict[str, Any]) -> list[str]:
    """The mount paths of a container."""
    return [m["mountPath"] for m in container.get("volumeMounts", [])]


# --- the manifests' commands on a simulated node (tests/integration/cluster/test_cluster.py) ---

#: The API key the simulated gateways accept.
API_KEY = "cluster-test-token"
POD_ETC = "/etc/batcher"


def pod_files(root: Path) -> Path:
    """The files a pod mounts, made under `root` as the manifests mount them: the
    ConfigMap's batcher.toml, the CurveZMQ keys of the Secret (made by `batcher keygen`),
    the clients' allow-list and the API keys. Returns root's etc/batcher."""
    import subprocess
    import sys

    from workers.supervisor import child_environment

    etc = root / POD_ETC.lstrip("/")
    keys, clients, api = etc / "keys", etc / "clients", etc / "api-keys"
    for d in (keys, clients, api):
        d.mkdir(parents=True, exist_ok=True)
    (etc / "batcher.toml").write_text(find("ConfigMap", "batcher-config")["data"]["batcher.toml"])
    for name in ("broker", "gateway"):
        subprocess.run(
            [sys.executable, "-m", "batcher", "keygen", "--name", name, str(keys)],
            check=True,
            capture_output=True,
            env=child_environment(),
            timeout=60,
        )
    (clients / "gateway.key").write_bytes((keys / "gateway.key").read_bytes())
    (api / "api-keys").write_text(API_KEY + "\n")
    return etc


def on_node(argv: tuple[str, ...] | list[str], root: Path) -> list[str]:
    """A manifest's command line with the pod's mount paths under `root` (nothing else
    changed)."""
    prefix = str(root / POD_ETC.lstrip("/"))
    return [prefix + a[len(POD_ETC) :] if a.startswith(POD_ETC + "/") else a for a in argv]


def _container(deployment: str) -> dict[str, Any]:
    (container,) = find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


def cell_argv(root: Path) -> list[str]:
    """The GPU cell's `batcher serve` command line, on a node."""
    return on_node(_container("batcher-cell")["args"], root)


def cell_ready_argv(root: Path) -> list[str]:
    """The cell's readiness probe (`batcher ready ...`), on a node."""
    return on_node(_container("batcher-cell")["readinessProbe"]["exec"]["command"][1:], root)


def gateway_argv(root: Path, *, discover_file: Path | None = None, connect: str | None = None) -> list[str]:
    """The gateway's command line, on a node: its DNS discovery (a headless Service, which
    the simulated cluster has no DNS for) replaced by `--discover file:PATH`, the same
    gateway's other source; or, for a gateway without discovery yet (before issue 31
    item 1), by `--connect ADDRESS` and no interval."""
    argv = list(_container("batcher-gateway")["args"])
    i = argv.index("--discover")
    if discover_file is not None:
        argv[i + 1] = f"file:{discover_file}"
    else:
        assert connect is not None
        j = argv.index("--discover-interval-s")
        for k in sorted((i, i + 1, j, j + 1), reverse=True):
            del argv[k]
        argv[1:1] = ["--connect", connect]
    return on_node(argv, root)


def discover_interval_s() -> float:
    """The gateway's --discover-interval-s in its manifest."""
    argv = _container("batcher-gateway")["args"]
    return float(argv[argv.index("--discover-interval-s") + 1])


def http_port(deployment: str = "batcher-gateway") -> int:
    """The gateway's HTTP port (its container's `http` port)."""
    ports = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}
    return int(ports["http"])


def frontend_port() -> int:
    """The cell's frontend port (its container's `frontend` port)."""
    ports = {p["name"]: p["containerPort"] for p in _container("batcher-cell")["ports"]}
    return int(ports["frontend"])
