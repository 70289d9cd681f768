"""infra/deploy/kubernetes: every manifest against the Kubernetes API's JSON schemas (strict:
an unknown or misspelt field fails), and what no schema knows: the commands the containers run
exist in the CLI, the settings are ones Forgeline reads, the agents' DaemonSet reads its node's
fabric island and address the way it says."""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from infra.settings import load_settings
from tests.conftest import REPO
from tests.forgeline_argv import check_forgeline_argv

KUBERNETES = REPO / "infra" / "deploy" / "kubernetes"
# The oldest release the manifests are meant for (status.podIP, sidecar-free init containers
# and ClusterFirstWithHostNet are far older) and the newest whose schemas the package bundles.
VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
# Read by the agents' init container, not by Forgeline's settings.
MANIFEST_ONLY_KEYS = {"FORGELINE_POD_LABEL"}


def documents() -> list[tuple[str, dict]]:
    found = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


DOCUMENTS = documents()
BY_KIND = {doc["kind"]: doc for _, doc in DOCUMENTS if doc["kind"] in ("ConfigMap", "DaemonSet")}


def workloads() -> list[dict]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] in ("DaemonSet", "Deployment")]


def forgeline_argv(container: dict) -> list[str]:
    """What the container runs after `forgeline`: the image's entrypoint with `args`, or the
    `forgeline` that a `sh -c` script execs."""
    if "command" not in container:
        return list(container["args"])
    assert container["command"] == ["sh", "-c"], container["name"]
    words = shlex.split(container["args"][0])
    assert words[:2] == ["exec", "forgeline"], words
    return words[2:]


def test_the_files_hold_what_the_issue_asks_for() -> None:
    kinds = sorted(doc["kind"] for _, doc in DOCUMENTS)
    assert kinds.count("Deployment") == 3 and "DaemonSet" in kinds and "ConfigMap" in kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_every_manifest_is_valid_against_the_kubernetes_schemas(
    name: str, doc: dict, version: str
) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_every_container_runs_a_forgeline_command_that_exists() -> None:
    ran = set()
    for workload in workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            argv = forgeline_argv(container)
            check_forgeline_argv(argv)
            ran.add(" ".join(word for word in argv if not word.startswith(("-", "$"))))
    assert ran == {"agent", "control", "data worker", "api"}, ran


def test_the_settings_are_ones_forgeline_reads(monkeypatch, tmp_path: Path) -> None:
    """Each key of the ConfigMap, set as the pods set it, lands in a field of the settings."""
    data = BY_KIND["ConfigMap"]["data"]
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    fields = dataclasses.asdict(load_settings(tmp_path))
    values = {str(v).lower() for v in fields.values()}
    unread = [k for k, v in data.items() if k not in MANIFEST_ONLY_KEYS and v.lower() not in values]
    assert unread == []
    # Every workload takes them all, and the Secret of credentials, optional.
    for workload in workloads():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            refs = container["envFrom"]
            assert {"configMapRef": {"name": "forgeline-settings"}} in refs
            assert {"secretRef": {"name": "forgeline-secrets", "optional": True}} in refs


def test_the_api_keeps_its_tokens_on_a_volume_that_outlives_the_pod() -> None:
    """tokens.json and the idempotency keys live in the API's state folder: on an emptyDir
    every restart would lock everyone out."""
    (api,) = [w for w in workloads() if w["metadata"]["name"] == "forgeline-api"]
    spec = api["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    home = next(e["value"] for e in container["env"] if e["name"] == "FORGELINE_HOME")
    mounted = next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == home)
    volume = next(v for v in spec["volumes"] if v["name"] == mounted)
    claims = {d["metadata"]["name"] for _, d in DOCUMENTS if d["kind"] == "PersistentVolumeClaim"}
    assert volume["persistentVolumeClaim"]["claimName"] in claims
    assert api["spec"]["replicas"] == 1 and api["spec"]["strategy"]["type"] == "Recreate"
    port = container["ports"][0]["containerPort"]
    assert f"--port={port}" in forgeline_argv(container)
    services = [d for _, d in DOCUMENTS if d["kind"] == "Service"]
    assert any(p["targetPort"] == "http" for s in services for p in s["spec"]["ports"])


def test_the_agents_get_the_node_s_island_address_and_gpus() -> None:
    spec = BY_KIND["DaemonSet"]["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True  # NCCL and rendezvous host to host
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    (agent,) = spec["containers"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "nvidia.com/gpu" in agent["resources"]["limits"]
    argv = forgeline_argv(agent)
    assert argv[argv.index("--advertise-address") + 1] == "$POD_IP"
    # --pod is the file the init container writes from the node's label.
    (label_reader,) = [c for c in spec["initContainers"] if "infra.kube_node" in c["command"]]
    out = label_reader["command"][label_reader["command"].index("--out") + 1]
    assert argv[argv.index("--pod") + 1] == f"$$(cat {out})"
    command = label_reader["command"]
    placed = command[command.index("--topology-out") + 1]
    assert argv[argv.index("--topology") + 1] == f"$$(cat {placed})"
    assert command[command.index("--levels") + 1] == "$(FORGELINE_TOPOLOGY_LABELS)"
    assert "FORGELINE_TOPOLOGY_LABELS" in BY_KIND["ConfigMap"]["data"]
    assert importlib.util.find_spec("infra.kube_node") is not None
    assert "FORGELINE_POD_LABEL" in BY_KIND["ConfigMap"]["data"]
