"""A spec naming a container image (`train.image`) is refused before its run starts where it
could not run: a reference podman would not take, a cluster with no node that runs containers,
code that declares packages of its own beside the image."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from infra import code_snapshot
from infra.settings import Settings
from worker.api_code import CodeRefused, check_code
from worker.runs import cluster_lacks
from workflows.contracts.cluster_models import ClusterState, Node, NodeInfo
from workflows.contracts.models import CodeRef
from workflows.contracts.spec import RunSpec

IMAGE = "registry.lab:5000/team/trainer:2026-11@sha256:" + "ab" * 32


def spec(image: str | None, code: str | None = None) -> RunSpec:
    train: dict[str, object] = {"image": image}
    if code is not None:
        train |= {"code": code, "entrypoint": "train.py", "checkpoints": "folder"}
    return RunSpec.model_validate({"name": "imaged", "data": {"sources": ["x"]}, "train": train})


def cluster(*runtimes: str) -> ClusterState:
    nodes = [Node(info=NodeInfo(node_id=f"n{i}", rdzv_port=29400 + i, incarnation=str(i),
                                container_runtime=runtime))
             for i, runtime in enumerate(runtimes)]  # fmt: skip
    return ClusterState(nodes=nodes)


@pytest.mark.parametrize(
    "image", [IMAGE, "trainer", "localhost/forgeline-test/torch:py3.11-2.13.0-cpu"]
)
def test_image_references_podman_takes_are_accepted(image: str) -> None:
    assert spec(image).train.image == image


@pytest.mark.parametrize("image", ["", "Trainer:1", "trainer:1; rm -rf /", "a b", "--privileged",
                                   "trainer@sha256:short"])  # fmt: skip
def test_anything_else_is_refused_by_its_field(image: str) -> None:
    with pytest.raises(ValidationError, match=r"train\.image"):
        spec(image)


def test_a_cluster_with_no_container_runtime_refuses_an_image_and_says_what_would_fix_it() -> None:
    lack = cluster_lacks(spec(IMAGE), cluster("", ""))
    assert lack is not None and lack.field == "train.image"
    assert "no node of this cluster has one" in str(lack) and "install podman" in str(lack)
    assert cluster_lacks(spec(IMAGE), cluster("", "podman 4.3.1")) is None
    assert cluster_lacks(spec(None), cluster("", "")) is None
    assert cluster_lacks(spec(IMAGE), cluster()) is None  # no node registered yet: not judged


def _published(tmp_path: Path, files: dict[str, str]) -> tuple[Settings, CodeRef]:
    folder = tmp_path / "code"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    settings = Settings(home=tmp_path / "home")
    published = code_snapshot.publish(settings.open_store(), folder)
    return settings, CodeRef.model_validate(published, from_attributes=True)


def test_code_that_declares_its_own_packages_is_refused_beside_an_image(tmp_path: Path) -> None:
    settings, ref = _published(tmp_path, {"train.py": "print()\n", "requirements.txt": "rich\n"})
    store = settings.open_store()
    with pytest.raises(CodeRefused, match=r"requirements\.txt") as refused:
        check_code(store, spec(IMAGE, code="code"), ref)
    assert "put them in the image" in refused.value.fix
    check_code(store, spec(None, code="code"), ref)  # without the image: its environment
