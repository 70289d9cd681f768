"""Where runs that did not end were when the soak gave up on them: each one's status, what
Temporal holds pending for it and for the cluster workflow (a workflow task failing again and
again, an activity no agent picks up), which of the stack's processes are down, and the last
errors in their logs.

A soak that failed in CI leaves nothing else behind (the stack's folder goes with the CI
machine), so this is printed and kept in the record the moment a run outlives its wait.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from bench.local_stack import LocalStack
from infra.processes import ManagedProcess
from infra.settings import load_settings
from workflows.contracts.names import CLUSTER_WORKFLOW_ID

# Lines worth showing from a process's log: failures, not the routine.
_TROUBLE = re.compile(r"Traceback|Error|error|failed|Failed|nondetermin|panic", re.ASCII)
# A client retrying while a server is down says so every few seconds: routine under the soak.
_RETRYING = re.compile(r"retried \d+ times|Retrying \(Retry")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_LINES_PER_LOG = 12


def diagnose(stack: LocalStack, runs: list[str]) -> str:
    """A plain-text account of `runs` and of the stack under them; never raises (whatever
    could not be read is said instead)."""
    parts = [_processes(stack.home), _cluster(stack)]
    try:
        parts.append(asyncio.run(_temporal(stack.home, [*runs, CLUSTER_WORKFLOW_ID])))
    except Exception as e:  # Temporal itself down: say so, go on with the rest
        parts.append(f"temporal: could not be read ({type(e).__name__}: {e})")
    for run in runs:
        try:
            parts.append(stack.cli("status", run, timeout=60))
        except Exception as e:
            parts.append(f"forgeline status {run}: {e}")
    parts.append(_log_trouble(stack.home / "logs"))
    return "\n".join(parts)


def _processes(home: Path) -> str:
    names = sorted(p.stem for p in (home / "run").glob("*.pid"))
    down = [name for name in names if not ManagedProcess(home, name).running()]
    return f"processes: {len(names)} with a pid file; not running: {down or 'none'}"


def _cluster(stack: LocalStack) -> str:
    """The cluster as the API shows it: who holds which nodes, who waits and why."""
    try:
        state = stack.api().cluster()
    except Exception as e:
        return f"cluster: could not be read through the API ({type(e).__name__}: {e})"
    nodes = [f"{n.info.node_id} {n.health.value}/{n.admin.value}, {n.free} free"
             for n in state.nodes]  # fmt: skip
    held = [f"{a.run_id} g{a.generation} on {[n.node_id for n in a.nodes]}"
            for a in state.allocations]  # fmt: skip
    waiting = [f"{w.run_id} #{w.position}: {w.reason}" for w in state.waiting]
    return (
        f"cluster: nodes {nodes}\n  held: {held or 'none'}\n"
        f"  queue: {[r.run_id for r in state.queue] or 'empty'}; waiting: {waiting or 'none'}"
    )


async def _temporal(home: Path, workflow_ids: list[str]) -> str:
    from worker.temporal_client import connect

    client = await connect(load_settings(home))
    return "\n".join([await _workflow(client, wid) for wid in workflow_ids])


async def _workflow(client: Client, workflow_id: str) -> str:
    """One workflow's pending work and the last workflow task failure in its history."""
    handle = client.get_workflow_handle(workflow_id)
    try:
        described = await handle.describe()
    except Exception as e:
        return f"{workflow_id}: not described ({type(e).__name__}: {e})"
    raw = described.raw_description
    status = described.status.name if described.status else "?"
    lines = [f"{workflow_id}: {status}, {described.history_length} events"]
    task = raw.pending_workflow_task
    if task.attempt:
        lines.append(f"  workflow task pending, attempt {task.attempt}, since "
                     f"{_ago(task.original_scheduled_time.ToDatetime(UTC))}")  # fmt: skip
    for activity in raw.pending_activities:
        beat = activity.last_heartbeat_time
        lines.append(
            f"  activity {activity.activity_id} ({activity.activity_type.name}): state "
            f"{activity.state}, attempt {activity.attempt}, last heartbeat "
            f"{_ago(beat.ToDatetime(UTC)) if beat.seconds else 'never'}"
            + (f", last failure: {activity.last_failure.message}" if activity.last_failure.message
               else "")
        )  # fmt: skip
    failed = None
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            failed = event.workflow_task_failed_event_attributes.failure.message
    if failed:
        lines.append(f"  last workflow task failure: {failed[:1500]}")
    return "\n".join(lines)


def _ago(when: datetime) -> str:
    return f"{(datetime.now(UTC) - when).total_seconds():.0f} s ago"


def _log_trouble(logs: Path) -> str:
    """The last lines of trouble in each process's log."""
    out = []
    for log in sorted(logs.glob("*.log")):
        text = _COLOUR.sub("", log.read_text(errors="replace"))
        lines = [x for x in text.splitlines() if _TROUBLE.search(x) and not _RETRYING.search(x)]
        if lines:
            out.append(f"--- {log.name}: the last {min(len(lines), _LINES_PER_LOG)} of "
                       f"{len(lines)} lines of trouble")  # fmt: skip
            out += [x[:400] for x in lines[-_LINES_PER_LOG:]]
    return "\n".join(out) or "logs: no lines of trouble"
