"""How fast live node agents answered the liveness probe, read from the runs' own histories.

When a gang fails, the workflow probes every node whose activity has not ended
(`workflows.gang_outcome.PROBE_TIMEOUT`, 2 s). The next gang waits `SILENT_AFTER` (0.5 s) for
the answers (workflows.silent_nodes): a live agent slower than that costs its place in that
gang. The answers' tail under a soak's load says whether the wait can be shorter. Every probe
in every TrainingRun execution (continued ones included) is counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from bench.soak_plan import ProbeAnswers
from infra.settings import load_settings

PROBE_ACTIVITY = "node_alive"


def read_probe_answers(home: Path) -> ProbeAnswers:
    """Every liveness probe of the stack at `home`, from Temporal's histories."""
    return asyncio.run(_read(home))


async def _read(home: Path) -> ProbeAnswers:
    from worker.temporal_client import connect

    client = await connect(load_settings(home))
    found = ProbeAnswers()
    async for execution in client.list_workflows("WorkflowType = 'TrainingRun'"):
        await _add_history(client, execution.id, execution.run_id, found)
    return found


async def _add_history(client: Client, workflow_id: str, run_id: str, found: ProbeAnswers) -> None:
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    count_probes([event async for event in handle.fetch_history_events()], found)


def count_probes(events: Iterable[HistoryEvent], found: ProbeAnswers) -> None:
    """Add one execution's probes to `found`: each answered one's time from scheduled to
    completed, and each that timed out."""
    scheduled: dict[int, float] = {}  # the probes' scheduled events, by id: when
    for event in events:
        when = event.event_time.ToMilliseconds()
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == PROBE_ACTIVITY:
                scheduled[event.event_id] = when
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            probe = event.activity_task_completed_event_attributes.scheduled_event_id
            if (at := scheduled.pop(probe, None)) is not None:
                found.answered_ms.append(when - at)
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            probe = event.activity_task_timed_out_event_attributes.scheduled_event_id
            if scheduled.pop(probe, None) is not None:
                found.unanswered += 1
