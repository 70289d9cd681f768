"""The checkpoint manifest as a typed format: a manifest written before it was typed still loads
whole, and one this build cannot read is refused with the key and the field that is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra.digest import sha256_bytes
from infra.store.local import LocalStore
from infra.stored_format import StoredFormatError
from trainer.checkpoint_manifest import (
    PEER_FORMAT,
    CheckpointFile,
    CheckpointManifest,
    PeerManifest,
)
from trainer.manifest import find_latest, manifest_key

# Written by a real two-rank DDP run of the local stack (generation 2, step 400) with the code
# before the manifest was typed: the files people already have.
STORED = Path(__file__).parent / "stored" / "checkpoint-manifest-v1.json"
KEY = "runs/hc-bars/checkpoints/step-400/gen-2/MANIFEST.json"


def stored() -> dict[str, Any]:
    return json.loads(STORED.read_text())


def test_a_manifest_written_before_the_types_loads_whole() -> None:
    manifest = CheckpointManifest.parse(STORED.read_bytes(), KEY)
    assert (manifest.step, manifest.generation, manifest.world_size) == (400, 2, 2)
    assert manifest.layout["strategy"] == "ddp" and manifest.tokens_seen == 409_600
    assert manifest.network["n_layer"] == stored()["model_config"]["n_layer"]
    assert manifest.loss_history[-1][0] == 400 and isinstance(manifest.loss_history[-1][1], float)
    assert {f.name for f in manifest.files} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert all(f.key.startswith("runs/hc-bars/checkpoints/step-400/gen-2/") for f in manifest.files)
    # Written back, it says exactly what it said: nothing is lost or renamed on the way.
    assert json.loads(manifest.dump_bytes()) == stored()


def test_a_field_a_newer_build_added_survives_a_read_and_a_write() -> None:
    newer = {**stored(), "fabric": {"nvlink": True}}
    manifest = CheckpointManifest.parse(newer, KEY)
    assert json.loads(manifest.dump_bytes())["fabric"] == {"nvlink": True}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda m: m.update(format="forgeline.checkpoint/9"), "'forgeline.checkpoint/9'"),
        (lambda m: m.pop("format"), "format None"),
        (lambda m: m.pop("step"), "field 'step': field required"),
        (lambda m: m["files"][1].pop("sha256"), "field 'files.1.sha256': field required"),
        (lambda m: m["files"][0].update(bytes="many"), "field 'files.0.bytes'"),
        (lambda m: m.update(generation=[2]), "field 'generation'"),
    ],
)
def test_a_manifest_this_build_cannot_read_is_refused_naming_the_key_and_field(
    change: Any, named: str
) -> None:
    broken = stored()
    change(broken)
    with pytest.raises(StoredFormatError) as refused:
        CheckpointManifest.parse(json.dumps(broken).encode(), KEY)
    assert str(refused.value).startswith(KEY) and named in str(refused.value)


def test_bytes_that_are_not_a_json_object_are_refused() -> None:
    for raw in (b"\x00\x01 torn", b"[1, 2]"):
        with pytest.raises(StoredFormatError, match="not a readable checkpoint manifest"):
            CheckpointManifest.parse(raw, KEY)


def test_resume_passes_over_a_manifest_of_an_unknown_format_for_the_one_before(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path)
    for step, format in ((20, None), (40, "forgeline.checkpoint/9")):
        data = f"step {step}".encode()
        key = manifest_key("r", step, 1).replace("MANIFEST.json", "__0_0.distcp")
        store.put_bytes(key, data)
        file = CheckpointFile(
            name="__0_0.distcp", key=key, bytes=len(data), sha256=sha256_bytes(data)
        )
        body = CheckpointManifest(run_id="r", step=step, generation=1, files=[file]).dump()
        if format:
            body["format"] = format
        store.put_if_absent(manifest_key("r", step, 1), json.dumps(body).encode())
    skipped: list[str] = []
    found = find_latest(store, "r", max_generation=1, on_skip=skipped.append)
    assert found is not None and found.step == 20
    assert len(skipped) == 1 and "forgeline.checkpoint/9" in skipped[0], skipped


def test_a_peer_manifest_is_its_own_format() -> None:
    peer = CheckpointManifest.parse(stored(), KEY).as_peer()
    body = peer.dump()
    assert (body["format"], body["tier"]) == (PEER_FORMAT, "peer")
    assert PeerManifest.parse(body, KEY).step == 400
    with pytest.raises(StoredFormatError, match="peer-checkpoint"):
        CheckpointManifest.parse(body, KEY)
