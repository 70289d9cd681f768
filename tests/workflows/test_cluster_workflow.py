"""The Cluster workflow against a real Temporal dev server (and the time-skipping test server
where a grace period has to run out)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.grants import GrantActivities
from tests.workflows.conftest import CONTINUE_AS_NEW_AFTER
from tests.workflows.gang_holder import GangHolder
from tests.workflows.replaying import write_history
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import (
    MAX_ADVERTISED_CACHED,
    Admin,
    Allocation,
    ClusterConfig,
    ClusterState,
    GangRequest,
    GrantCheck,
    Health,
    JoinRequest,
    Node,
    NodeAdmin,
    NodeAnswered,
    NodeFailure,
    NodeHealthReport,
    NodeInfo,
    PreemptNotice,
    QueueConfig,
    Release,
)
from workflows.contracts.names import CLUSTER_WORKFLOW_ID
from workflows.scheduling import cluster_ops

T = TypeVar("T")


def node(node_id: str, incarnation: str = "a") -> NodeInfo:
    return NodeInfo(node_id=node_id, rdzv_port=29500, incarnation=incarnation)


async def eventually(
    probe: Callable[[], Awaitable[T]], check: Callable[[T], bool], timeout: float = 10
) -> T:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await probe()
        if check(value) or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.1)


class Harness:
    def __init__(self, client: Client, task_queue: str, cluster: WorkflowHandle) -> None:
        self.client, self.task_queue, self.cluster = client, task_queue, cluster
        self.holders: list[WorkflowHandle] = []

    async def hold(self, run_id: str, nodes: int = 1, **fields: object) -> WorkflowHandle:
        handle = await self.client.start_workflow(
            GangHolder.run,
            GangRequest(run_id=run_id, nodes=nodes, gpus_per_node=1, **fields),
            id=run_id,
            task_queue=self.task_queue,
        )
        self.holders.append(handle)
        return handle

    async def grants(self, holder: WorkflowHandle, count: int) -> list[Allocation]:
        async def probe() -> list[Allocation]:
            return await holder.query(GangHolder.grants, result_type=list[Allocation])

        return await eventually(probe, lambda grants: len(grants) >= count)

    async def notices(self, holder: WorkflowHandle, count: int) -> list[PreemptNotice]:
        async def probe() -> list[PreemptNotice]:
            return await holder.query(GangHolder.notices, result_type=list[PreemptNotice])

        return await eventually(probe, lambda notices: len(notices) >= count)

    async def gang_of_two(self, run_id: str = "run-a") -> Allocation:
        """Nodes n0 and n1 registered, and both granted to one run."""
        for n in ("n0", "n1"):
            await self.cluster.signal(ClusterWorkflow.register_node, node(n))
        (grant,) = await self.grants(await self.hold(run_id, nodes=2), 1)
        return grant

    async def state(self, check: Callable[[ClusterState], bool] = lambda _: True) -> ClusterState:
        async def probe() -> ClusterState:
            return await self.cluster.query(ClusterWorkflow.state, result_type=ClusterState)

        return await eventually(probe, check)

    async def close(self) -> None:
        """Ids repeat across tests: leave no holder running for the next test to collide with."""
        for handle in [*self.holders, self.cluster]:
            with contextlib.suppress(RPCError):
                await handle.terminate("test over")


async def _scenario(
    client: Client, task_queue: str, scenario: Callable[[Harness], Awaitable[None]]
) -> None:
    async with Worker(client, task_queue=task_queue, workflows=[ClusterWorkflow, GangHolder]):
        cluster = await client.start_workflow(
            ClusterWorkflow.run, ClusterState(), id=CLUSTER_WORKFLOW_ID, task_queue=task_queue
        )
        harness = Harness(client, task_queue, cluster)
        try:
            await scenario(harness)
        finally:
            await harness.close()


def run_scenario(
    address: str, task_queue: str, scenario: Callable[[Harness], Awaitable[None]]
) -> None:
    async def main() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        await _scenario(client, task_queue, scenario)

    asyncio.run(main())


def test_gang_is_all_or_nothing(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holder = await h.hold("run-a", nodes=3)
        state = await h.state(lambda s: bool(s.waiting))
        assert [r.run_id for r in state.queue] == ["run-a"]
        assert "more than the cluster's schedulable nodes can ever give" in state.waiting[0].reason
        assert await holder.query(GangHolder.grants, result_type=list[Allocation]) == []
        await h.cluster.signal(ClusterWorkflow.register_node, node("n2"))
        (grant,) = await h.grants(holder, 1)
        assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1", "n2"]
        assert grant.generation == 1 and grant.granted_at is not None
        state = await h.state()
        assert all(n.jobs == {"run-a": 1} and n.state == "allocated" for n in state.nodes)

    run_scenario(temporal_address, task_queue, scenario)


def test_concurrent_runs_queue_and_start_whole(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1", "n2", "n3"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holders = [await h.hold(f"run-{i}", nodes=2) for i in range(5)]
        state = await h.state(lambda s: len(s.allocations) == 2 and len(s.queue) == 3)
        granted = {a.run_id for a in state.allocations}
        assert all(len(a.nodes) == 2 for a in state.allocations)
        assert all(sum(n.jobs.values()) <= n.info.gpus for n in state.nodes)
        # Release the running gangs one by one: each frees exactly one waiting run's gang.
        for round_ in range(3):
            first = sorted(granted)[0]
            grant = next(a for a in state.allocations if a.run_id == first)
            await h.cluster.signal(
                ClusterWorkflow.release, Release(run_id=first, generation=grant.generation)
            )
            state = await h.state(
                lambda s, r=round_: len(s.allocations) == 2 and len(s.queue) == 2 - r
            )
            assert len(state.allocations) == 2 and len(state.queue) == 2 - round_
            granted = {a.run_id for a in state.allocations}
        generations = [a.generation for a in state.allocations]
        assert len(set(generations)) == len(generations)
        for holder in holders:
            await holder.signal(GangHolder.finish)

    run_scenario(temporal_address, task_queue, scenario)


def test_release_is_fenced_by_generation(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        first = await h.hold("run-a", nodes=2)
        (grant,) = await h.grants(first, 1)
        second = await h.hold("run-b", nodes=1)
        await h.state(lambda s: len(s.queue) == 1)

        # A release naming an older generation is stale: nothing moves.
        stale = Release(run_id="run-a", generation=grant.generation - 1)
        await h.cluster.signal(ClusterWorkflow.release, stale)
        state = await h.state()
        assert [a.run_id for a in state.allocations] == ["run-a"]

        current = Release(run_id="run-a", generation=grant.generation)
        await h.cluster.signal(ClusterWorkflow.release, current)
        (granted_b,) = await h.grants(second, 1)
        assert granted_b.generation == grant.generation + 1

    run_scenario(temporal_address, task_queue, scenario)


def test_failed_node_is_drained_until_it_comes_back(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1", "n2"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holder = await h.hold("run-a", nodes=2)
        (grant,) = await h.grants(holder, 1)
        victim = grant.nodes[0].node_id
        stale = NodeFailure(
            run_id="run-a", generation=grant.generation - 1, node_id=victim, reason="old"
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, stale)
        fresh = NodeFailure(
            run_id="run-a", generation=grant.generation, node_id=victim, reason="heartbeat"
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, fresh)
        state = await h.state(lambda s: any(n.health == Health.DOWN for n in s.nodes))
        down = [n for n in state.nodes if n.health == Health.DOWN]
        assert [(n.info.node_id, n.down_reason) for n in down] == [(victim, "heartbeat")]
        assert state.fail_stops == 1  # the fleet's record, for checkpoint_every = "auto"
        await h.cluster.signal(ClusterWorkflow.report_failure, fresh)  # a second report of it

        # The run gives the gang back and asks again: it gets the healthy node, never the
        # drained one, under a new generation.
        release = Release(run_id="run-a", generation=grant.generation)
        await h.cluster.signal(ClusterWorkflow.release, release)
        again = GangRequest(run_id="run-a", nodes=2, gpus_per_node=1, recovery=True)
        await h.cluster.signal(ClusterWorkflow.request_gang, again)
        grants = await h.grants(holder, 2)
        assert victim not in [n.node_id for n in grants[1].nodes]
        assert grants[1].generation > grant.generation
        assert grants[1].fleet_fail_stops == 1  # one death, however often it was reported

        # The same agent re-registering is still down; a restarted one (new incarnation) is back.
        await h.cluster.signal(ClusterWorkflow.register_node, node(victim, incarnation="a"))
        state = await h.state()
        assert next(n for n in state.nodes if n.info.node_id == victim).health == Health.DOWN
        await h.cluster.signal(ClusterWorkflow.register_node, node(victim, incarnation="b"))
        state = await h.state(lambda s: all(n.health == Health.HEALTHY for n in s.nodes))
        assert next(n for n in state.nodes if n.info.node_id == victim).state == "idle"

    run_scenario(temporal_address, task_queue, scenario)


def test_a_death_reported_after_the_agent_restarted_leaves_the_new_one_up(
    temporal_address: str, task_queue: str
) -> None:
    async def scenario(h: Harness) -> None:
        grant = await h.gang_of_two()
        # n0's agent dies and is restarted (a new incarnation) before the run reports it.
        await join(h, node("n0", incarnation="b"), previous="a")
        died = NodeFailure(
            run_id="run-a", generation=grant.generation, node_id="n0", reason="heartbeat"
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, died)
        state = await h.state(lambda s: s.fail_stops == 1)
        assert all(n.health == Health.HEALTHY for n in state.nodes)

    run_scenario(temporal_address, task_queue, scenario)


def test_a_node_taken_for_dead_that_answers_after_all_is_back_and_not_counted(
    temporal_address: str, task_queue: str
) -> None:
    """A run reported n0 dead because its probe went unanswered for half a second; the probe
    went on, n0 answered as the same agent, and the run says so (workflows.silent_nodes).
    Only that report is undone: not a report of another reason, nor an agent since restarted,
    nor a node whose own check fails."""

    async def scenario(h: Harness) -> None:
        grant = await h.gang_of_two()
        reason = "n0: its agent did not answer a liveness probe within 0.5 s"
        died = NodeFailure(run_id="run-a", generation=grant.generation, node_id="n0",
                           reason=reason)  # fmt: skip
        await h.cluster.signal(ClusterWorkflow.report_failure, died)
        await h.state(lambda s: s.fail_stops == 1)

        def answered(**changed: str) -> NodeAnswered:
            fields = {"run_id": "run-a", "generation": grant.generation, "node_id": "n0",
                      "incarnation": "a", "reason": reason, **changed}  # fmt: skip
            return NodeAnswered.model_validate(fields)

        for other in (answered(reason="n0: heartbeat"), answered(incarnation="b")):
            await h.cluster.signal(ClusterWorkflow.node_answered, other)
        # Signals are handled in order: a query that sees the next one's effect saw these.
        failing = NodeHealthReport(node_id="n1", incarnation="a", healthy=False, reason="disk")
        await h.cluster.signal(ClusterWorkflow.node_health, failing)
        state = await h.state(lambda s: s.nodes[1].health == Health.DOWN)
        assert (state.nodes[0].health, state.fail_stops) == (Health.DOWN, 1)

        await h.cluster.signal(ClusterWorkflow.node_answered, answered())
        state = await h.state(lambda s: s.nodes[0].health == Health.HEALTHY)
        assert (state.nodes[0].down_reason, state.fail_stops) == (None, 0)

        # n1 is down for its own check: a run's report and its answer leave it down.
        n1_died = died.model_copy(update={"node_id": "n1", "reason": "n1: silent"})
        await h.cluster.signal(ClusterWorkflow.report_failure, n1_died)
        n1_back = answered(node_id="n1", reason="n1: silent")
        await h.cluster.signal(ClusterWorkflow.node_answered, n1_back)
        await h.cluster.signal(ClusterWorkflow.report_failure, died)  # n0 again: the marker
        state = await h.state(lambda s: s.nodes[0].health == Health.DOWN)
        assert state.nodes[1].health == Health.DOWN, state.nodes[1]

    run_scenario(temporal_address, task_queue, scenario)


async def join(h: Harness, info: NodeInfo, previous: str | None = None) -> Node:
    request = JoinRequest(info=info, previous_incarnation=previous)
    return await h.cluster.execute_update(ClusterWorkflow.join_node, request)


def test_a_second_agent_cannot_join_as_a_live_node(temporal_address: str, task_queue: str) -> None:
    """Only the node's own agent, or its successor on the same host (which names the
    incarnation it follows), joins as a node that is alive; a refusal changes nothing."""

    async def scenario(h: Harness) -> None:
        first = node("n0", incarnation="a").model_copy(update={"host": "198.18.0.2"})
        assert (await join(h, first)).info.incarnation == "a"
        again = first.model_copy(update={"cached": ["snap"]})  # the same agent, more cached
        assert (await join(h, again)).info.cached == ["snap"]
        impostor = node("n0", incarnation="x").model_copy(update={"host": "198.18.0.9"})
        for previous in (None, "not-a"):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await join(h, impostor, previous)
            said = str(refused.value.cause)
            assert "node n0 is alive under another agent (at 198.18.0.2" in said, said
        (kept,) = (await h.state()).nodes
        assert (kept.info.host, kept.info.incarnation) == ("198.18.0.2", "a")
        # Its successor on the same host names the incarnation it follows, and takes over.
        assert (await join(h, node("n0", incarnation="b"), previous="a")).info.incarnation == "b"
        # Once the node is down (its agent stopped), any agent may bring it back.
        await h.cluster.signal(ClusterWorkflow.node_stopped, node("n0", incarnation="b"))
        await h.state(lambda s: s.nodes[0].health == Health.DOWN)
        assert (await join(h, impostor)).info.host == "198.18.0.9"

    run_scenario(temporal_address, task_queue, scenario)


def test_the_old_register_signal_cannot_take_a_live_node(
    temporal_address: str, task_queue: str
) -> None:
    """Issue 44, finding 13: `register_node` (agents before `join_node`) for a live node under
    another incarnation replaced it: another agent took over a node whose gang still ran. Now
    it is dropped as `join_node` refuses it; the node's own agent and a down node still may."""

    async def scenario(h: Harness) -> None:
        first = node("n0", incarnation="a").model_copy(update={"host": "198.18.0.2"})
        await h.cluster.signal(ClusterWorkflow.register_node, first)
        impostor = node("n0", incarnation="x").model_copy(update={"host": "198.18.0.9"})
        await h.cluster.signal(ClusterWorkflow.register_node, impostor)
        await h.cluster.signal(ClusterWorkflow.register_node, node("n1"))  # handled after it
        kept, _ = (await h.state(lambda s: len(s.nodes) == 2)).nodes
        assert (kept.info.host, kept.info.incarnation) == ("198.18.0.2", "a")
        again = first.model_copy(update={"cached": ["snap"]})  # the same agent, more cached
        await h.cluster.signal(ClusterWorkflow.register_node, again)
        await h.state(lambda s: s.nodes[0].info.cached == ["snap"])
        await h.cluster.signal(ClusterWorkflow.node_stopped, first)
        await h.cluster.signal(ClusterWorkflow.register_node, impostor)
        taken, _ = (await h.state(lambda s: s.nodes[0].info.incarnation == "x")).nodes
        assert (taken.info.host, taken.health) == ("198.18.0.9", Health.HEALTHY)
        # FORGELINE_RECORD_HISTORIES=tests/workflows/histories: the replay test's history
        # (test_training_run_history.RECORD_TO, not imported: that module imports this one).
        if record := os.environ.get("FORGELINE_RECORD_HISTORIES"):
            label = "2026-12-06-register-live"
            write_history(
                await h.cluster.fetch_history(),
                Path(record) / f"{label}_Cluster_{CLUSTER_WORKFLOW_ID}",
            )

    run_scenario(temporal_address, task_queue, scenario)


