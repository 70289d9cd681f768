"""What a TrainingRun keeps of its past: bounded lists with totals beside them.

A run's status is the workflow's query result and travels whole when the run continues as new,
so it must stay small however long the run lives: a flapping node can fail, be preempted or
be swapped out hundreds of times in a month-long run. Each list keeps its newest entries and a
total; gang attempts that fall off the list are folded into one goodput account first, so the
run's goodput still covers every attempt. Pure functions over the status (no I/O, no time).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from workflows.contracts.models import (
    AttemptOutcome,
    AttemptRecord,
    Failure,
    PreemptionRecord,
    RunStatus,
)
from workflows.goodput import account, combine

T = TypeVar("T")

KEPT = 20  # failures, preemptions, skipped checkpoints: enough to diagnose, small to carry
ATTEMPTS_KEPT = 30  # gang attempts, each with its ledger (about 1 kB): the report plots them


def newest(items: list[T], new: Iterable[T], limit: int = KEPT) -> list[T]:
    return [*items, *new][-limit:]


def add_failures(status: RunStatus, failures: list[Failure]) -> None:
    status.failures_total = max(status.failures_total, len(status.failures)) + len(failures)
    status.failures = newest(status.failures, failures)


def add_preemption(status: RunStatus, record: PreemptionRecord) -> None:
    status.preemptions_total = max(status.preemptions_total, len(status.preemptions)) + 1
    status.preemptions = newest(status.preemptions, [record])


SUSPECTS_KEPT = 64  # nodes a run keeps off: more is a run whose ranks report every node


def add_suspects(status: RunStatus, node_ids: Iterable[str]) -> None:
    """Nodes the run's ranks reported, each once, the newest last."""
    fresh = [n for n in dict.fromkeys(node_ids) if n not in status.suspect_nodes]
    status.suspect_nodes = newest(status.suspect_nodes, fresh, SUSPECTS_KEPT)


def add_skipped(status: RunStatus, reasons: list[str]) -> None:
    """Checkpoints resume passed over, each reason once."""
    seen = status.skipped_checkpoints
    status.skipped_checkpoints = newest(seen, [why for why in reasons if why not in seen])


def add_attempt(status: RunStatus, attempt: AttemptRecord) -> None:
    """List a finished attempt and recount goodput over every attempt, listed or folded."""
    attempts = [*status.gang_attempts, attempt]
    if len(attempts) > ATTEMPTS_KEPT:
        folded, attempts = attempts[:-ATTEMPTS_KEPT], attempts[-ATTEMPTS_KEPT:]
        status.earlier_goodput = combine(
            status.earlier_goodput, account(folded, waited_from=status.earlier_ended_at)
        )
        status.earlier_ended_at = folded[-1].ended_at
    status.gang_attempts = attempts
    status.goodput = combine(
        status.earlier_goodput, account(attempts, waited_from=status.earlier_ended_at)
    )


def rewound(status: RunStatus, resume_step: int) -> list[AttemptRecord]:
    """The listed attempts whose kept checkpoint is newer than the step a later gang resumed
    from: its peer-tier copy was skipped (a node and its peer both died, a copy did not verify)
    and the gang went back to the store's. Their steps after `resume_step` were not kept."""
    return [
        a
        for a in status.gang_attempts
        if a.ledger is not None and a.ledger.kept is not None and a.ledger.kept.step > resume_step
    ]


def failed_in_a_row(status: RunStatus) -> int:
    """How many of the newest gang attempts failed one after another without progress between
    them: the first failure of a run that was training retries at once; only a failure that
    follows a failure backs off. An attempt that committed a checkpoint of its own before it
    failed made progress: the failures before it do not count."""
    count = 0
    for attempt in reversed(status.gang_attempts):
        if attempt.outcome != AttemptOutcome.FAILED:
            break
        count += 1
        ledger = attempt.ledger
        if ledger is not None and ledger.kept is not None and ledger.kept.step > ledger.resume_step:
            break
    return count
