"""Reservations held by the guard, in the Cluster workflow: at its start deadline a gang that
never ran takes its reserved nodes back from a gang whose declared max runtime would hold them
far longer; and a yielder runs on a reserved node until the gang can start. On the
time-skipping test server, so that deadlines, graces and hours run out in milliseconds."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from tests.workflows.gang_holder import GangHolder
from tests.workflows.replaying import write_history
from tests.workflows.test_cluster_workflow import Harness, node, run_time_skipping
from tests.workflows.test_training_run_history import RECORD_TO
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import Allocation, ClusterConfig, PreemptNotice
from workflows.contracts.names import CLUSTER_WORKFLOW_ID

LABEL = "2026-12-04-deadline"
YIELDING_LABEL = "2026-12-05-reclaim-patience"
REQUEUE_LABEL = "2026-12-04-requeue-deadline"
RESERVE_AFTER_S = 600
START_WITHIN_S = 1_200
TICK_S = 61  # the workflow passes at least once a minute while anything waits
LONG_RUN_S = 3_600


async def two_nodes(h: Harness, start_within_s: float) -> None:
    """The cluster of both tests: n0 and n1, a reservation after `RESERVE_AFTER_S`, 60 s grace."""
    config = ClusterConfig(
        reserve_after_s=RESERVE_AFTER_S, start_within_s=start_within_s, preemption_grace_s=60
    )
    await h.cluster.execute_update(ClusterWorkflow.apply_config, config)
    for n in ("n0", "n1"):
        await h.cluster.signal(ClusterWorkflow.register_node, node(n))


async def taken_back_at_the_deadline(
    env: WorkflowEnvironment, h: Harness, run_id: str, label: str, requeued: bool
) -> None:
    """A gang of two nodes waits behind a long run on both; at its deadline the long run is
    told to give them back, and the gang gets them."""
    await two_nodes(h, start_within_s=START_WITHIN_S)
    long_run = await h.hold("long-run", nodes=2, max_runtime_s=10 * 3600)
    (taken,) = await h.grants(long_run, 1)
    await long_run.signal(GangHolder.release_when_preempted)
    fields: dict[str, object] = {}
    if requeued:  # it ran before, first submitted long ago: a deadline from then is long past
        first_submitted = await env.get_current_time() - timedelta(days=3)
        fields = {"submitted_at": first_submitted, "started_before": True}
    waiting = await h.hold(run_id, nodes=2, **fields)
    await env.sleep(START_WITHIN_S - TICK_S)  # before its deadline: it waits, nothing stops
    assert await waiting.query(GangHolder.grants, result_type=list[Allocation]) == []
    assert await long_run.query(GangHolder.notices, result_type=list[PreemptNotice]) == []
    state = await h.state()
    (held,) = state.reservations
    assert held.run_id == run_id and sorted(held.nodes) == ["n0", "n1"]
    if requeued:
        (queued,) = state.queue
        assert queued.waiting_since is not None and queued.submitted_at == fields["submitted_at"]

    await env.sleep(2 * TICK_S)  # past the deadline: one pass at least
    (notice,) = await h.notices(long_run, 1)
    assert notice.generation == taken.generation
    assert re.fullmatch(rf"holds nodes reserved for {run_id}, waiting 2[01] min", notice.reason)
    (grant,) = await h.grants(waiting, 1)
    assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1"]
    if record := os.environ.get(RECORD_TO):
        write_history(
            await h.cluster.fetch_history(), Path(record) / f"{label}_Cluster_{CLUSTER_WORKFLOW_ID}"
        )


def test_a_gang_that_never_ran_takes_its_reserved_nodes_back_at_its_deadline(
    task_queue: str,
) -> None:
    async def scenario(env: WorkflowEnvironment, h: Harness) -> None:
        await taken_back_at_the_deadline(env, h, "waiting-run", LABEL, requeued=False)

    run_time_skipping(task_queue, scenario)


def test_a_yielder_runs_on_a_reserved_node_and_leaves_when_the_gang_can_start(
    task_queue: str,
) -> None:
    async def scenario(env: WorkflowEnvironment, h: Harness) -> None:
        await two_nodes(h, start_within_s=7_200)
        long_run = await h.hold("long-run", nodes=1, max_runtime_s=LONG_RUN_S)
        (taken,) = await h.grants(long_run, 1)
        await long_run.signal(GangHolder.release_when_preempted)
        waiting = await h.hold("waiting-run", nodes=2, max_runtime_s=600)
        await env.sleep(RESERVE_AFTER_S + TICK_S)  # long-waiting: it holds both nodes now
        (held,) = (await h.state()).reservations
        assert held.run_id == "waiting-run" and sorted(held.nodes) == ["n0", "n1"]

        # Ten hours would end long after the reservation starts: it runs only as a yielder.
        filler = await h.hold("filler", nodes=1, max_runtime_s=10 * 3600)
        await filler.signal(GangHolder.release_when_preempted)
        (lent,) = await h.grants(filler, 1)
        assert {n.node_id for n in lent.nodes} == {"n0", "n1"} - {taken.nodes[0].node_id}
        (running,) = [a for a in (await h.state()).allocations if a.run_id == "filler"]
        assert running.yields_to == "waiting-run"

        await env.sleep(LONG_RUN_S)  # long-run reaches its max runtime; the gang can start
        (notice,) = await h.notices(filler, 1)
        assert notice.reason == "yields the nodes reserved for waiting-run, which start now"
        (grant,) = await h.grants(waiting, 1)
        assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1"]
        if record := os.environ.get(RECORD_TO):
            write_history(
                await h.cluster.fetch_history(),
                Path(record) / f"{YIELDING_LABEL}_Cluster_{CLUSTER_WORKFLOW_ID}",
            )

    run_time_skipping(task_queue, scenario)


def test_a_requeued_run_takes_its_reserved_nodes_back_at_its_deadline_from_the_requeue(
    task_queue: str,
) -> None:
    """A run that ran before (failed, or was preempted) and queued again: its deadline counts
    from when it queued again, so nothing is evicted at once for it, and it is not left to
    wait as long as the gangs on its nodes care to run."""

    async def scenario(env: WorkflowEnvironment, h: Harness) -> None:
        await taken_back_at_the_deadline(env, h, "requeued-run", REQUEUE_LABEL, requeued=True)

    run_time_skipping(task_queue, scenario)
