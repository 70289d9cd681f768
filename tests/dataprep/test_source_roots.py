"""Local sources are read only inside the data roots, links resolved (issue 17, item 8)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataprep.errors import SourceError
from dataprep.plan import plan_snapshot
from dataprep.settings import SnapshotSettings
from dataprep.source_roots import DataRoots
from infra.settings import Settings, default_data_roots, load_settings


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "corpora"
    folder.mkdir()
    (folder / "plays.txt").write_text("To be, or not to be, that is the question.\n")
    return folder


def plan(sources: list[Path], *roots: Path) -> list[str]:
    roots_ = DataRoots.of([str(r) for r in roots])
    found = plan_snapshot([str(s) for s in sources], SnapshotSettings(), roots=roots_)
    return [f.path for chunk in found.chunks for f in chunk.files]


def test_a_link_out_of_the_roots_is_refused_by_name(root: Path) -> None:
    """Before: /proc/self/environ (the data worker's secrets) was planned, read and sharded."""
    (root / "env.txt").symlink_to("/proc/self/environ")
    with pytest.raises(SourceError) as raised:
        plan([root], root)
    message = str(raised.value)
    assert f"source {root}/env.txt is a link to /proc/" in message
    assert f"outside the data roots ({root})" in message and "FORGELINE_DATA_ROOTS" in message


def test_a_path_outside_every_root_is_refused(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("someone else's notes\n")
    with pytest.raises(SourceError, match=rf"source {elsewhere} is outside the data roots"):
        plan([elsewhere], root)
    with pytest.raises(SourceError, match="is outside the data roots"):
        plan([root / ".." / "elsewhere.txt"], root)  # '..' does not get out either


def test_links_that_stay_inside_the_roots_are_read(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "more"
    other.mkdir()
    (other / "sonnets.txt").write_text("Shall I compare thee to a summer's day?\n")
    (root / "sonnets.txt").symlink_to(other / "sonnets.txt")
    assert plan([root], root, other) == [str(root / "plays.txt"), str(root / "sonnets.txt")]
    assert plan([root]) == plan([root], root, other)  # no roots: nothing confined (in-process)


def test_the_data_roots_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    # Unset: the state folder's data/ only, never the home folder or /tmp (a shared host's keys,
    # anyone's files), and never no roots at all, which would confine nothing.
    assert default_data_roots(home) == [str(home / "data")]
    assert Settings(home=home).data_root_folders() == [str(home / "data"), str(home / "store")]
    assert Settings(home=home, store_url="s3://b/p").data_root_folders() == [str(home / "data")]
    monkeypatch.setenv("FORGELINE_DATA_ROOTS", os.pathsep.join(["/data/a", "/data/b"]))
    assert load_settings(home).data_root_folders() == ["/data/a", "/data/b", str(home / "store")]
