"""Where a node death's recovery time goes, from the run's own records: the soak's target is
under 10 s at p95 with a node free, and the total alone does not say what to make faster.

A recovery runs from the fault to the run's first step on a new gang, in five parts:

- detect: the fault until the workflow ended the gang it hit (a heartbeat missed, the peers'
  activities failed or cancelled, the survivors' ranks stopped);
- regrant: that end until the next gang that trained was granted (the release, the request,
  the placement; gangs that failed before a step in between count here);
- launch: the grant until the user's script (here the built-in trainer) started on it (the
  agents picked the work up, fetched what the job reads, started torchrun and the ranks);
- restore: the script's start until its checkpoint was restored (`run.restore` returned);
- first step: the restore until its first step was done.

The first two come from the workflow's attempt records (`RunStatus.gang_attempts`), the rest
from the new gang's progress lines (epoch seconds, written by its ranks).
"""

from __future__ import annotations

import statistics

from bench.soak_plan import RecoveryPhases
from workflows.contracts.models import AttemptRecord

PARTS = ("detect", "regrant", "launch", "restore", "first_step")


def phases(
    fault_at: float,
    generation: int,
    attempts: list[AttemptRecord],
    events: dict[int, list[dict]],
) -> RecoveryPhases | None:
    """The parts of one recovery: the fault at `fault_at` (epoch seconds) hit the gang of
    `generation`; `events` holds each generation's progress lines. None where the run never
    trained again, or its records lack a part."""
    hit = next((a for a in attempts if a.generation == generation), None)
    later = [a for a in attempts if a.generation > generation and _first(events, a, "step")]
    if hit is None or hit.ended_at is None or not later:
        return None
    nxt = min(later, key=lambda a: a.generation)
    started = _first(events, nxt, "sdk", call="script", state="entered")
    restored = _first(events, nxt, "sdk", call="restore", state="returned")
    stepped = _first(events, nxt, "step")
    if started is None or restored is None or stepped is None:
        return None
    ended, granted = hit.ended_at.timestamp(), nxt.granted_at.timestamp()
    return RecoveryPhases(
        detect=ended - fault_at,
        regrant=granted - ended,
        launch=started - granted,
        restore=restored - started,
        first_step=stepped - restored,
    )


def _first(events: dict[int, list[dict]], attempt: AttemptRecord, kind: str, **fields: str
           ) -> float | None:  # fmt: skip
    """When the gang's first line of this kind was written (the earliest of its ranks')."""
    times = [
        e["time"]
        for e in events.get(attempt.generation, [])
        if e["event"] == kind and all(e.get(k) == v for k, v in fields.items())
    ]
    return min(times) if times else None


def medians(found: list[RecoveryPhases]) -> dict[str, float]:
    """Each part's median over several recoveries."""
    return {part: statistics.median(getattr(p, part) for p in found) for part in PARTS}
