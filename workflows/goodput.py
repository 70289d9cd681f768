"""Goodput: every GPU-second of a run, from its first gang request to the end of training, put
down to one cause. Pure and deterministic, so the workflow computes it and a query shows it.

The run's time is cut at each attempt's milestones. Before a grant the run waits (`queue`, or
`restart` when it waits because an attempt failed: backoff, a spare, the requeue). From the
grant to ready (ranks spawned, rendezvous, checkpoint loaded) it starts (`startup` the first
time, `restart` after). From ready to the end of the step whose checkpoint the run kept, the
ranks' own ledger splits the time into productive steps, `checkpoint stall`, `evaluation`,
`straggler` (waiting for the slowest rank), `shadow recompute` (the shadow checks' own work,
trainer.shadow_check) and `other` (logging, the loop's own overhead). What
follows that step is `rework` (steps whose checkpoint never came) and `failure detection` (the
silence until the gang was torn down) when the attempt failed, else `checkpoint stall` for the
final save and `teardown` for the exit. The wait for a new gang after swapping out a straggler
is put down to `straggler`; after a preemption, to `queue`; growing back a gang that a failure
shrank (elastic runs), to `restart`.

Everything is multiplied by the GPUs the run holds, so `productive / gpu_s` is the run's
goodput and `productive / allocated` what it made of the GPUs it was given.
"""

from __future__ import annotations

from datetime import datetime

from workflows.contracts.models import AttemptCause, AttemptOutcome, AttemptRecord, Goodput

CAUSES = (
    "queue",
    "startup",
    "restart",
    "checkpoint stall",
    "evaluation",
    "straggler",
    "shadow recompute",
    "pipeline bubble",
    "rework",
    "failure detection",
    "teardown",
    "other",
)


# What the wait for a gang is put down to, by what came before it: after a preemption the run
# queues like any other; a swap's wait is the straggler's cost; growing back a gang that a
# failure shrank is part of recovering from that failure.
_WAIT_CAUSE = {AttemptCause.START: "queue", AttemptCause.FAILURE: "restart",
               AttemptCause.PREEMPTION: "queue", AttemptCause.SWAP: "straggler",
               AttemptCause.GROW: "restart"}  # fmt: skip


def account(attempts: list[AttemptRecord], waited_from: datetime | None = None) -> Goodput | None:
    """The run's goodput over its finished attempts (None before the first one ends), its
    time counted from `waited_from` (the end of an earlier attempt no longer listed), else
    from the first attempt's request."""
    done = [a for a in attempts if a.ended_at is not None]
    if not done:
        return None
    lost = dict.fromkeys(CAUSES, 0.0)
    productive = allocated = total = 0.0
    waited_from = waited_from or done[0].requested_at
    for attempt in done:
        assert attempt.ended_at is not None
        gpus = attempt.gpus
        spent = _split(attempt, waited_from)
        productive += spent.pop("productive", 0.0) * gpus
        for cause, seconds in spent.items():
            lost[cause] += seconds * gpus
        allocated += _seconds(attempt.granted_at, attempt.ended_at) * gpus
        total += _seconds(waited_from, attempt.ended_at) * gpus
        waited_from = attempt.ended_at
    return Goodput(
        gpu_s=total,
        allocated_gpu_s=allocated,
        productive_gpu_s=productive,
        lost_gpu_s={cause: seconds for cause, seconds in lost.items() if seconds > 0},
        attempts=len(done),
    )


def combine(earlier: Goodput | None, later: Goodput | None) -> Goodput | None:
    """Two accounts of consecutive stretches of one run, as one."""
    if earlier is None or later is None:
        return earlier or later
    causes = {**earlier.lost_gpu_s, **later.lost_gpu_s}
    return Goodput(
        gpu_s=earlier.gpu_s + later.gpu_s,
        allocated_gpu_s=earlier.allocated_gpu_s + later.allocated_gpu_s,
        productive_gpu_s=earlier.productive_gpu_s + later.productive_gpu_s,
        lost_gpu_s={
            c: earlier.lost_gpu_s.get(c, 0.0) + later.lost_gpu_s.get(c, 0.0) for c in causes
        },
        attempts=earlier.attempts + later.attempts,
    )


def _split(attempt: AttemptRecord, waited_from: datetime) -> dict[str, float]:
    """One attempt's seconds by cause, from the end of the previous attempt to its own end."""
    assert attempt.ended_at is not None
    first = attempt.after == AttemptCause.START
    spent: dict[str, float] = {}

    def add(cause: str, seconds: float) -> None:
        spent[cause] = spent.get(cause, 0.0) + max(seconds, 0.0)

    add(_WAIT_CAUSE[attempt.after], _seconds(waited_from, attempt.granted_at))
    granted, ended = attempt.granted_at.timestamp(), attempt.ended_at.timestamp()
    ledger = attempt.ledger
    if ledger is None or ledger.ready_at is None:  # it never got as far as training
        add("startup" if first else "restart", ended - granted)
        return spent
    ready = min(max(ledger.ready_at, granted), ended)  # clocks of two machines: keep in order
    add("startup" if first else "restart", ready - granted)
    kept, last = ledger.kept, ledger.last
    secured = ready
    if kept is not None:
        secured = min(max(kept.at, ready), ended)
        add("productive", kept.train_s - kept.straggler_s - kept.shadow_s - kept.bubble_s)
        add("straggler", kept.straggler_s)
        add("pipeline bubble", kept.bubble_s)
        add("shadow recompute", kept.shadow_s)
        add("checkpoint stall", kept.stall_s)
        add("evaluation", kept.eval_s)
        add("other", (secured - ready) - (kept.train_s + kept.stall_s + kept.eval_s))
    heard = secured if last is None else min(max(last.at, secured), ended)
    if attempt.outcome == AttemptOutcome.FAILED:
        add("rework", heard - secured)
        add("failure detection", ended - heard)
    else:
        tail_stall = 0.0
        if last is not None:
            tail_stall = min(last.stall_s - (kept.stall_s if kept else 0.0), ended - secured)
        add("checkpoint stall", tail_stall)
        add("teardown", ended - secured - max(tail_stall, 0.0))
    return spent


def _seconds(start: datetime, end: datetime) -> float:
    return max((end - start).total_seconds(), 0.0)
