"""Snapshot ids of local sources: what names them must never drift, or every snapshot rebuilds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dataprep.plan import SnapshotPlan, plan_snapshot
from dataprep.settings import SnapshotSettings

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
