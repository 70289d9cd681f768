"""The state transitions of the `Cluster` workflow, as plain functions of its state and time.

The workflow calls these (with `workflow.now()`) and the scheduler's simulator calls the very
same ones, so what the property tests exercise is what the cluster does.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.contracts.cluster_models import (
    MAX_ADVERTISED_CACHED,
    Allocation,
    ClusterState,
    Health,
    Node,
    NodeInfo,
    PreemptNotice,
)
from workflows.contracts.held_items import MAX_ADVERTISED_HELD
from workflows.contracts.names import GANG_GRANTED_SIGNAL, PREEMPT_SIGNAL
from workflows.scheduling.elastic import claim_holders
from workflows.scheduling.policy_switches import TODAY, Switches
from workflows.scheduling.quotas import decay_usage
from workflows.scheduling.scheduler import Decisions, expected_end, schedule

# A victim that has not released this long after its grace period is revoked by force.
REVOKE_MARGIN = timedelta(seconds=30)

Message = tuple[str, str, object]  # (run id, signal, argument) for the workflow to send


def node(state: ClusterState, node_id: str) -> Node | None:
    return state.node(node_id)


def bounded(info: NodeInfo) -> NodeInfo:
    """`info` with at most MAX_ADVERTISED_CACHED snapshots and MAX_ADVERTISED_HELD held
    entries, the first (agents list the most recently used first): an old agent's or a hostile
    one's list cannot grow the state."""
    if len(info.cached) <= MAX_ADVERTISED_CACHED and len(info.held) <= MAX_ADVERTISED_HELD:
        return info
    held = dict(list(info.held.items())[:MAX_ADVERTISED_HELD])
    return info.model_copy(update={"cached": info.cached[:MAX_ADVERTISED_CACHED], "held": held})


def as_granted(info: NodeInfo) -> NodeInfo:
    """A node as a gang carries it: where it is and its GPUs, not what it caches (nothing
    reads that of an allocation, which travels to the run and into every node's input)."""
    return info.model_copy(update={"cached": [], "held": {}}) if info.cached or info.held else info


def bound_cached(state: ClusterState) -> None:
    """Bound what a state from before the bound holds, before it is carried into a new run."""
    for each in state.nodes:
        each.info = bounded(each.info)
    for allocation in state.allocations:
        allocation.nodes = [as_granted(info) for info in allocation.nodes]


def allocation_of(state: ClusterState, run_id: str) -> Allocation | None:
    return next((a for a in state.allocations if a.run_id == run_id), None)


def account(state: ClusterState, now: datetime) -> None:
    """Charge GPU-seconds up to `now` and decay older usage (fair share)."""
    half_life_s = state.config.fair_share_half_life_h * 3600
    state.usage = decay_usage(state.usage, state.usage_at, now, half_life_s, state.allocations)
    elapsed = (now - state.usage_at).total_seconds() if state.usage_at is not None else 0.0
    if elapsed > 0:  # the time between failures: healthy nodes' time observed
        healthy = [n.health for n in state.nodes].count(Health.HEALTHY)
        state.node_seconds += healthy * elapsed
    state.usage_at = now


def free(state: ClusterState, allocation: Allocation, now: datetime) -> None:
    """Take an allocation's nodes back (charging its GPU-seconds up to now first)."""
    account(state, now)
    # By identity: `list.remove` would compare pydantic models field by field.
    at = next(i for i, a in enumerate(state.allocations) if a is allocation)
    del state.allocations[at]
    for info in allocation.nodes:
        held = state.node(info.node_id)
        if held is not None:
            held.jobs.pop(allocation.run_id, None)


