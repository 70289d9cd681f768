"""A preempted run, in seconds: the real TrainingRun and Cluster workflows on the dev server with
stand-in activities. The gang checkpoints when told, gives its nodes back, queues again, and the
next gang resumes from that checkpoint. (The slow test in test_training_run_history.py does
this three dozen times, to see the history continue as new.)"""

from __future__ import annotations

import asyncio

from tests.workflows.test_cluster_workflow import eventually
from tests.workflows.test_training_run_history import (
    STEPS,
    Control,
    Node,
    _status,
    on_one_node,
    one_node_spec,
)
from workflows.contracts.cluster_models import PreemptNotice
from workflows.contracts.models import AttemptCause, AttemptOutcome, Phase, RunStatus
from workflows.contracts.names import PREEMPT_SIGNAL


def test_a_preempted_run_checkpoints_queues_again_and_resumes(
    temporal_address: str, task_queue: str
) -> None:
    spec = one_node_spec("preempted")

    async def main() -> tuple[RunStatus, list[int | None], list[int | None]]:
        agent = Node(finish_after=1)
        control = Control(agent)
        async with on_one_node(temporal_address, task_queue, spec, control, agent) as run:
            training = lambda s: s.phase == Phase.TRAINING and s.generation == 1  # noqa: E731
            await eventually(lambda: _status(run), training, timeout=30)
            notice = PreemptNotice(generation=1, grace_s=30, reason="a team reclaims")
            await run.signal(PREEMPT_SIGNAL, notice)
            final = await eventually(
                lambda: _status(run), lambda s: s.phase == Phase.AWAITING_APPROVAL, timeout=60
            )
            return final, control.fenced_at_most, [f for _, f in control.fences]

    final, looked, fenced_at = asyncio.run(main())
    assert final.phase == Phase.AWAITING_APPROVAL, final
    attempts = [(a.generation, a.outcome, a.after) for a in final.gang_attempts]
    assert attempts == [
        (1, AttemptOutcome.PREEMPTED, AttemptCause.START),
        (2, AttemptOutcome.COMPLETED, AttemptCause.PREEMPTION),
    ]
    assert final.preemptions_total == 1 and final.preemptions[0].reason == "a team reclaims"
    # Each gang looked up where to start and was fenced there: the first at the start, the
    # second at the step the first checkpointed when told to stop.
    assert looked == [None, None] and fenced_at == [0, 1]
    assert final.last_checkpoint is not None and final.last_checkpoint.step == STEPS
