"""A gang that resumes from an older checkpoint than the failed attempt before it kept (its
peer-tier copy could not be assembled, so the ranks went back to the store's) turns that
attempt's steps since into rework: the workflow reads its ledger again, kept at most at the
step the new gang resumed from, and the run's goodput counts them lost.

The real TrainingRun and Cluster workflows on the dev server; the node's and the control
worker's activities answer as the agent and the store would: the second gang is sent to the
peer tier (the store's step as its fallback), and its ranks say why they fell back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.workflows.test_cluster_workflow import node
from tests.workflows.test_dead_node import Survivors
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    awaiting_approval,
    one_node_spec,
    record_histories,
    stack_workers,
    start_cluster_and_run,
    terminated_after,
)
from workflows.cluster import ClusterWorkflow
from workflows.contracts.models import (
    AttemptLedger,
    AttemptLedgerInput,
    CheckpointRef,
    LatestCheckpointInput,
    LedgerMark,
    Phase,
    RunStatus,
)

LABEL = "2026-12-04-fallback"
STORE_STEP, PEER_STEP = 40, 60  # the store's newest checkpoint, and the peer tier's after it
TRAINS_S = 5  # generation 1, before its peer vanishes
# What the second gang's ranks say when they cannot assemble the peer checkpoint.
SKIPPED = (
    f"peer checkpoint step {PEER_STEP} (generation 1) skipped: __0_0.distcp: n0's copy does "
    "not verify (size or sha256)"
)


def _mark(step: int, at: float, train_s: float) -> LedgerMark:
    return LedgerMark(step=step, at=at, train_s=train_s, stall_s=0.0, eval_s=0.0, straggler_s=0.0)


class Ledgers(Control):
    """The ranks' ledgers: generation 1 committed the store step and then the peer step; the
    gang after it resumed from the store step (the peer copy was skipped)."""

    def __init__(self, agent: Survivors) -> None:
        super().__init__(agent)  # type: ignore[arg-type]  # it reads .step alone
        self.asked: list[tuple[int, int | None, bool]] = []
        self.first_ended: float | None = None

    @activity.defn(name="latest_checkpoint")
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        """For the second gang: generation 1's peer-tier step, the store's as its fallback."""
        if not (inp.new_gang and inp.max_generation == 2):
            return await super().latest_checkpoint(inp)
        stored = CheckpointRef(manifest_key=f"runs/{inp.run_id}/checkpoints/step-{STORE_STEP}/"
                               "gen-1/MANIFEST.json", step=STORE_STEP, generation=1,
                               tokens_seen=STORE_STEP * 64)  # fmt: skip
        return CheckpointRef(manifest_key=f"runs/{inp.run_id}/peer/step-{PEER_STEP}/gen-1/"
                             "MANIFEST.json", step=PEER_STEP, generation=1,
                             tokens_seen=PEER_STEP * 64, tier="peer", fallback=stored)  # fmt: skip

    @activity.defn(name="attempt_ledger")
    async def attempt_ledger(self, inp: AttemptLedgerInput) -> AttemptLedger | None:
        self.asked.append((inp.generation, inp.kept_step, inp.kept_at_most))
        if inp.generation == 1:
            t = self.first_ended = self.first_ended or time.time()
            commits = {STORE_STEP: _mark(STORE_STEP, t - 2.0, 1.0),
                       PEER_STEP: _mark(PEER_STEP, t - 1.0, 2.0)}  # fmt: skip
            kept = PEER_STEP if inp.kept_step is None else inp.kept_step
            return AttemptLedger(resume_step=0, ready_at=t - 3.0, kept=commits[kept],
                                 last=_mark(PEER_STEP + 5, t - 0.5, 2.5))  # fmt: skip
        done = _mark(STEPS, time.time() - 0.1, 0.9)
        return AttemptLedger(resume_step=STORE_STEP, ready_at=done.at - 0.9, kept=done, last=done)


def test_steps_after_a_skipped_peer_checkpoint_count_as_rework(
    temporal_address: str, task_queue: str
) -> None:
    spec = one_node_spec("fallback")

    async def main() -> tuple[Ledgers, RunStatus, list[CheckpointRef | None]]:
        client = await Client.connect(temporal_address, data_converter=pydantic_data_converter)
        # n0's agent: generation 1 trains a few seconds (the ledger's marks fall within the
        # attempt), then fails as ranks whose peer vanished do; generation 2 trains to the end.
        agent = Survivors()
        agent.skipped = [SKIPPED]
        control = Ledgers(agent)
        nodes = {"n0": [agent.train_on_node, agent.node_alive]}
        workers = stack_workers(client, task_queue, control, nodes)
        async with contextlib.AsyncExitStack() as stack:
            cluster, handle = await start_cluster_and_run(stack, client, workers, task_queue, spec)
            async with terminated_after(handle, cluster):
                await cluster.signal(ClusterWorkflow.register_node, node("n0"))
                asyncio.get_running_loop().call_later(TRAINS_S, agent.peer_dead.set)
                final = await awaiting_approval(handle)
                await record_histories(LABEL, handle)
                return control, final, agent.resumes

    control, status, agent_resumes = asyncio.run(main())
    assert status.phase == Phase.AWAITING_APPROVAL, status
    # Generation 1's ledger is read when it fails, and again, kept at most at the store step,
    # once generation 2 says it resumed from there.
    assert control.asked == [(1, None, False), (2, STEPS, False), (1, STORE_STEP, True)]
    # The second gang was sent to the peer tier, the store's step as its fallback, and its
    # ranks said why they fell back: `forgeline status` lists it.
    told = agent_resumes[1]
    assert told is not None and (told.tier, told.step, told.fallback.step) == (
        "peer",
        PEER_STEP,
        STORE_STEP,
    )
    assert status.skipped_checkpoints == [SKIPPED]
    first, second = status.gang_attempts
    assert first.outcome == "failed" and second.ledger.resume_step == STORE_STEP
    assert first.ledger.kept.step == STORE_STEP
    # Generation 1's productive time is its training to the store step (1 s), not to the peer
    # step (2 s); the rest, to the last step heard of, is rework: about 0.5 s before, 1.5 s now.
    goodput = status.goodput
    assert goodput.productive_gpu_s == pytest.approx((1.0 + 0.9) * first.gpus), goodput
    assert goodput.lost_gpu_s["rework"] == pytest.approx(1.5 * first.gpus, abs=0.3), goodput
