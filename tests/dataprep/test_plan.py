"""Snapshot ids of local sources: what names them must never drift, or every snapshot rebuilds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dataprep.plan import SnapshotPlan, plan_snapshot
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import load_plan, save_plan
from dataprep.stage_store import SnapshotKeys
from infra.errors import IntegrityError
from infra.store.local import LocalStore

# Computed before sources could be objects (s3://, store:), with the same files and settings.
PINNED_ID = "8ff667f89bbc97662cf4"


def _tree(root: Path) -> Path:
    root.mkdir()
    (root / "a.txt").write_text("alpha beta gamma\n\ndelta epsilon\n")
    (root / "b.jsonl").write_text('{"text": "one two three"}\n')
    (root / "c.py").write_text("print(1)\n")
    return root


def test_a_local_corpus_keeps_its_snapshot_id(tmp_path: Path) -> None:
    plan = plan_snapshot([str(_tree(tmp_path / "corpus"))], SnapshotSettings())
    assert plan.snapshot_id == PINNED_ID
    # Contents name it, not places: the same files elsewhere are the same snapshot.
    moved = shutil.copytree(tmp_path / "corpus", tmp_path / "elsewhere" / "corpus")
    assert plan_snapshot([str(moved)], SnapshotSettings()).snapshot_id == PINNED_ID


def test_a_plan_written_before_objects_existed_still_loads(tmp_path: Path) -> None:
    plan = plan_snapshot([str(_tree(tmp_path / "corpus"))], SnapshotSettings())
    raw = json.loads(plan.to_json())
    for chunk in raw["chunks"]:
        for planned in chunk["files"]:
            del planned["etag"], planned["options"]
    # (the identity compares as JSON: its tuples come back as lists)
    assert SnapshotPlan.from_json(json.dumps(raw).encode()).files == plan.files


def test_a_stored_plan_is_refused_unless_it_is_its_snapshots(tmp_path: Path) -> None:
    """Issue 44, finding 13: the stages read the sources a stored plan names, and load_plan
    took whatever was under the key. A plan whose files or settings no longer hash to its id
    is refused, naming the key; the plan as written loads."""
    store = LocalStore(tmp_path / "store")
    plan = plan_snapshot([str(_tree(tmp_path / "corpus"))], SnapshotSettings())
    save_plan(store, plan)
    assert load_plan(store, PINNED_ID).to_json() == plan.to_json()
    key = SnapshotKeys(PINNED_ID).plan
    raw = json.loads(plan.to_json())
    raw["chunks"][0]["files"][0]["sha256"] = "0" * 64  # another file's content
    store.put_bytes(key, json.dumps(raw).encode())
    with pytest.raises(IntegrityError, match=f"{key} is not the plan of snapshot {PINNED_ID}"):
        load_plan(store, PINNED_ID)
    other = plan_snapshot([str(tmp_path / "corpus" / "a.txt")], SnapshotSettings())
    store.put_bytes(key, other.to_json())  # a real plan, of another snapshot
    with pytest.raises(IntegrityError, match=f"{key} is not the plan of snapshot {PINNED_ID}"):
        load_plan(store, PINNED_ID)


def test_a_plan_is_saved_once_and_never_written_over(tmp_path: Path) -> None:
    """save_plan wrote over the plan the stages had begun from. Now the same plan again (a
    retried activity) is fine, and a different one of the same snapshot (the same files from
    other paths) is refused, naming the key, and the first plan stays."""
    store = LocalStore(tmp_path / "store")
    plan = plan_snapshot([str(_tree(tmp_path / "corpus"))], SnapshotSettings())
    save_plan(store, plan)
    save_plan(store, plan)
    moved = shutil.copytree(tmp_path / "corpus", tmp_path / "elsewhere")
    elsewhere = plan_snapshot([str(moved)], SnapshotSettings())
    assert elsewhere.snapshot_id == PINNED_ID
    key = SnapshotKeys(PINNED_ID).plan
    with pytest.raises(IntegrityError, match=f"{key} holds another plan of snapshot {PINNED_ID}"):
        save_plan(store, elsewhere)
    assert load_plan(store, PINNED_ID).to_json() == plan.to_json()
