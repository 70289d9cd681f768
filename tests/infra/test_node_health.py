"""A node's own health check: the checker's verdict file and the room left to stage a save."""

from __future__ import annotations

from pathlib import Path

from infra import node_health


def test_a_healthy_node_says_nothing(tmp_path: Path) -> None:
    assert node_health.failing(tmp_path, min_free_bytes=1) is None


def test_the_checkers_verdict_names_the_problem_until_repaired(tmp_path: Path) -> None:
    (tmp_path / node_health.FAILURE_FILE).write_text("uncorrectable ECC errors on GPU 3\n")
    reason = node_health.failing(tmp_path, min_free_bytes=1)
    assert reason is not None and reason.startswith(
        "health check failed: uncorrectable ECC errors on GPU 3 (from "
    )
    node_health.repaired(tmp_path)
    assert node_health.failing(tmp_path, min_free_bytes=1) is None


def test_a_full_disk_fails_the_check(tmp_path: Path) -> None:
    reason = node_health.failing(tmp_path, min_free_bytes=1 << 60)  # an exabyte: never free
    assert reason is not None and "GiB free under" in reason and "checkpoint" in reason
