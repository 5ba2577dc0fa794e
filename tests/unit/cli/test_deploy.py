"""The image and the Kubernetes manifests (issue 31, items 3 and 4), checked as far as this
machine can without a container runtime or a cluster:

- every manifest validates against the current Kubernetes schema (kubernetes-validate,
  strict: no unknown field); the custom resources (ServiceMonitor, KEDA's ScaledObject,
  the Kustomization), which it has no schema for, get their metadata validated against
  the ObjectMeta schema and their spec checked field by field below against the CRDs'
  documented fields;
- the manifests agree with each other (selectors, ports, volumes, the ConfigMap and
  Secret keys they mount, the scale targets);
- every command line the Dockerfile and the manifests run is one batcher's CLI accepts
  (flags parsed, values converted), `--help` of each works, and every BATCHER_ variable
  they set is one the CLI reads;
- the Dockerfile installs batcher as README.md's "Container image" section says.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import referencing
import referencing.jsonschema

from batcher.broker.loop import BrokerSettings
from batcher.cli.commands import main
from batcher.cli.config_file import load_config
from tests.deploy_manifests import (
    GATEWAY_OVER_MANY,
    MANIFESTS,
    ROOT,
    Command,
    dockerfile_args,
    dockerfile_commands,
    dockerfile_instructions,
    documents,
    find,
    gateway_has_discover,
    manifest_commands,
    mounts,
    parse,
    uses_many_brokers,
)

VERSION = kubernetes_validate.latest_version()
#: Kinds kubernetes-validate has no schema for (custom resources), checked below.
CUSTOM = {"ServiceMonitor", "ScaledObject", "Kustomization"}
DOCS = list(documents())


def _id(item: tuple[str, dict[str, Any]]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1].get('metadata', {}).get('name', '')}"


# --- schemas ------------------------------------------------------------------------------


@pytest.mark.parametrize("item", [d for d in DOCS if d[1]["kind"] not in CUSTOM], ids=_id)
def test_manifest_validates_against_the_kubernetes_schema(item: tuple[str, dict[str, Any]]) -> None:
    _, doc = item
    kubernetes_validate.validate(doc, VERSION, strict=True)


def _object_meta_validator() -> jsonschema.protocols.Validator:
    """A validator of ObjectMeta from kubernetes-validate's own schema files."""
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{VERSION}-local-strict"
    definitions = json.loads((base / "_definitions.json").read_text())
    resource = referencing.Resource.from_contents(
        definitions, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource(definitions["$id"], resource)
    schema = {"$ref": definitions["$id"] + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_the_kinds_are_the_issues() -> None:
    kinds = {(doc["kind"], doc.get("metadata", {}).get("name")) for _, doc in DOCS}
    for wanted in [
        ("Deployment", "batcher-cell"),
        ("Deployment", "batcher-cell-cpu"),
        ("Service", "batcher-cell"),
        ("Deployment", "batcher-gateway"),
        ("Service", "batcher-gateway"),
        ("ConfigMap", "batcher-config"),
        ("Secret", "batcher-curve"),
        ("PodDisruptionBudget", "batcher-cell"),
        ("NetworkPolicy", "batcher-cell"),
        ("ServiceMonitor", "batcher-cell"),
        ("ScaledObject", "batcher-cell"),
        ("HorizontalPodAutoscaler", "batcher-cell"),
    ]:
        assert wanted in kinds


def test_custom_resources_metadata_and_fields() -> None:
    """ServiceMonitor (monitoring.coreos.com/v1) and ScaledObject (keda.sh/v1alpha1): no
    schema ships with kubernetes-validate, so their metadata is validated as ObjectMeta and
    their spec against the fields the CRDs define (required ones present, types right,
    nothing else at the top of spec)."""
    meta = _object_meta_validator()
    monitor = find("ServiceMonitor", "batcher-cell")
    scaled = find("ScaledObject", "batcher-cell")
    for doc in (monitor, scaled):
        meta.validate(doc["metadata"])
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels"}
    assert set(spec["namespaceSelector"]) <= {"any", "matchNames"}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        for key in ("interval", "scrapeTimeout"):  # Prometheus durations
            assert re.fullmatch(r"(\d+(ms|s|m|h))+", endpoint[key]), endpoint
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= {
        "scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
        "idleReplicaCount", "advanced", "triggers", "fallback",
    }  # fmt: skip
    assert set(spec["scaleTargetRef"]) <= {"apiVersion", "kind", "name", "envSourceContainerName"}
    assert all(isinstance(spec[k], int) for k in ("minReplicaCount", "maxReplicaCount", "pollingInterval"))
    assert spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
    # KEDA's trigger metadata is a map of strings
    assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger["metadata"]
    assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])
    # its HPA's behavior is a core HorizontalPodAutoscaler's: validated as one
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = find("HorizontalPodAutoscaler", "batcher-cell")
    kubernetes_validate.validate({**hpa, "spec": {**hpa["spec"], "behavior": behavior}}, VERSION, strict=True)


