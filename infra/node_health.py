"""A node's own health check, run by its agent every second while it trains.

A node can be sick without being dead: its disk fills up (the next checkpoint cannot be staged),
or the site's hardware checker (DCGM diagnostics, ECC counters, a failing fan) flags it. The
checker speaks through a file: it writes the reason to `<node folder>/HEALTH_CHECK_FAILS`;
`forgeline chaos fail-health NODE` does the same by hand. The agent then fails its training
attempt with the reason, the run reports the node (it is drained until its agent is restarted,
which is how a repaired node comes back) and continues on another.
"""

from __future__ import annotations

import os
from pathlib import Path

FAILURE_FILE = "HEALTH_CHECK_FAILS"
MIN_FREE_BYTES = 1 << 30  # room to stage at least a small checkpoint


def failing(node_dir: Path, min_free_bytes: int = MIN_FREE_BYTES) -> str | None:
    """Why this node is unhealthy, or None."""
    marker = node_dir / FAILURE_FILE
    try:
        reason = marker.read_text().strip()
    except OSError:
        reason = None
    if reason is not None:
        return f"health check failed: {reason or 'no reason given'} (from {marker})"
    free = _free_bytes(node_dir)
    if free is not None and free < min_free_bytes:
        return (
            f"health check failed: {free / 2**30:.2f} GiB free under {node_dir}, less than the "
            f"{min_free_bytes / 2**30:.2f} GiB a checkpoint needs to be staged"
        )
    return None


def _free_bytes(folder: Path) -> int | None:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def fail(node_dir: Path, reason: str) -> None:
    """Fail the node's check from now on, saying why, until it is repaired: what a hardware
    checker does, and what the agent does when its ranks' device says it is broken."""
    (node_dir / FAILURE_FILE).write_text(reason.replace("\n", " ") + "\n")


def repaired(node_dir: Path) -> None:
    """A new incarnation of the agent starts on a repaired node: the old verdict goes."""
    (node_dir / FAILURE_FILE).unlink(missing_ok=True)
