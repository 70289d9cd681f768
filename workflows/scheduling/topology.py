"""The fabric's levels: where a gang goes inside them, and how to say where it went.

A cluster declares levels inside a pod, widest first (`ClusterConfig.levels`, e.g. block, rack);
each node reports its unit at every level (`NodeInfo.topology`). A node's path is its pod, then
its unit at each level. Two gangs of the same size can differ by a third in step time depending
on how many racks their all-reduce crosses, so a gang goes:

- inside the smallest unit that holds it, at the lowest level where one does (a rack if one is
  free, else a block, else a pod): big units stay free for big gangs;
- across the fewest units otherwise, level by level: the fewest pods, in each the fewest
  blocks, in each the fewest racks (the biggest first, so the count is the least there is).

A request may require a level (`GangRequest.topology`): all of it inside one unit of that level,
or it waits; with `topology_wait_s` it waits that long at most, then takes the fewest units.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import datetime

from workflows.contracts.cluster_models import GangRequest, NodeInfo

Path = tuple[str, ...]  # (pod, unit at each level, widest first)
Order = Callable[[set[str]], list[str]]  # the nodes of one unit, the ones to take first first
Fetched = Callable[[set[str], int], int]  # bytes the best `count` nodes of a set would fetch


def path(info: NodeInfo, levels: tuple[str, ...]) -> Path:
    """A node without a label for a level is a unit of its own there: nothing says it is near
    any other node, so it never lets a gang count as inside one rack."""
    return (info.pod, *(info.topology.get(level) or f"?{info.node_id}" for level in levels))


def names(levels: Iterable[str]) -> list[str]:
    """Every level a request may name, widest first."""
    return ["pod", *levels]


def depth_of(level: str, levels: tuple[str, ...]) -> int | None:
    """How many path entries a unit of `level` is named by, minus one (pod: 0); None: unknown."""
    every = names(levels)
    return every.index(level) if level in every else None


def unknown_level(request: GangRequest, levels: tuple[str, ...]) -> str | None:
    """Why a request's level can never be had here, with the fix; None: it can."""
    if request.topology is None or depth_of(request.topology, levels) is not None:
        return None
    return (
        f"resources.topology names level {request.topology!r}, which this cluster does not "
        f"declare (its levels: {', '.join(names(levels))}): use one of those, or leave it out"
    )


def in_force(request: GangRequest, now: datetime) -> GangRequest:
    """The request as placement sees it now: once its `topology_wait_s` is over, its level is
    only a preference, which the default packing already follows."""
    if request.topology is None or request.topology_wait_s is None:
        return request
    since = request.waiting_since or request.submitted_at
    waited = (now - since).total_seconds() if since is not None else 0.0
    if waited < request.topology_wait_s:
        return request
    return request.model_copy(update={"topology": None})


def choose(
    by_path: dict[Path, set[str]],
    count: int,
    order: Order,
    required_depth: int | None = None,
    across_pods: bool = True,
    fetched: Fetched | None = None,
) -> list[str] | None:
    """`count` of the nodes in `by_path` as the module says, or None. `required_depth`: the
    gang must fit one unit of that depth (0: a pod). `fetched`: between the units of the
    lowest level that hold the gang, the one where its nodes fetch the fewest bytes wins
    (then the smallest): topology first, then what must be copied."""
    if sum(len(ids) for ids in by_path.values()) < count:
        return None
    depth = len(next(iter(by_path)))
    for k in range(depth - 1, -1, -1):  # the lowest level first
        if required_depth is not None and k < required_depth:
            return None
        units = _units(by_path, k)
        fitting = [
            (fetched(ids, count) if fetched else 0, len(ids), prefix)
            for prefix, ids in units.items()
            if len(ids) >= count
        ]
        if fitting:
            *_, prefix = min(fitting)  # the smallest that holds it; by name between equals
            inside = {p: ids for p, ids in by_path.items() if p[: k + 1] == prefix}
            return _fewest(inside, count, k + 1, order)
    if required_depth is not None or not across_pods:
        return None
    return _fewest(by_path, count, 0, order)


def _units(by_path: dict[Path, set[str]], k: int) -> dict[Path, set[str]]:
    """The nodes of each unit at depth `k`, by the unit's path (read only)."""
    if k + 1 == len(next(iter(by_path))):
        return by_path  # the deepest level: the paths are the units (no copy of 2,500 ids)
    units: dict[Path, set[str]] = defaultdict(set)
    for p, ids in by_path.items():
        units[p[: k + 1]] |= ids
    return units


def _fewest(by_path: dict[Path, set[str]], count: int, k: int, order: Order) -> list[str]:
    """`count` nodes over the fewest units at depth `k`, then the same one level down."""
    depth = len(next(iter(by_path)))
    if k == depth:  # one leaf unit: which of its nodes
        (ids,) = by_path.values()
        return order(ids)[:count]
    units = _units(by_path, k)
    fitting = [(len(ids), prefix) for prefix, ids in units.items() if len(ids) >= count]
    if fitting:
        chosen = [min(fitting)[1]]
    else:  # the biggest first: the fewest units that add up to `count`
        chosen = sorted(units, key=lambda prefix: (-len(units[prefix]), prefix))
    taken: list[str] = []
    for prefix in chosen:
        want = min(count - len(taken), len(units[prefix]))
        inside = {p: ids for p, ids in by_path.items() if p[: k + 1] == prefix}
        taken += _fewest(inside, want, k + 1, order)
        if len(taken) == count:
            break
    return taken


def landed(nodes: list[NodeInfo], levels: tuple[str, ...]) -> str:
    """Where a gang is, in the fabric's words: "rack p0/b1/r3", "block p0/b1: 2 racks",
    "2 pods: 3 blocks, 5 racks"."""
    if not nodes:
        return "-"
    paths = {path(info, levels) for info in nodes}
    every = names(levels)
    shared = 0  # how many leading entries all paths share
    while shared < len(every) and len({p[: shared + 1] for p in paths}) == 1:
        shared += 1
    spread = ", ".join(
        f"{len({p[: k + 1] for p in paths})} {every[k]}s" for k in range(shared, len(every))
    )
    if shared == 0:
        return spread
    prefix = next(iter(paths))[:shared]
    where = f"{every[shared - 1]} {'/'.join(prefix)}"
    return f"{where}: {spread}" if spread else where


def one_unit(request: GangRequest) -> str:
    """What a request waits for, said in its waiting reason: " in one rack", or nothing."""
    return f" in one {request.topology}" if request.topology else ""
