"""Where a gang goes: all of its nodes or none, packed so the cluster stays useful.

Multi-node gangs take whole idle nodes, inside the smallest unit of the fabric that holds them
at the lowest level it can (a rack, a block, a pod: `workflows.scheduling.topology`), across the
fewest units otherwise (the fewest pods when the request allows more than one). Single-node
jobs take the best fit: the node with the fewest free GPUs that still holds them, so whole nodes
stay whole. Nodes that already cache the run's dataset win ties.

`Capacity` indexes free GPUs by (GPU type, pod) and by free count, so one placement costs about
the number of pods, not the number of nodes: a pass over a thousand requests on 2,500 nodes
stays in milliseconds. A cluster with levels inside its pods groups a pod's idle nodes by their
path there, which costs its idle nodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from workflows.contracts.cluster_models import GangRequest, NodeInfo
from workflows.contracts.held_items import bytes_to_fetch
from workflows.scheduling.topology import Path, choose, depth_of, path

_PREFERENCE_SCAN = 64  # how deep a bucket is searched for a node holding the run's data


class Capacity:
    """Free GPUs of the nodes a request may use; `take` and `give` keep the indexes current."""

    def __init__(self, nodes: Iterable[tuple[NodeInfo, int]], levels: tuple[str, ...] = ()) -> None:
        self.levels = levels  # the cluster's levels inside a pod (ClusterConfig.levels)
        self.info: dict[str, NodeInfo] = {}
        self.free: dict[str, int] = {}
        # (gpu_type, pod) -> ids of nodes with no job at all: the gang placement index
        self.whole: dict[tuple[str, str], set[str]] = defaultdict(set)
        # (gpu_type, free GPUs) -> ids: the best-fit index for single-node jobs
        self.by_free: dict[tuple[str, int], set[str]] = defaultdict(set)
        self.largest: dict[str, int] = {}  # gpu_type -> GPUs of its biggest node
        self.free_by_type: dict[str, int] = defaultdict(int)
        self._index_all(nodes)

    def _index_all(self, nodes: Iterable[tuple[NodeInfo, int]]) -> None:
        """`add` for many nodes at once, with the lookups hoisted: every scheduling pass builds
        its pools from all 2,500 nodes, and the per-call overhead was most of a pass."""
        info_of, free_of, whole, by_free = self.info, self.free, self.whole, self.by_free
        largest, free_by_type = self.largest, self.free_by_type
        for info, free in nodes:
            node_id, gpus, gpu_type = info.node_id, info.gpus, info.gpu_type
            if node_id in info_of:
                self.add(info, free)
                continue
            if gpus > largest.get(gpu_type, 0):
                largest[gpu_type] = gpus
            info_of[node_id] = info
            free = min(gpus, free)
            free_of[node_id] = free
            if free > 0:
                by_free[(gpu_type, free)].add(node_id)
            if free == gpus:
                whole[(gpu_type, info.pod)].add(node_id)
            free_by_type[gpu_type] += free

    def add(self, info: NodeInfo, free: int) -> None:
        node_id = info.node_id
        self.largest[info.gpu_type] = max(self.largest.get(info.gpu_type, 0), info.gpus)
        if node_id in self.info:  # already here: take the indexed path
            self.free[node_id] = 0
            self.give(node_id, free)
            return
        # A new node (every pass builds thousands): index it directly, as `give` would.
        self.info[node_id] = info
        free = min(info.gpus, free)
        self.free[node_id] = free
        if free > 0:
            self.by_free[(info.gpu_type, free)].add(node_id)
        if free == info.gpus:
            self.whole[(info.gpu_type, info.pod)].add(node_id)
        self.free_by_type[info.gpu_type] += free

    def copy(self) -> Capacity:
        clone = Capacity((), self.levels)
        clone.info = dict(self.info)
        clone.free = dict(self.free)
        clone.whole = defaultdict(set, {k: set(v) for k, v in self.whole.items()})
        clone.by_free = defaultdict(set, {k: set(v) for k, v in self.by_free.items()})
        clone.largest = dict(self.largest)
        clone.free_by_type = defaultdict(int, self.free_by_type)
        return clone

    def total_free(self, gpu_type: str | None) -> int:
        if gpu_type is None:
            return sum(self.free_by_type.values())
        return self.free_by_type.get(gpu_type, 0)

    def _unindex(self, node_id: str) -> None:
        info, free = self.info[node_id], self.free[node_id]
        self.by_free[(info.gpu_type, free)].discard(node_id)
        self.whole[(info.gpu_type, info.pod)].discard(node_id)
        self.free_by_type[info.gpu_type] -= free

    def _index(self, node_id: str) -> None:
        info, free = self.info[node_id], self.free[node_id]
        if free > 0:
            self.by_free[(info.gpu_type, free)].add(node_id)
        if free == info.gpus:
            self.whole[(info.gpu_type, info.pod)].add(node_id)
        self.free_by_type[info.gpu_type] += free

    def take(self, node_id: str, gpus: int) -> None:
        self._unindex(node_id)
        self.free[node_id] -= gpus
        self._index(node_id)

    def give(self, node_id: str, gpus: int) -> None:
        if node_id not in self.info:
            return
        self._unindex(node_id)
        self.free[node_id] = min(self.info[node_id].gpus, self.free[node_id] + gpus)
        self._index(node_id)

    def merged(self, other: Capacity) -> Capacity:
        """A copy holding this capacity's nodes and `other`'s (disjoint sets of nodes)."""
        both = self.copy()
        for node_id, free in other.free.items():
            both.add(other.info[node_id], free)
        return both

    def split(self, node_ids: list[str]) -> Capacity:
        """Move `node_ids` (with their free GPUs) out of this capacity into a new one."""
        moved = Capacity(
            ((self.info[i], self.free[i]) for i in node_ids if i in self.free), self.levels
        )
        for node_id in moved.free:
            self.take(node_id, self.free[node_id])
        return moved


def _types(capacity: Capacity, wanted: str | None) -> list[str]:
    types = capacity.largest
    return sorted(types) if wanted is None else [wanted] if wanted in types else []


class _Fetch:
    """What a node would have to fetch for a request: the bytes of what the run reads
    (`GangRequest.needs`) that the node does not hold. A request from before `needs` names only
    its dataset (`cache_items`), which then costs 1 where it is missing: the tie-break it was."""

    def __init__(self, request: GangRequest, capacity: Capacity) -> None:
        self.needs = request.needs or dict.fromkeys(request.cache_items, 0)
        self.by_bytes = bool(request.needs)  # placement goes by bytes first, not by packing
        self.capacity = capacity

    def __call__(self, node_id: str) -> int:
        if not self.needs:
            return 0
        return bytes_to_fetch(self.needs, self.capacity.info[node_id].holdings)

    def order(self, ids: Iterable[str]) -> list[str]:
        """The nodes that fetch least first, then by id (replays choose the same nodes)."""
        ordered = sorted(ids)
        return sorted(ordered, key=self) if self.needs else ordered

    def least(self, ids: set[str], count: int) -> int:
        """The bytes the `count` nodes of `ids` that fetch least would fetch together."""
        return sum(sorted(map(self, ids))[:count]) if self.needs else 0


def place(request: GangRequest, capacity: Capacity) -> list[str] | None:
    """Node ids for the whole gang, or None: never part of one. Never a node the run's own
    ranks reported (`GangRequest.avoid`, workflows.scheduling.node_reports)."""
    fetch = _Fetch(request, capacity)
    if request.nodes == 1:
        return _best_fit(request, capacity, fetch)
    for gpu_type in _types(capacity, request.gpu_type):
        chosen = _whole_nodes(request, capacity, gpu_type, fetch)
        if chosen is not None:
            return chosen
    return None


def _best_fit(request: GangRequest, capacity: Capacity, fetch: _Fetch) -> list[str] | None:
    """The node with the fewest free GPUs that holds the job, the one holding its data among
    those. A request that says what it reads in bytes goes where the least must be fetched
    first (a base model's copy costs minutes at every start), then by the fewest free GPUs."""
    best: tuple[int, int, str] | None = None
    for gpu_type in _types(capacity, request.gpu_type):
        for free in range(request.gpus_per_node, capacity.largest[gpu_type] + 1):
            bucket = capacity.by_free.get((gpu_type, free))
            if bucket and request.avoid:
                bucket = bucket.difference(request.avoid)
            if not bucket:
                continue
            candidates = sorted(bucket)[:_PREFERENCE_SCAN] if fetch.needs else [min(bucket)]
            for node_id in candidates:
                cost = fetch(node_id)
                key = (cost, free, node_id) if fetch.by_bytes else (free, cost, node_id)
                if best is None or key < best:
                    best = key
            if not fetch.by_bytes:
                break  # the smallest fitting free count of this type is found
    return None if best is None else [best[2]]


def _whole_nodes(
    request: GangRequest, capacity: Capacity, gpu_type: str, fetch: _Fetch
) -> list[str] | None:
    """Whole idle nodes; of the smallest size that holds `gpus_per_node` first, since a gang
    books its nodes whole and GPUs it does not use are lost to everyone else."""
    pods: dict[str, set[str]] = {}
    avoid = set(request.avoid)
    for (kind, pod), ids in capacity.whole.items():
        if kind == gpu_type:
            big_enough = {
                i for i in ids if capacity.info[i].gpus >= request.gpus_per_node and i not in avoid
            }
            if big_enough:
                pods[pod] = big_enough
    sizes = sorted({capacity.info[i].gpus for ids in pods.values() for i in ids})
    for size in sizes:
        exact = {
            pod: {i for i in ids if capacity.info[i].gpus == size} for pod, ids in pods.items()
        }
        chosen = _in_pods(request, capacity, {p: ids for p, ids in exact.items() if ids}, fetch)
        if chosen is not None:
            return chosen
    return _in_pods(request, capacity, pods, fetch) if len(sizes) > 1 else None


def _in_pods(
    request: GangRequest, capacity: Capacity, pods: dict[str, set[str]], fetch: _Fetch
) -> list[str] | None:
    levels = capacity.levels
    by_path: dict[Path, set[str]] = {}
    if not levels:
        by_path = {(pod,): ids for pod, ids in pods.items()}
    else:
        for ids in pods.values():
            for node_id in ids:
                by_path.setdefault(path(capacity.info[node_id], levels), set()).add(node_id)
    if not by_path:
        return None
    required = None if request.topology is None else depth_of(request.topology, levels)
    if request.topology is not None and required is None:
        return None  # a level the cluster does not have: the pass says so (`unknown_level`)
    return choose(
        by_path,
        request.nodes,
        fetch.order,
        required_depth=required,
        across_pods=request.allow_multi_pod,
        fetched=fetch.least if fetch.by_bytes else None,
    )
