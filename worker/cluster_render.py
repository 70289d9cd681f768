"""The cluster in the terminal: nodes, queues (teams) and jobs."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.table import Table

from workflows.contracts.cluster_models import Allocation, ClusterState
from workflows.scheduling import hot_pool, node_reports
from workflows.scheduling.quotas import borrowed, in_use
from workflows.scheduling.topology import landed


def nodes_table(state: ClusterState, now: datetime | None = None) -> Table:
    table = Table(title="nodes")
    hot = set(hot_pool.targets(state, now or datetime.now(UTC))) if hot_pool.on(state) else set()
    # Where each node sits inside its pod, when the fabric is described at all.
    placed = bool(state.config.levels) or any(n.info.topology for n in state.nodes)
    for column in (
        "node",
        "pod",
        *(["position"] if placed else []),
        "address",
        "type",
        "GPUs used",
        "state",
        "jobs",
        "holds",
        "user code",
        "note",
    ):
        table.add_column(column)
    for node in sorted(state.nodes, key=lambda n: n.info.node_id):
        table.add_row(
            node.info.node_id,
            node.info.pod,
            *([_position(node.info.topology, state.config.levels)] if placed else []),
            node.info.host,
            node.info.gpu_type,
            f"{node.used}/{node.info.gpus}",
            node.state,
            ", ".join(f"{run} ({gpus})" for run, gpus in sorted(node.jobs.items())) or "-",
            _holds(node.info.holdings, hot),
            _user_code(node.info.confinement, node.info.container_runtime),
            _short(node.down_reason or node_reports.suspicion(node, state.config)),
        )
    return table


def _user_code(confinement: str, container_runtime: str = "") -> str:
    """How the node runs users' code (NodeInfo.confinement), in a word or two, and what runs
    their images if anything does ("boxed, podman"); the reason is in `forgeline nodes --json`."""
    mode = confinement.partition(":")[0]
    shown = {"box": "boxed", "": "?"}.get(mode, mode.upper() if mode == "unconfined" else mode)
    return f"{shown}, {container_runtime.split()[0]}" if container_runtime else shown


def _position(topology: dict[str, str], levels: list[str]) -> str:
    """A node's units inside its pod, in the cluster's order of levels: "b1/r3"; a level it
    reports no unit for shows as "?" (placement counts it as a unit of its own)."""
    if not levels:
        return ", ".join(f"{level}={unit}" for level, unit in sorted(topology.items())) or "-"
    return "/".join(topology.get(level, "?") for level in levels)


def _holds(held: dict[str, int], hot: set[str], shown: int = 3) -> str:
    """What a node's cache holds whole, with sizes, the hot pool's models marked:
    "ckpt-9c0d… (140 MB, hot), 4f2a…e1 (1.2 GB)"."""
    items = []
    for item, size in held.items():
        notes = ([_size(size)] if size else []) + (["hot"] if item in hot else [])
        items.append(f"{item} ({', '.join(notes)})" if notes else item)
    more = f", +{len(items) - shown}" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more or "-"


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _short(note: str, width: int = 60) -> str:
    """A node's note in one table line; the whole story is in the run's `forgeline status`."""
    return note if len(note) <= width else note[: width - 1] + "…"


def hot_pool_lines(state: ClusterState, now: datetime) -> list[str]:
    """What the hot pool holds where, against its targets, and the disk it takes."""
    if not hot_pool.on(state):
        return []
    view = hot_pool.pool_view(state, now)
    lines = [
        f"hot pool: {view.nodes_holding} of {view.schedulable} nodes hold a hot base model "
        f"(hot_fraction {state.config.hot_fraction:g}), {_size(view.bytes_held)} of node disk "
        f"held for it, {view.warming} node(s) fetching now"
    ]
    lines += [
        f"  {item}: on {holders} of {target} node(s), {_size(held)}"
        for item, holders, target, held in view.models
    ]
    return lines


def queues_table(state: ClusterState) -> Table:
    config = state.config
    used = in_use(config, state.allocations)
    lenders = borrowed(config, state.allocations)
    names = sorted(
        {q.name for q in config.queues}
        | {a.team for a in state.allocations}
        | {r.team for r in state.queue}
    )
    table = Table(title="queues")
    for column in ("queue", "parent", "guaranteed", "max", "in use", "borrowed", "pending"):
        table.add_column(column, justify="left" if column in ("queue", "parent") else "right")
    for name in names:
        queue = config.queue(name)
        borrowed_gpus = sum(
            a.gpus for a in state.allocations if a.team == name and a.run_id in lenders
        )
        pending = sum(r.gpus for r in state.queue if r.team == name)
        table.add_row(
            name,
            queue.parent or "-",
            str(queue.guaranteed_gpus),
            "-" if queue.max_gpus is None else str(queue.max_gpus),
            str(used.get(name, 0)),
            str(borrowed_gpus),
            str(pending),
        )
    return table


def _devices_held(allocation: Allocation, node_id: str) -> str:
    """ " (GPUs 4-7)" where the job holds part of a node (a node held whole says nothing)."""
    held = allocation.devices.get(node_id)
    if not held:
        return ""
    runs: list[list[int]] = []
    for index in held:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    spans = [f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs]
    return f" (GPU{'s' if len(held) > 1 else ''} {','.join(spans)})"


def jobs_table(state: ClusterState) -> Table:
    table = Table(title="jobs")
    for column in ("job", "team", "GPUs", "priority", "state", "position", "why / where"):
        table.add_column(column)
    levels = tuple(state.config.levels)
    for allocation in sorted(state.allocations, key=lambda a: a.run_id):
        where = ", ".join(
            n.node_id + _devices_held(allocation, n.node_id) for n in allocation.nodes
        )
        if len(allocation.nodes) > 1:  # a one-node job is inside every unit there is
            where += f" · {landed(allocation.nodes, levels)}"
        if allocation.layout:
            where += f" · {allocation.layout}"
        if allocation.preempting:
            what = f"preempting ({allocation.preempting.reason}) on {where}"
        else:
            what = f"generation {allocation.generation} on {where}"
            if allocation.yields_to:
                what += f" (lent: leaves when {allocation.yields_to} can start)"
        table.add_row(
            allocation.run_id,
            allocation.team,
            str(allocation.gpus),
            str(allocation.priority),
            "running",
            "-",
            what,
        )
    waiting = {w.run_id: w for w in state.waiting}
    for request in state.queue:
        reason = waiting.get(request.run_id)
        table.add_row(
            request.run_id,
            request.team,
            str(request.gpus),
            str(request.priority),
            "waiting",
            str(reason.position + 1) if reason else "-",
            reason.reason if reason else "not scheduled yet",
        )
    return table
