"""A failed gang's silent nodes, decided without holding up the next gang.

When a gang fails, every node whose activity still runs is probed (`node_alive`): a live agent
answers within milliseconds; a dead one never does, and its probe times out after
`PROBE_TIMEOUT` (2 s). The run used to wait for that timeout before it gave the gang back, so
2 s of every node death's recovery (3.8 s end to end, alone on this machine) was the wait for
an answer that was never coming.

Now the teardown waits `SILENT_AFTER` for the answers. A node that has not answered by then is
taken for dead: the run reports it down and the next gang is granted without it. Its probe
goes on meanwhile (`Confirmation`): if the agent answers after all, as the incarnation
granted, it was only slow; once its ranks have stopped, the run tells the cluster
(`node_answered`), which puts the node back in service and does not count the death. So a slow
agent costs at most its place in one gang, where before, missing the 2 s, it left the fleet
until its agent restarted.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow

from workflows.contracts.cluster_models import Allocation, NodeAnswered, NodeInfo
from workflows.contracts.names import CLUSTER_WORKFLOW_ID
from workflows.gang_outcome import answers_as_granted, observe, request_cancel

# How long the teardown waits for the still-running nodes' answers. The soak's live agents
# answered in tens of milliseconds at the median (bench/probe_answers.py); the probe itself
# runs on for its full PROBE_TIMEOUT, so a late answer costs a place in one gang, not a node.
SILENT_AFTER = timedelta(seconds=0.5)


@dataclass
class Confirmation:
    """A node taken for dead whose probe is still out, with its training activity."""

    node: NodeInfo
    probe: asyncio.Task[bool]
    activity: workflow.ActivityHandle


async def tear_down_quickly(
    allocation: Allocation, handles: list[workflow.ActivityHandle]
) -> tuple[frozenset[str], list[Confirmation]]:
    """Cancel a failed gang's activities; returns the silent nodes (no answer within
    SILENT_AFTER, or an answer as another incarnation) and the probes still out for them.
    Every node that answered as granted has its ranks stopped before this returns."""
    request_cancel(handles)
    running = [(n, h) for n, h in zip(allocation.nodes, handles, strict=True) if not h.done()]
    probes = [asyncio.create_task(answers_as_granted(node)) for node, _ in running]
    if probes and not all(p.done() for p in probes):
        # Timed out: the ones still out are the silent ones.
        with contextlib.suppress(builtins.TimeoutError):
            await workflow.wait_condition(
                lambda: all(p.done() for p in probes), timeout=SILENT_AFTER
            )
    silent: set[str] = set()
    live: list[workflow.ActivityHandle] = []
    out: list[Confirmation] = []
    for (node, handle), probe in zip(running, probes, strict=True):
        if probe.done() and probe.result():
            live.append(handle)
            continue
        silent.add(node.node_id)
        handle.add_done_callback(observe)
        if not probe.done():
            out.append(Confirmation(node, probe, handle))
    await asyncio.gather(*live, return_exceptions=True)
    return frozenset(silent), out


async def confirm(run_id: str, generation: int, confirmation: Confirmation, reported: str) -> bool:
    """Wait for a silent node's probe; returns whether its agent answered after all. Dead (no
    answer, or a restarted agent's), it stays as reported (`reported`: the reason the run gave
    the cluster). Alive, its ranks are waited for and the cluster is told it answered."""
    node = confirmation.node
    if not await confirmation.probe:
        return False
    # Its ranks stop before the node can be granted again (the cancellation was asked for).
    await asyncio.gather(confirmation.activity, return_exceptions=True)
    answered = NodeAnswered(
        run_id=run_id, generation=generation, node_id=node.node_id,
        incarnation=node.incarnation, reason=reported,
    )  # fmt: skip
    await workflow.get_external_workflow_handle(CLUSTER_WORKFLOW_ID).signal(
        "node_answered", answered
    )
    workflow.logger.info(
        "%s answered its liveness probe later than %g s: only slow, back in service",
        node.node_id, SILENT_AFTER.total_seconds(),
    )  # fmt: skip
    return True