def test_a_grant_is_confirmed_only_where_the_cluster_placed_it(
    temporal_address: str, task_queue: str
) -> None:
    """Issue 44, finding 13: `confirm_grant` compared a grant's generation, nodes and their
    incarnations, not where they are: a forged grant of the right nodes with the head at
    another host or rendezvous port was confirmed, and the gang's ranks would meet there."""

    async def scenario(h: Harness) -> None:
        grant = await h.gang_of_two()
        confirm = GrantActivities(h.client).confirm_grant
        assert await confirm(GrantCheck.of(grant))
        head, other = grant.nodes
        for moved in (
            {"host": "198.18.0.66"},
            {"rdzv_port": 31337},
            {"rdzv_ports": 7},
            {"incarnation": "x"},
        ):
            forged = grant.model_copy(update={"nodes": [head.model_copy(update=moved), other]})
            assert not await confirm(GrantCheck.of(forged)), moved
        # A check the run scheduled before addresses were compared still confirms its grant.
        assert await confirm(GrantCheck.of(grant).model_copy(update={"addresses": None}))

    run_scenario(temporal_address, task_queue, scenario)


def test_a_node_cannot_grow_the_cluster_state_with_what_it_caches(
    temporal_address: str, task_queue: str
) -> None:
    """Issue 17, item 13: every node's `cached` list travels in the state (continue-as-new
    input, queries, grants); the workflow keeps the first MAX_ADVERTISED_CACHED of any list, by
    `join_node` or by the older `register_node`, and a gang carries none."""
    huge = [f"{i:020x}" for i in range(20_000)]  # ~0.5 MB: an old agent's or a hostile one's
    kept = huge[:MAX_ADVERTISED_CACHED]

    async def scenario(h: Harness) -> None:
        joined = await join(h, node("n0").model_copy(update={"cached": huge}))
        assert joined.info.cached == kept
        await h.cluster.signal(
            ClusterWorkflow.register_node, node("n1").model_copy(update={"cached": huge})
        )
        state = await h.state(lambda s: len(s.nodes) == 2)
        assert [n.info.cached for n in state.nodes] == [kept, kept]
        (grant,) = await h.grants(await h.hold("run-a", nodes=2), 1)
        assert [n.cached for n in grant.nodes] == [[], []]
        state = await h.state(lambda s: bool(s.allocations))
        assert len(state.model_dump_json()) < 5_000, "the state grew with the lists"

    run_scenario(temporal_address, task_queue, scenario)


