"""A user's code folder as a content-addressed snapshot: what goes in, what is refused, and
that a node never gets a file whose hash does not match."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra import code_snapshot
from infra.code_snapshot import CodeSnapshotError, collect, fetch, publish
from infra.errors import IntegrityError
from infra.requirements import unmet
from infra.store.local import LocalStore


def make_code(root: Path) -> Path:
    code = root / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "train.py").write_text("import pkg.model\n")
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "model.py").write_text("WIDTH = 8\n")
    (code / ".gitignore").write_text("*.ckpt\nscratch/\n")
    (code / "old.ckpt").write_bytes(b"\0" * 100)
    (code / "scratch").mkdir()
    (code / "scratch" / "notes.py").write_text("x = 1\n")
    (code / "pkg" / ".gitignore").write_text("local.py\n")  # nested: speaks of pkg/ only
    (code / "pkg" / "local.py").write_text("SECRET = 1\n")
    (code / "pkg" / "__pycache__").mkdir()
    (code / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    return code


def test_gitignored_and_compiled_files_stay_out(tmp_path: Path) -> None:
    paths = [f.path for f in collect(make_code(tmp_path))]
    assert paths == [".gitignore", "pkg/.gitignore", "pkg/__init__.py", "pkg/model.py", "train.py"]


def test_the_same_code_is_the_same_snapshot_and_a_change_is_another(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    code = make_code(tmp_path)
    first = publish(store, code)
    again = publish(store, code)
    assert (again.snapshot_id, again.reused, first.reused) == (first.snapshot_id, True, False)
    (code / "old.ckpt").write_bytes(b"changed")  # ignored: still the same snapshot
    assert publish(store, code).snapshot_id == first.snapshot_id
    (code / "pkg" / "model.py").write_text("WIDTH = 16\n")
    assert publish(store, code).snapshot_id != first.snapshot_id


def test_an_oversized_file_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    code = make_code(tmp_path)
    monkeypatch.setattr(code_snapshot, "MAX_FILE_BYTES", 1000)
    (code / "weights.bin").write_bytes(b"\0" * 2000)
    with pytest.raises(CodeSnapshotError, match=r"weights\.bin: .* list the file in \.gitignore"):
        collect(code)


def test_a_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    code = make_code(tmp_path)
    (tmp_path / "elsewhere.py").write_text("")
    (code / "linked.py").symlink_to(tmp_path / "elsewhere.py")
    with pytest.raises(CodeSnapshotError, match=r"linked\.py: a link to .* outside the code"):
        collect(code)


def test_a_node_gets_exactly_the_files_and_refuses_tampering(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    published = publish(store, make_code(tmp_path))
    dest = fetch(store, published.snapshot_id, published.manifest_sha256, tmp_path / "node")
    assert (dest / "pkg" / "model.py").read_text() == "WIDTH = 8\n"
    assert not (dest / "old.ckpt").exists()

    # A file changed in the node's cache is fetched again, never trusted.
    (dest / "pkg" / "model.py").write_text("import os; os.system('evil')\n")
    fetch(store, published.snapshot_id, published.manifest_sha256, dest)
    assert (dest / "pkg" / "model.py").read_text() == "WIDTH = 8\n"

    # A file changed in the store is refused.
    blob = next((store.root / "code" / published.snapshot_id / "files").iterdir())
    blob.write_bytes(b"print('not what was submitted')\n")
    with pytest.raises(IntegrityError, match="is corrupt"):
        fetch(store, published.snapshot_id, published.manifest_sha256, tmp_path / "node2")


def test_a_run_gets_its_own_copy_and_nothing_planted_reaches_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    published = publish(store, make_code(tmp_path))
    snapshot, sha = published.snapshot_id, published.manifest_sha256
    cached = fetch(store, snapshot, sha, tmp_path / "cache")
    files = code_snapshot.manifest_files(store, snapshot, sha)
    # A run that could write to the shared cache planted a module and changed another.
    (cached / "tqdm.py").write_text("import os  # planted\n")
    (cached / "pkg" / "model.py").write_text("WIDTH = 9\n")

    mine = code_snapshot.materialize(store, snapshot, files, cached, tmp_path / "run-b" / "code")
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*.py")) == [
        "pkg/__init__.py", "pkg/model.py", "train.py"
    ]  # fmt: skip
    assert (mine / "pkg" / "model.py").read_text() == "WIDTH = 8\n"  # from the store

    # Its own copy, written into by the run before (unconfined): made again, exactly.
    (mine / "tqdm.py").write_text("import os  # planted\n")
    code_snapshot.materialize(store, snapshot, files, cached, mine)
    assert not (mine / "tqdm.py").exists()


def test_a_manifest_that_is_not_the_runs_or_escapes_the_folder_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    published = publish(store, make_code(tmp_path))
    key = published.manifest_key
    with pytest.raises(IntegrityError, match="not the code this run was submitted with"):
        fetch(store, published.snapshot_id, "0" * 64, tmp_path / "node")
    body = json.loads(store.get_bytes(key))
    body["files"][0]["path"] = "../../outside.py"
    crafted = json.dumps(body).encode()
    store.put_bytes(key, crafted)
    import hashlib

    with pytest.raises(IntegrityError, match="leaves the code folder"):
        fetch(store, published.snapshot_id, hashlib.sha256(crafted).hexdigest(), tmp_path / "n")


def test_requirements_are_checked_against_this_environment(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text(
        "# comment\ntorch>=2.0\n"
        "surely-not-a-package-forgeline>=1\n"
        "pytest<1.0\n"
        "-r other.txt\n"
        "numpy; python_version < '3.0'\n"  # a marker that does not apply here
        "not a requirement!!\n"
    )
    problems = unmet(tmp_path)
    assert problems[0] == "surely-not-a-package-forgeline>=1 is not installed"
    assert problems[1].startswith("pytest<1.0 is wanted but pytest ")
    assert problems[2].startswith("requirements.txt line 7: 'not a requirement!!'")
    assert len(problems) == 3
    assert unmet(tmp_path / "nowhere") == []
