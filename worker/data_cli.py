"""`forgeline data prepare SPEC` and `forgeline data report SNAPSHOT`."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from infra.extras import require_extra
from infra.settings import Settings
from worker.cli_common import CliError, console, get_client, get_settings
from worker.cli_common import run as run_async
from worker.hosts_cli import data_worker
from worker.live_progress import LiveProgress
from worker.render import stage_bars
from worker.runs import dataset_progress
from worker.specfile import SpecError, load_spec
from workflows.contracts.models import DatasetInput, DatasetProgress, DatasetRef
from workflows.contracts.names import (
    CONTROL_TASK_QUEUE,
    InvalidName,
    check_snapshot_id,
    standalone_dataset_workflow_id,
)
from workflows.contracts.spec import DataSpec

data_app = typer.Typer(help="Prepare dataset snapshots and read their reports.")

commands = typer.Typer()
commands.add_typer(data_app, name="data")
# The data worker is a host's process (worker.hosts_cli), started as `forgeline data worker`.
data_app.command("worker")(data_worker)


class DataCliError(Exception):
    pass


def standalone_workflow_id(data: DataSpec) -> str:
    """The same [data] table always names the same workflow: preparing twice attaches."""
    digest = hashlib.sha256(json.dumps(data.model_dump(), sort_keys=True).encode()).hexdigest()
    return standalone_dataset_workflow_id(digest)


async def prepare(client: Client, data: DataSpec, console: Console) -> DatasetRef:
    # The data workers do the work, but the report shown after it needs DuckDB here: say so
    # before the work starts, not after it ends.
    require_extra("data", "forgeline data prepare (its report)")
    workflow_id = standalone_workflow_id(data)
    handle = await client.start_workflow(
        "DatasetSnapshot",
        DatasetInput(data=data, requested_by="forgeline data prepare"),
        id=workflow_id,
        task_queue=CONTROL_TASK_QUEUE,
        result_type=DatasetRef,
        # Running: attach to it. Finished: run again (it finds the snapshot and returns it).
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
    )
    console.print(f"dataset workflow {workflow_id}")
    if console.is_terminal:  # bars with rates and ETAs; a line per change in a log
        with LiveProgress(console) as live:
            await _watch(
                client, handle, workflow_id, lambda p: live.stages(p) if p is not None else None
            )
    else:
        await _watch(client, handle, workflow_id, _line_per_change(console))
    try:
        return await handle.result()
    except WorkflowFailureError as err:
        cause = err.cause
        while getattr(cause, "cause", None) is not None:
            cause = cause.cause
        raise DataCliError(f"data preparation failed: {cause}") from None


async def _watch(
    client: Client,
    handle: WorkflowHandle,
    workflow_id: str,
    show: Callable[[DatasetProgress | None], object],
) -> None:
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        show(await dataset_progress(client, workflow_id))
        await asyncio.sleep(1.0)


def _line_per_change(console: Console) -> Callable[[DatasetProgress | None], None]:
    last = ""

    def show(progress: DatasetProgress | None) -> None:
        nonlocal last
        line = stage_bars(progress) if progress else "starting"
        if line != last:
            console.print(f"{time.strftime('%H:%M:%S')}  {line}")
            last = line

    return show


def load_report(settings: Settings, snapshot_id: str) -> dict:
    """The snapshot's report, recomputed with DuckDB over its per-document table."""
    require_extra("data", "a dataset report")
    # Imported here: dataprep loads DuckDB, pyarrow and datasketch (forgeline[data]), which a
    # GPU host's install lacks, and every `forgeline` command imports this module.
    from dataprep.near_dedup import connect
    from dataprep.report import summarize
    from dataprep.snapshot import existing_snapshot

    store = settings.open_store()
    snapshot = existing_snapshot(store, snapshot_id)
    if snapshot is None:
        raise DataCliError(
            f"no snapshot {snapshot_id!r} in {store.url}: see `forgeline data prepare SPEC`"
        )
    report = snapshot.manifest.report
    saved = json.loads(store.get_bytes(report["summary"].key))
    with tempfile.TemporaryDirectory(prefix="forgeline-report-") as tmp:
        table = Path(tmp) / "documents.parquet"
        store.get_file(report["documents"].key, table)
        con = connect("512MB", Path(tmp) / "spill")
        return {**saved, **summarize(con, table), "manifest_key": snapshot.manifest_key}