def test_a_state_carried_from_before_the_bound_is_bounded() -> None:
    """What continue-as-new carries on: a state an older run built, unbounded, comes out
    bounded (nodes keep their newest snapshots, gangs none)."""
    huge = [f"{i:020x}" for i in range(1_000)]
    info = node("n0").model_copy(update={"cached": huge})
    state = ClusterState(
        nodes=[Node(info=info)],
        allocations=[Allocation(run_id="r", generation=1, nodes=[info], gpus_per_node=1)],
    )
    cluster_ops.bound_cached(state)
    assert state.nodes[0].info.cached == huge[:MAX_ADVERTISED_CACHED]
    assert state.allocations[0].nodes[0].cached == []


def test_one_team_s_report_keeps_a_node_in_service_and_a_second_team_s_cordons_it(
    temporal_address: str, task_queue: str
) -> None:
    """A straggler or corruption suspect named by a run's ranks (what its script can write as
    well): recorded on the node, which stays in service; a run of another team naming it
    within cordon_window_h cordons it, with both reports as its reason, and not as a death.
    Before, the first report cordoned it. (Another run of the same team counting once:
    tests/workflows/scheduling/test_node_reports.py.)"""
    slow = "straggler: rank 1 is 3.0× slower"
    corrupt = "suspected silent corruption: rank 1's own gradients were non-finite"

    async def report_as(h: Harness, run_id: str, team: str, kind: str, reason: str) -> None:
        holder = await h.hold(run_id, nodes=2, team=team)
        (grant,) = await h.grants(holder, 1)
        said = NodeFailure(
            run_id=run_id, generation=grant.generation, node_id="n1", reason=reason, kind=kind
        )
        await h.cluster.signal(ClusterWorkflow.report_failure, said)
        await h.cluster.signal(
            ClusterWorkflow.release, Release(run_id=run_id, generation=grant.generation)
        )

    def n1_of(state: ClusterState) -> Node:
        return next(n for n in state.nodes if n.info.node_id == "n1")

    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        await report_as(h, "run-a", "team-a", "straggler", slow)
        n1 = n1_of(await h.state(lambda s: not s.allocations and bool(n1_of(s).reports)))
        assert (n1.admin, n1.health, n1.down_reason) == (Admin.ACTIVE, Health.HEALTHY, None)
        assert [(r.team, r.run_id, r.kind) for r in n1.reports] == [
            ("team-a", "run-a", "straggler")
        ]
        await report_as(h, "run-b", "team-b", "corruption", corrupt)
        state = await h.state(lambda s: n1_of(s).admin == Admin.CORDONED)
        n1 = n1_of(state)
        assert n1.health == Health.HEALTHY and n1.reports == []
        assert n1.down_reason == (
            f"reported by runs of 2 teams within 24 h: team team-a (run run-a): {slow}; "
            f"team team-b (run run-b): {corrupt}"
        )
        assert state.fail_stops == 0

    run_scenario(temporal_address, task_queue, scenario)