def test_the_kustomization_lists_files_that_exist() -> None:
    kustomization = find_kustomization()
    for name in kustomization["resources"]:
        assert (MANIFESTS / name).is_file(), name
    listed = set(kustomization["resources"])
    others = {p.name for p in MANIFESTS.glob("*.yaml")} - listed - {"kustomization.yaml"}
    # the alternatives are left out on purpose, and said so in the file
    assert others == {"cell-cpu.yaml", "hpa-prometheus-adapter.yaml"}


def find_kustomization() -> dict[str, Any]:
    (doc,) = [d for f, d in DOCS if d["kind"] == "Kustomization"]
    return doc


# --- the manifests agree with each other ------------------------------------------------


def _pod_labels() -> list[dict[str, str]]:
    return [d["spec"]["template"]["metadata"]["labels"] for _, d in DOCS if d["kind"] == "Deployment"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_select_pods_that_exist() -> None:
    pods = _pod_labels()
    for _, doc in DOCS:
        kind, spec = doc["kind"], doc.get("spec", {})
        if kind == "Deployment":
            assert _selects(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])
        elif kind in ("Service", "ServiceMonitor") and kind == "Service":
            assert any(_selects(spec["selector"], p) for p in pods), doc["metadata"]["name"]
        elif kind in ("PodDisruptionBudget", "NetworkPolicy"):
            selector = spec.get("selector", spec.get("podSelector"))["matchLabels"]
            assert any(_selects(selector, p) for p in pods), doc["metadata"]["name"]
    # no two Deployments claim each other's pods
    deployments = [d for _, d in DOCS if d["kind"] == "Deployment"]
    for a in deployments:
        for b in deployments:
            if a is not b:
                assert not _selects(
                    a["spec"]["selector"]["matchLabels"], b["spec"]["template"]["metadata"]["labels"]
                )


def test_the_cell_service_is_headless_and_its_ports_are_the_cells() -> None:
    service = find("Service", "batcher-cell")
    assert service["spec"]["clusterIP"] == "None"
    monitor = find("ServiceMonitor", "batcher-cell")
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    for name in ("batcher-cell", "batcher-cell-cpu"):
        (container,) = find("Deployment", name)["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        for p in service["spec"]["ports"]:
            assert named[p["targetPort"]] == p["port"]
        args = container["args"]
        assert args[args.index("--frontend") + 1].endswith(f":{named['frontend']}")
        assert args[args.index("--metrics-port") + 1] == str(named["metrics"])


def test_mounted_config_maps_and_secrets_have_the_keys_and_the_paths_are_mounted() -> None:
    config = find("ConfigMap", "batcher-config")["data"]
    secrets = {d["metadata"]["name"]: d["stringData"] for _, d in DOCS if d["kind"] == "Secret"}
    for _, doc in DOCS:
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            for m in container["volumeMounts"]:
                volume = volumes[m["name"]]
                if "configMap" in volume:
                    assert m.get("subPath") in config, m
                if "secret" in volume:
                    keys = secrets[volume["secret"]["secretName"]]
                    assert all(item["key"] in keys for item in volume["secret"].get("items", []))
            # every file a command line names is under one of the container's mounts
            paths = [a for a in container["args"] if a.startswith("/")]
            for probe in ("readinessProbe", "startupProbe"):
                paths += [
                    a
                    for a in container.get(probe, {}).get("exec", {}).get("command", [])
                    if a.startswith("/")
                ]
            for path in paths:
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts(container)), path
            # the cell reads the file it was given
            if "/etc/batcher/batcher.toml" in container["args"]:
                assert "/etc/batcher/batcher.toml" in mounts(container)


def test_the_scalers_target_the_cells_on_the_signal() -> None:
    scaled = find("ScaledObject", "batcher-cell")
    hpa = find("HorizontalPodAutoscaler", "batcher-cell")
    for ref in (scaled["spec"]["scaleTargetRef"], hpa["spec"]["scaleTargetRef"]):
        assert ref["kind"] == "Deployment" and find("Deployment", ref["name"])
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert query.startswith("sum(batcher_workers_needed{")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "batcher_workers_needed"
    # the threshold is the workers one GPU cell has: one per GPU it requests
    (container,) = find("Deployment", "batcher-cell")["spec"]["template"]["spec"]["containers"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert float(scaled["spec"]["triggers"][0]["metadata"]["threshold"]) == gpus
    assert float(metric["external"]["target"]["averageValue"]) == gpus


def test_probes_and_drain() -> None:
    (gateway,) = find("Deployment", "batcher-gateway")["spec"]["template"]["spec"]["containers"]
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    service = find("Service", "batcher-gateway")
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    for name in ("batcher-cell", "batcher-cell-cpu"):
        pod = find("Deployment", name)["spec"]["template"]["spec"]
        (cell,) = pod["containers"]
        assert cell["readinessProbe"]["exec"]["command"][:2] == ["batcher", "ready"]
        # the grace covers the broker's drain (its shutdown grace) and the workers' stop
        assert pod["terminationGracePeriodSeconds"] >= BrokerSettings().shutdown_grace_s + 10
    gpu = find("Deployment", "batcher-cell")["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] >= 1
    cpu = find("Deployment", "batcher-cell-cpu")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})


