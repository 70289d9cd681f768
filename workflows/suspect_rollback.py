"""How far a corruption verdict rolls a run back: to before the first suspect its node raised.

A device that is wrong rather than dead often shows it first as a finite outlier (a `suspect`
health event, trainer.spike_watch) and only later as a NaN, the verdict that stops the gang.
The checkpoints committed between the two may hold what the device got wrong, so the next
gang resumes from the last one committed before the first suspect step of that node in that
generation, not from the last one. The resume is fenced at that step (as `forgeline resume
--from` is): the later checkpoints are passed over by every resume and by registration (a
later lookup names them as stale in `forgeline status`).
"""

from __future__ import annotations

from workflows.contracts.models import HealthEvent


def rollback_step(
    health: list[HealthEvent], blamed: list[tuple[str, str, str]], generation: int
) -> int | None:
    """The newest step the next gang may resume from, or None where the last checkpoint will
    do: no node was quarantined for corruption, or none of them raised a suspect first."""
    quarantined = {node for node, _, kind in blamed if kind == "corruption"}
    steps = [
        e.step
        for e in health
        if e.kind == "suspect"
        and e.generation == generation
        and e.node_id in quarantined
        and e.step is not None
    ]
    return min(steps) - 1 if steps else None