def test_a_node_failing_its_own_check_leaves_and_comes_back(
    temporal_address: str, task_queue: str
) -> None:
    async def scenario(h: Harness) -> None:
        await h.cluster.signal(ClusterWorkflow.register_node, node("n0"))
        sick = NodeHealthReport(node_id="n0", incarnation="a", healthy=False, reason="ECC")
        await h.cluster.signal(ClusterWorkflow.node_health, sick)
        state = await h.state(lambda s: s.nodes[0].health == Health.DOWN)
        assert state.nodes[0].down_reason == "ECC" and state.fail_stops == 0
        well = NodeHealthReport(node_id="n0", incarnation="a", healthy=True)
        await h.cluster.signal(ClusterWorkflow.node_health, well)
        await h.state(lambda s: s.nodes[0].health == Health.HEALTHY)

        # A run that saw the check fail before the agent's own report came in: the same.
        holder = await h.hold("run-b", nodes=1)
        (grant,) = await h.grants(holder, 1)
        failed = NodeFailure(
            run_id="run-b", generation=grant.generation, node_id="n0",
            reason="n0: health check failed", kind="unhealthy",
        )  # fmt: skip
        await h.cluster.signal(ClusterWorkflow.report_failure, failed)
        await h.state(lambda s: s.nodes[0].health == Health.DOWN)
        await h.cluster.signal(
            ClusterWorkflow.release, Release(run_id="run-b", generation=grant.generation)
        )
        await h.cluster.signal(ClusterWorkflow.node_health, well)
        state = await h.state(lambda s: s.nodes[0].health == Health.HEALTHY)
        assert state.fail_stops == 0

        # Dead under a gang is another matter: only a restarted agent brings it back.
        holder = await h.hold("run-a", nodes=1)
        (grant,) = await h.grants(holder, 1)
        died = NodeFailure(run_id="run-a", generation=grant.generation, node_id="n0", reason="x")
        await h.cluster.signal(ClusterWorkflow.report_failure, died)
        await h.cluster.signal(ClusterWorkflow.node_health, well)
        state = await h.state(lambda s: s.fail_stops == 1)
        assert state.nodes[0].health == Health.DOWN and state.nodes[0].down_reason == "x"

    run_scenario(temporal_address, task_queue, scenario)