def test_the_config_map_holds_config_files_serve_accepts(tmp_path: Path) -> None:
    serve_options = {p.name for p in main.commands["serve"].params}
    for key, text in find("ConfigMap", "batcher-config")["data"].items():
        path = tmp_path / key
        path.write_text(text)
        config = load_config(str(path))
        assert set(config.options) <= serve_options, key
        assert 0 < config.options["target_utilization"] <= 1


# --- the command lines -----------------------------------------------------------------------


COMMANDS = dockerfile_commands() + manifest_commands()


def _needs_gateway(command: Command) -> Any:
    """The mark of a command that needs item 1: a strict xfail while the CLI lacks it, so
    the check runs (and must pass) once it is in."""
    return pytest.mark.xfail(
        uses_many_brokers(command) and not gateway_has_discover(),
        reason=GATEWAY_OVER_MANY,
        strict=True,
        raises=click.UsageError,
    )


@pytest.mark.parametrize("command", [pytest.param(c, marks=_needs_gateway(c)) for c in COMMANDS], ids=str)
def test_every_command_line_is_one_the_cli_accepts(command: Command) -> None:
    parse(command)


def test_the_commands_are_the_ones_each_part_should_run() -> None:
    assert {c.subcommand for c in COMMANDS} == {"serve", "ready", "gateway"}
    gateway = [c for c in COMMANDS if c.subcommand == "gateway"]
    assert gateway and all(uses_many_brokers(c) for c in gateway)
    for c in COMMANDS:
        if c.subcommand == "serve" and c.where != "Dockerfile CMD":
            # reachable by gateways on the pod's address; its workers over the pod's loopback
            argv = list(c.argv)
            assert argv[argv.index("--frontend") + 1].startswith("tcp://0.0.0.0:")
            assert argv[argv.index("--backend") + 1].startswith("tcp://127.0.0.1:")
            assert "--curve-clients" in argv and "--config" in argv


@pytest.mark.parametrize("sub", sorted({c.subcommand for c in COMMANDS}))
def test_help_of_each_command_used(sub: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "batcher", sub, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert f"batcher {sub} [OPTIONS]" in result.stdout.splitlines()[0]
    for command in COMMANDS:
        if command.subcommand == sub and not (uses_many_brokers(command) and not gateway_has_discover()):
            for flag in (a for a in command.argv if a.startswith("--")):
                assert flag in result.stdout, (flag, str(command))


@pytest.mark.xfail(not gateway_has_discover(), reason=GATEWAY_OVER_MANY, strict=True)
def test_the_gateways_help_shows_the_discovery_flags_the_manifest_uses() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "batcher", "gateway", "--help"], capture_output=True, text=True, timeout=60
    )
    (gateway,) = [c for c in COMMANDS if c.subcommand == "gateway"]
    for flag in (a for a in gateway.argv if a.startswith("--")):
        assert flag in result.stdout, flag


def test_every_variable_the_manifests_set_is_one_the_cli_reads() -> None:
    read = {
        env
        for cmd in main.commands.values()
        for p in cmd.params
        for env in ([p.envvar] if isinstance(p.envvar, str) else list(p.envvar or []))
    }
    for _, doc in DOCS:
        if doc["kind"] != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                if env["name"].startswith("BATCHER_"):
                    assert env["name"] in read, env


# --- the image ---------------------------------------------------------------------------------


def _readme_install() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- image-install -->") : readme.index("<!-- /image-install -->")]
    body = block[block.index("```sh") + 5 : block.rindex("```")]
    return [line.strip() for line in body.strip().splitlines()]


def test_the_dockerfile_installs_as_the_readme_says() -> None:
    args = dockerfile_args()
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    installs = [r for r in runs if "pip install" in r or "venv" in r]
    expanded = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], r) for r in installs]
    assert expanded == _readme_install()


def test_the_image_is_slim_multi_stage_non_root_and_labelled() -> None:
    instructions = dockerfile_instructions()
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert len(froms) == 2 and all("-slim" in f for f in froms)
    assert "AS build" in froms[0]
    assert any(word == "COPY" and rest.startswith("--from=build") for word, rest in instructions)
    (user,) = [rest for word, rest in instructions if word == "USER"]
    assert not user.startswith("0") and user != "root"
    labels = " ".join(rest for word, rest in instructions if word == "LABEL")
    for label in ("title", "description", "version", "licenses", "base.name"):
        assert f"org.opencontainers.image.{label}=" in labels
    assert "EXTRAS" in dockerfile_args()
    # the build context holds what the build stage copies, and no more
    ignore = (ROOT / ".dockerignore").read_text().split()
    copied = [rest.split()[0] for word, rest in instructions if word == "COPY" and not rest.startswith("--")]
    for path in copied:
        assert f"!{path}" in ignore or f"!{path}/" in ignore, path
    # the version in the labels is the package's
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and f'org.opencontainers.image.version="{version.group(1)}"' in labels
