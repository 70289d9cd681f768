"""Which parts of the scheduling policy a pass runs (`workflows.scheduling.scheduler.schedule`).

The defaults are the policy the cluster runs. Each part added since the first recorded
histories has a switch, for two readers: the `Cluster` workflow, which turns a part on only
where `workflow.patched` says the history was recorded with it (so an old history replays
under the policy it was recorded with), and the simulator, which compares the policies side by
side (`forgeline simulate --compare`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switches:
    # Strict arrival order, ignoring priority and fair share (the simulator's `fifo`).
    arrival_order: bool = False
    # False: nothing starts behind the head of the line.
    backfill: bool = True
    # False: a team never reclaims its guarantee from borrowers.
    preemption: bool = True
    # Every long-waiting request gets a reservation of its own, kept from pass to pass; just
    # granted gangs are shielded from preemption (the scheduler's module docstring).
    starvation_guard: bool = True
    # With the guard: a reservation starts by `start_within_s` after its owner's submission.
    start_deadline: bool = True
    # With the deadline: preemptible requests may run on reserved nodes until the reservation
    # is about to start (`workflows.scheduling.yielding`).
    yielding_backfill: bool = True
    # With yielding: a yielder goes to the reservation that starts latest, not the first in
    # line that could lend it nodes (`workflows.scheduling.yielding.latest_first`).
    yield_latest_first: bool = True
    # With the guard: the spare pool never refills from idle nodes that last pass's
    # reservations hold (`workflows.scheduling.scheduler.choose_spares`).
    spares_off_reservations: bool = True
    # A request within its team's guarantee preempts borrowers only once it has waited
    # `reclaim_after_s` since its submission (`workflows.scheduling.preemption.reclaims_now`).
    reclaim_patience: bool = True


TODAY = Switches()