def devices_for(allocation: Allocation, others: list[Allocation]) -> dict[str, list[int]]:
    """Which GPUs a gang that holds part of a node holds there: the lowest indices no other
    allocation on that node holds. Two jobs packed on one node (placement fills partly used
    nodes) must never be shown the same device while the node's other GPUs sit idle. Nodes held
    whole (every gang of more than one node) are not listed: all their GPUs are the gang's."""
    devices: dict[str, list[int]] = {}
    for info in allocation.nodes:
        wanted = allocation.held_on(info)
        if wanted >= info.gpus:
            continue
        taken = {
            i
            for other in others
            if any(n.node_id == info.node_id for n in other.nodes)
            for i in other.devices_on(info.node_id)
        }
        devices[info.node_id] = [i for i in range(info.gpus) if i not in taken][:wanted]
    return devices


def revoke_overdue(state: ClusterState, now: datetime) -> list[Allocation]:
    """Victims past their grace period (and the margin) lose their nodes by force."""
    revoked = [
        a
        for a in state.allocations
        if a.preempting is not None and now > a.preempting.deadline + REVOKE_MARGIN
    ]
    for allocation in revoked:
        free(state, allocation, now)
    return revoked


def prepare(state: ClusterState, now: datetime) -> list[Allocation]:
    """Before a pass: revoke overdue victims, account usage, drop stale claims."""
    revoked = revoke_overdue(state, now)
    account(state, now)
    holders = claim_holders(state)
    state.claims = [c for c in state.claims if c.until > now and c.run_id in holders]
    return revoked


def run_pass(
    state: ClusterState, now: datetime, switches: Switches = TODAY
) -> tuple[list[Allocation], Decisions, list[Message]]:
    """One scheduling pass: prepare, schedule, apply (`switches` as in `schedule`)."""
    revoked = prepare(state, now)
    decisions = schedule(state, now, switches)
    return revoked, decisions, apply(state, decisions, now)


def apply(state: ClusterState, decisions: Decisions, now: datetime) -> list[Message]:
    messages: list[Message] = []
    for each in state.nodes:
        spare = each.info.node_id in decisions.spares
        if each.spare != spare:  # pydantic's __setattr__ is slow: 2,500 nodes every pass
            each.spare = spare
    default_runtime_s = state.config.default_max_runtime_h * 3600
    by_id = {n.info.node_id: n for n in state.nodes} if decisions.grants else {}
    for request, node_ids in decisions.grants:
        nodes = [by_id.get(i) for i in node_ids]
        allocation = Allocation(
            run_id=request.run_id,
            generation=state.next_generation,
            nodes=[as_granted(n.info) for n in nodes if n is not None],
            gpus_per_node=request.gpus_per_node,
            team=request.team,
            priority=request.priority,
            preemptible=request.preemptible,
            granted_at=now,
            expected_end=expected_end(request, now, default_runtime_s),
            fleet_node_seconds=state.node_seconds,
            fleet_fail_stops=state.fail_stops,
            wanted=decisions.shrunk.get(request.run_id),
            yields_to=decisions.yielding.get(request.run_id),
            layout=request.layout,
        )
        for granted in nodes:
            assert granted is not None
            granted.jobs[request.run_id] = allocation.held_on(granted.info)
        allocation.devices = devices_for(allocation, state.allocations)
        state.next_generation += 1
        state.queue = [r for r in state.queue if r.run_id != request.run_id]
        state.claims = [c for c in state.claims if c.run_id != request.run_id]
        state.allocations.append(allocation)
        messages.append((allocation.run_id, GANG_GRANTED_SIGNAL, allocation))
    for run_id, preemption in decisions.preemptions:
        victim = allocation_of(state, run_id)
        if victim is None or victim.preempting is not None:
            continue
        victim.preempting = preemption
        notice = PreemptNotice(
            generation=victim.generation,
            grace_s=state.config.preemption_grace_s,
            reason=preemption.reason,
            grow_to=preemption.grow_to,
        )
        messages.append((run_id, PREEMPT_SIGNAL, notice))
    state.claims.extend(decisions.claims)
    state.reservation = decisions.reservation
    state.reservations = decisions.reservations
    state.waiting = decisions.waiting
    return messages