def test_a_team_reclaims_its_guarantee_from_a_borrower(
    temporal_address: str, task_queue: str
) -> None:
    async def scenario(h: Harness) -> None:
        config = ClusterConfig(
            queues=[QueueConfig(name="nlp", guaranteed_gpus=2), QueueConfig(name="vision")],
            preemption_grace_s=60,
            preemption_shield_s=0,  # the borrower was granted just now: reclaim it at once
            reclaim_after_s=0,  # and without waiting for nodes to free on their own
        )
        await h.cluster.execute_update(ClusterWorkflow.apply_config, config)
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        borrower = await h.hold("vision-run", nodes=2, team="vision")
        (taken,) = await h.grants(borrower, 1)
        await borrower.signal(GangHolder.release_when_preempted)

        owner = await h.hold("nlp-run", nodes=2, team="nlp", preemptible=False)
        (notice,) = await h.notices(borrower, 1)
        assert notice.generation == taken.generation and notice.grace_s == 60
        assert "nlp-run (team nlp) reclaims its guarantee" in notice.reason
        (grant,) = await h.grants(owner, 1)
        assert sorted(n.node_id for n in grant.nodes) == ["n0", "n1"]
        assert grant.generation > taken.generation
        state = await h.state()
        assert [a.run_id for a in state.allocations] == ["nlp-run"]

    run_scenario(temporal_address, task_queue, scenario)


