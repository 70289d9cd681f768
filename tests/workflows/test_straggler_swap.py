"""A straggler swapped out, in seconds: the real TrainingRun and Cluster workflows on the dev
server with stand-in activities. The gang's ranks stop at a checkpoint asking for a swap; the
run reports the slow node, gives the gang back, and the next gang, without it, resumes from
that checkpoint. (tests/e2e/test_failures.py does the same with real ranks, slowly.) The
ranks' word is the run's alone (a script can write the same progress lines): the node stays in
service for everyone else (one team's report cordons nothing: workflows.scheduling.node_reports)
and the run keeps its gangs off it. Ranks that ask for more swaps than the run's
recovery.max_swaps report nothing more."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.workflows.test_cluster_workflow import eventually, node
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    _status,
    one_node_spec,
    record_histories,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
)
from workflows.cluster import ClusterWorkflow
from workflows.contracts.cluster_models import Admin
from workflows.contracts.models import (
    AttemptCause,
    AttemptOutcome,
    CheckpointRef,
    HealthEvent,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    Phase,
    RunStatus,
)
from workflows.contracts.spec import RunSpec
from workflows.gang_outcome import StragglerSwap, swap_refused

# FORGELINE_RECORD_HISTORIES=tests/workflows/histories records the run's history and the
# Cluster workflow's: the first with a swap past max_swaps refused (`swaps-bounded`, 2026-12-06),
# then with the run keeping off the node it reported and the cluster only recording one team's
# report (`avoid-reported-nodes`, `cordon-corroborated`), replayed ever since.
LABEL = "2026-12-06-corroborated"
SWAPPED_AT = 40
SLOW = "n1"


class Agents:
    """Every node's agent: the ranks of each generation in `swap_out` stop at step 40 asking to
    swap out the node it names; other generations train to the end."""

    def __init__(self, swap_out: dict[int, str]) -> None:
        self.swap_out = swap_out
        self.step = 0  # the newest checkpoint, what the stand-in control worker finds
        self.gangs: dict[int, set[str]] = {}  # the nodes of each generation
        self.resumes: dict[int, CheckpointRef | None] = {}

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        generation = inp.allocation.generation
        self.gangs[generation] = {n.node_id for n in inp.allocation.nodes}
        self.resumes[generation] = inp.resume
        if generation in self.swap_out:
            self.step = SWAPPED_AT
            why = "step time 3.1x the gang's median"
            slow = HealthEvent(generation=generation, node_id=self.swap_out[generation],
                               kind="straggler", step=SWAPPED_AT, evidence=why,
                               action="swap")  # fmt: skip
            return NodeTrainResult(
                node_id=inp.node_id, generation=generation, final_step=SWAPPED_AT,
                final_loss=2.0, stopped=True, stop_reason="straggler: swap", health=[slow],
            )  # fmt: skip
        self.step = STEPS
        return NodeTrainResult(node_id=inp.node_id, generation=generation, final_step=STEPS,
                               final_loss=1.0)  # fmt: skip

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        return None


def swapping_spec(name: str, max_swaps: int = 10) -> RunSpec:
    """Two nodes, straggler_policy = "swap": the ranks may ask to swap `max_swaps` times."""
    base = one_node_spec(name)
    recovery = {"straggler_policy": "swap", "max_swaps": max_swaps}
    return base.model_copy(update={
        "resources": base.resources.model_copy(update={"nodes": 2}),
        "recovery": base.recovery.model_copy(update=recovery),
    })  # fmt: skip


def run_on_three_nodes(
    temporal_address: str, task_queue: str, spec: RunSpec, agents: Agents
) -> tuple[RunStatus, list[tuple]]:
    """The run on n0 and n1, n2 joining once the first gang is granted; its status once it
    awaits approval, and the nodes not active or reported then (node, admin state, reason, the
    teams and runs that reported it)."""

    async def main() -> tuple[RunStatus, list[tuple]]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        control = Control(agents)  # type: ignore[arg-type]  # it reads .step alone
        acts = [agents.train_on_node, agents.stop_training]
        workers = stack_workers(client, task_queue, control, {n: acts for n in ("n0", "n1", "n2")})
        async with contextlib.AsyncExitStack() as stack:
            cluster, run = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(run, cluster):
                for name in ("n0", "n1"):
                    await cluster.signal(ClusterWorkflow.register_node, node(name))
                granted = lambda s: (s.generation or 0) >= 1  # noqa: E731
                await eventually(lambda: _status(run), granted, timeout=30)
                await cluster.signal(ClusterWorkflow.register_node, node("n2"))
                final = await eventually(
                    lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
                )
                state = await cluster.query(ClusterWorkflow.state)
                marked = [(n.info.node_id, n.admin, n.down_reason,
                           [(r.team, r.run_id, r.reason) for r in n.reports])
                          for n in state.nodes if n.admin != Admin.ACTIVE or n.reports]  # fmt: skip
                await record_histories(LABEL, run, cluster)
                return final, marked

    return asyncio.run(main())


def test_a_straggler_is_swapped_out_and_swaps_past_max_swaps_cordon_nothing(
    temporal_address: str, task_queue: str
) -> None:
    """The first gang's ranks ask to swap out n1: the run reports it with the evidence, keeps
    off it, and the next gang, without it, resumes from step 40; n1 is not cordoned (one team's
    word). With max_swaps = 1, that gang's ranks ask to swap out n2 as well (as a script
    writing the watch's lines could): n2 is not even reported, the attempt fails with the
    reason, and the third gang, on n0 and n2 again, trains to the end. (One run for all: each
    costs seconds of the suite.)"""
    agents = Agents(swap_out={1: SLOW, 2: "n2"})
    spec = swapping_spec("swapped", max_swaps=1)
    final, marked = run_on_three_nodes(temporal_address, task_queue, spec, agents)
    assert final.phase == Phase.AWAITING_APPROVAL, final
    assert agents.gangs[1] == {"n0", SLOW}
    assert agents.gangs[2] == agents.gangs[3] == {"n0", "n2"}
    for generation in (2, 3):
        resumed = agents.resumes[generation]
        assert resumed is not None and resumed.step == SWAPPED_AT  # no step lost
    assert final.swaps == 1
    # Before, one run's ranks cordoned n1 (the cluster took the node out for everyone); without
    # the swaps bound n2 is reported too, and no third gang of two nodes is ever granted.
    why = "straggler: step time 3.1x the gang's median"
    assert marked == [(SLOW, Admin.ACTIVE, None, [(spec.resources.team, "swapped", why)])]
    assert final.suspect_nodes == [SLOW]
    refused = final.failures[-1].reason
    assert refused.startswith(f"the ranks stopped at step {SWAPPED_AT} asking to swap out n2 ")
    assert "recovery.max_swaps = 1 swap(s): n2 is not cordoned" in refused
    attempts = [(a.generation, a.outcome, a.after) for a in final.gang_attempts]
    assert attempts == [
        (1, AttemptOutcome.SWAPPED, AttemptCause.START),
        (2, AttemptOutcome.FAILED, AttemptCause.SWAP),
        (3, AttemptOutcome.COMPLETED, AttemptCause.FAILURE),
    ]


def _swap_of(node_id: str) -> StragglerSwap:
    event = HealthEvent(generation=1, node_id=node_id, kind="straggler", step=SWAPPED_AT,
                        evidence="step time 3.1x the gang's median", action="swap")  # fmt: skip
    return StragglerSwap(event, SWAPPED_AT)


@pytest.mark.parametrize(
    ("policy", "max_swaps", "swaps", "why"),
    [
        ("swap", 2, 2, "the run has made its recovery.max_swaps = 2 swap(s)"),
        ("swap", 0, 0, "the run has made its recovery.max_swaps = 0 swap(s)"),
        ("report", 10, 0, 'recovery.straggler_policy is "report", not "swap"'),
        ("off", 10, 0, 'recovery.straggler_policy is "off", not "swap"'),
    ],
)
def test_a_swap_the_run_may_not_make_is_a_failure_that_blames_no_node(
    policy: str, max_swaps: int, swaps: int, why: str
) -> None:
    recovery = swapping_spec("r").recovery.model_copy(
        update={"straggler_policy": policy, "max_swaps": max_swaps}
    )
    now = datetime(2026, 12, 6, tzinfo=UTC)
    failure = swap_refused(_swap_of("n3"), recovery, swaps, 4, now)
    assert failure is not None and (failure.node_id, failure.generation) == (None, 4)
    assert f"asking to swap out n3 (step time 3.1x the gang's median), but {why}: n3 is not " \
        "cordoned" in failure.reason  # fmt: skip


def test_a_swap_within_max_swaps_is_made() -> None:
    recovery = swapping_spec("r", max_swaps=2).recovery
    assert swap_refused(_swap_of("n3"), recovery, 1, 4, datetime(2026, 12, 6, tzinfo=UTC)) is None