def render_report(report: dict, console: Console) -> None:
    docs = report["documents"]
    console.print(
        f"snapshot {report['snapshot_id']}: {docs['read']:,} documents read "
        f"({docs['bad_records']:,} bad records), {docs['filtered']:,} filtered, "
        f"{docs['exact_duplicates']:,} exact and {docs['near_duplicates']:,} near duplicates"
    )
    for title, rows in (
        ("documents per source", report["by_source"]),
        ("removed by filter", report["by_filter"]),
        ("removed by dedup", report["by_dedup"]),
        ("kept, per split", report["by_split"]),
        ("by kind and language", report["by_kind"]),
    ):
        if not rows:
            continue
        table = Table(title=title)
        for column in rows[0]:
            table.add_column(column, justify="left" if column in ("source", "filter") else "right")
        for row in rows:
            table.add_row(*(_cell(k, v) for k, v in row.items()))
        console.print(table)
    if report.get("bad_records", {}).get("by_reason"):
        console.print(f"bad records: {report['bad_records']['by_reason']}")
    for example in report.get("dedup_examples", [])[:3]:
        console.print(
            f"near duplicate (Jaccard {example['jaccard']}): doc {example['removed']['doc_id']} "
            f"of {example['removed']['source']} ~ doc {example['kept']['doc_id']} of "
            f"{example['kept']['source']}"
        )


def _cell(column: str, value: object) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    if column == "source":  # relative to here when it can be: shorter, and still exact
        path = Path(str(value))
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)
    return str(value)


def write_report(report: dict, out: Path) -> Path:
    out.write_text(json.dumps(report, indent=2, default=str))
    return out


def data_summary(ref: DatasetRef) -> str:
    return (
        f"snapshot {ref.snapshot_id}{' (reused)' if ref.reused else ''}: {ref.documents:,} "
        f"documents read, {ref.filtered:,} filtered, {ref.duplicates_removed:,} duplicates "
        f"removed; train {ref.train_tokens:,} / val {ref.val_tokens:,} tokens, vocab "
        f"{ref.vocab_size:,}"
    )


@data_app.command("prepare")
def data_prepare(
    spec_file: Annotated[Path, typer.Argument(help="run spec (TOML); only [data] is used")],
) -> None:
    """Prepare the spec's dataset snapshot on the data workers (or find it), then report it."""
    try:
        spec = load_spec(spec_file)
    except SpecError as err:
        raise CliError(f"{spec_file}: {err}") from None
    settings = get_settings()

    async def go():
        return await prepare(await get_client(settings), spec.data, console)

    dataset = run_async(go())
    console.print(data_summary(dataset))
    render_report(load_report(settings, dataset.snapshot_id), console)


@data_app.command("report")
def data_report(
    snapshot: Annotated[str, typer.Argument(help="snapshot id (see `forgeline status RUN`)")],
    out: Annotated[Path | None, typer.Option(help="default: report-SNAPSHOT.json")] = None,
) -> None:
    """What happened to every document of a snapshot: per source, filter, dedup and split."""
    # The id becomes a store key and a file name: a '/' or '..' must not reach either.
    try:
        check_snapshot_id(snapshot)
    except InvalidName as err:
        raise CliError(str(err)) from None
    report = load_report(get_settings(), snapshot)
    render_report(report, console)
    path = write_report(report, out or Path(f"report-{snapshot}.json"))
    console.print(f"wrote {path}")