def test_drain_moves_work_off_a_node_and_undrain_brings_it_back(
    temporal_address: str, task_queue: str
) -> None:
    async def scenario(h: Harness) -> None:
        for n in ("n0", "n1"):
            await h.cluster.signal(ClusterWorkflow.register_node, node(n))
        holder = await h.hold("run-a", nodes=1)
        (grant,) = await h.grants(holder, 1)
        where = grant.nodes[0].node_id
        await holder.signal(GangHolder.release_when_preempted)
        drained = await h.cluster.execute_update(
            ClusterWorkflow.set_node_admin, NodeAdmin(node_id=where, admin=Admin.DRAINING)
        )
        assert drained.state == "draining"
        (notice,) = await h.notices(holder, 1)
        assert notice.reason == f"node {where} is draining"
        state = await h.state(lambda s: not s.allocations)
        assert next(n for n in state.nodes if n.info.node_id == where).jobs == {}
        other = await h.hold("run-b", nodes=2)  # needs both nodes: must wait for undrain
        state = await h.state(lambda s: bool(s.waiting))
        assert [r.run_id for r in state.queue] == ["run-b"]
        await h.cluster.execute_update(
            ClusterWorkflow.set_node_admin, NodeAdmin(node_id=where, admin=Admin.ACTIVE)
        )
        (granted,) = await h.grants(other, 1)
        assert where in [n.node_id for n in granted.nodes]

    run_scenario(temporal_address, task_queue, scenario)


