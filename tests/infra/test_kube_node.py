"""The agents' init container: a node's label from the API server, as the agent's --pod."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from infra.kube_node import main
from tests.http_server import serving

LABEL = "topology.kubernetes.io/zone"
NODES = {
    "gpu-a": {LABEL: "EU-West-1a", "example.com/block": "B7", "example.com/rack": "r12"},
    "gpu-b": {},
}


class FakeApiServer(BaseHTTPRequestHandler):
    """GET /api/v1/nodes/NAME as the API server answers it, for a bearer token only."""

    def do_GET(self) -> None:
        name = self.path.removeprefix("/api/v1/nodes/")
        if self.headers.get("Authorization") != "Bearer sa-token":
            self.send_response(403)
        elif name not in NODES:
            self.send_response(404)
        else:
            body = json.dumps({"kind": "Node", "metadata": {"name": name, "labels": NODES[name]}})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())
            return
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    with serving(FakeApiServer) as url:
        yield url


def account(tmp_path: Path, token: str = "sa-token") -> Path:
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    (folder / "token").write_text(f"{token}\n")  # mounted tokens end in a newline
    return folder


def label_of(
    node: str, api: str, tmp_path: Path, folder: Path, more: list[str] = ()
) -> tuple[int, Path]:
    out = tmp_path / "run" / "pod"
    argv = ["--label", LABEL, "--out", str(out), "--node", node, "--api", api,
            "--service-account", str(folder), *more]  # fmt: skip
    return main(argv), out


def test_the_node_s_label_becomes_a_valid_pod_name(api: str, tmp_path: Path) -> None:
    code, out = label_of("gpu-a", api, tmp_path, account(tmp_path))
    assert code == 0
    assert out.read_text() == "eu-west-1a"  # lowercase, as Forgeline's names are


def test_the_node_s_level_labels_become_the_agent_s_topology(api: str, tmp_path: Path) -> None:
    placed = tmp_path / "run" / "topology"
    levels = ["--levels", "block=example.com/block, rack=example.com/rack",
              "--topology-out", str(placed)]  # fmt: skip
    folder = account(tmp_path)
    code, _ = label_of("gpu-a", api, tmp_path, folder, levels)
    assert code == 0 and placed.read_text() == "block=b7,rack=r12"
    # No levels (the settings' default): an empty file, which the agent reads as no topology.
    code, _ = label_of("gpu-a", api, tmp_path, folder, ["--levels", "", "--topology-out",
                       str(placed)])  # fmt: skip
    assert code == 0 and placed.read_text() == ""


def test_a_level_label_the_node_lacks_is_named(api: str, tmp_path: Path, capsys) -> None:
    levels = ["--levels", "rack=example.com/row", "--topology-out", str(tmp_path / "t")]
    code, _ = label_of("gpu-a", api, tmp_path, account(tmp_path), levels)
    assert code == 1 and "node gpu-a has no label example.com/row" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("node", "token", "says"),
    [
        ("gpu-b", "sa-token", f"node gpu-b has no label {LABEL}: label it (kubectl label node"),
        ("gpu-a", "wrong", "answered 403 (the service account needs `get` on nodes)"),
        ("gpu-z", "sa-token", "node gpu-z: the API server answered 404"),
    ],
)
def test_what_it_cannot_read_it_names(
    api: str, tmp_path: Path, capsys, node: str, token: str, says: str
) -> None:
    code, out = label_of(node, api, tmp_path, account(tmp_path, token))
    assert code == 1 and not out.exists()
    assert says in capsys.readouterr().err
