"""The twin site from the command line: `forgeline replication` and the replicator process.

`forgeline up` starts the replicator when `twin_store_url` (FORGELINE_TWIN_STORE) is set: a
loop of `infra.replication.Replicator` passes, one every `--interval` seconds. It keeps going
while the primary is down (the status says so) and picks up where it was when it comes back.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table

from infra.errors import StoreError
from infra.replication import ReplicationStatus, Replicator
from infra.settings import Settings
from infra.store.factory import open_store
from worker.cli_common import CliError, ExitCode, console, get_settings

commands = typer.Typer()


def _stores(settings: Settings):  # -> tuple[ObjectStore, ObjectStore]
    if not settings.twin_store_url:
        raise CliError(
            "no twin site is set: set FORGELINE_TWIN_STORE (e.g. "
            "s3://bucket/prefix?endpoint=URL) before `forgeline up`"
        )
    return open_store(settings.store), open_store(settings.twin_store_url)


def run_replicator(settings: Settings, interval_s: float) -> None:
    primary, twin = _stores(settings)
    replicator = Replicator(primary, twin, settings.home / "replication")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    logging.info("replicating %s to %s every %.1f s", primary.url, twin.url, interval_s)
    while not stop.is_set():
        try:
            status = replicator.run_once()
            for entry in status.recent[:1]:
                logging.debug("latest %s lag %.1f s", entry.manifest_key, entry.lag_s)
            if status.error:
                logging.warning("replication: %s", status.error)
        except StoreError as err:  # the twin itself is down: try again next time
            logging.warning("replication pass failed: %s", err)
        stop.wait(interval_s)


@commands.command()
def replication(
    runs: Annotated[int, typer.Option(help="how many recent copies to list")] = 10,
) -> None:
    """Where the twin site stands: the last copies and their lag, what is still pending."""
    settings = get_settings()
    _, twin = _stores(settings)
    try:
        status = ReplicationStatus.read(twin)
    except StoreError as err:
        raise CliError(f"cannot read the twin site: {err}", ExitCode.DOWN) from None
    if status is None:
        raise CliError(
            f"{twin.url} has no replication status yet: is the replicator running "
            "(`forgeline up` starts it when FORGELINE_TWIN_STORE is set)?"
        )
    console.print(_summary(status), markup=False)
    table = Table(title="Latest copies to the twin")
    for name in ("manifest", "committed", "lag", "objects", "bytes"):
        table.add_column(name, justify="left" if name == "manifest" else "right")
    for entry in status.recent[:runs]:
        table.add_row(
            entry.manifest_key,
            entry.committed_at[11:19],
            f"{entry.lag_s:.1f} s",
            f"{entry.objects:,}",
            f"{entry.bytes:,}",
        )
    console.print(table)


def _summary(status: ReplicationStatus) -> str:
    age = (datetime.now(UTC) - datetime.fromisoformat(status.updated_at)).total_seconds()
    lines = [
        f"primary   {status.primary}"
        + ("" if status.primary_reachable else "  (UNREACHABLE: reads come from the twin)"),
        f"twin      {status.twin}",
        f"updated   {age:.0f} s ago",
        f"lag       {status.recent[0].lag_s:.1f} s for the latest copy, "
        f"{status.max_lag_s:.1f} s at most"
        if status.recent
        else "lag       nothing copied yet",
        f"pending   {len(status.pending)} committed unit(s) not yet on the twin",
    ]
    if status.error:
        lines.append(f"error     {status.error}")
    return "\n".join(lines)