def test_continue_as_new_keeps_the_state(temporal_address: str, task_queue: str) -> None:
    async def scenario(h: Harness) -> None:
        first_run = (await h.cluster.describe()).run_id
        await h.cluster.signal(ClusterWorkflow.register_node, node("n0"))
        holder = await h.hold("run-a", nodes=1)
        (grant,) = await h.grants(holder, 1)
        # Each signal is a history event; past the server's threshold the workflow carries its
        # state into a new run.
        for i in range(CONTINUE_AS_NEW_AFTER):
            await h.cluster.signal(ClusterWorkflow.register_node, node(f"extra-{i % 5}"))

        async def run_id() -> str:
            return (await h.client.get_workflow_handle(CLUSTER_WORKFLOW_ID).describe()).run_id

        assert await eventually(run_id, lambda r: r != first_run, timeout=30) != first_run
        h.cluster = h.client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
        state = await h.state(lambda s: len(s.nodes) == 6)
        assert [a.run_id for a in state.allocations] == ["run-a"]
        assert state.allocations[0].generation == grant.generation
        assert state.next_generation == grant.generation + 1

    run_scenario(temporal_address, task_queue, scenario)


def test_a_victim_that_never_releases_is_revoked_after_the_grace(task_queue: str) -> None:
    """Time matters here: the time-skipping test server runs the grace period out in ms."""

    async def scenario(env: WorkflowEnvironment, h: Harness) -> None:
        config = ClusterConfig(
            queues=[QueueConfig(name="nlp", guaranteed_gpus=1), QueueConfig(name="vision")],
            preemption_grace_s=120,
            preemption_shield_s=0,  # the squatter was granted just now: reclaim it at once
            reclaim_after_s=0,  # and without waiting for nodes to free on their own
        )
        await h.cluster.execute_update(ClusterWorkflow.apply_config, config)
        await h.cluster.signal(ClusterWorkflow.register_node, node("n0"))
        squatter = await h.hold("vision-run", team="vision")  # never releases
        await h.grants(squatter, 1)
        owner = await h.hold("nlp-run", team="nlp")
        await h.notices(squatter, 1)
        assert await owner.query(GangHolder.grants, result_type=list[Allocation]) == []
        await env.sleep(120 + 30 + 61)  # grace, revoke margin, one scheduling tick
        (grant,) = await h.grants(owner, 1)
        assert grant.nodes[0].node_id == "n0"

    run_time_skipping(task_queue, scenario)


def run_time_skipping(
    task_queue: str, scenario: Callable[[WorkflowEnvironment, Harness], Awaitable[None]]
) -> None:
    """`scenario` on the time-skipping test server, where `env.sleep` runs timers out in ms."""

    async def main() -> None:
        server = Path(sys.executable).parent / "temporal-test-server"
        async with await WorkflowEnvironment.start_time_skipping(
            data_converter=pydantic_data_converter, test_server_existing_path=str(server)
        ) as env:

            async def with_env(h: Harness) -> None:
                await scenario(env, h)

            await _scenario(env.client, task_queue, with_env)

    asyncio.run(main())
