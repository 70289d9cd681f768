"""The cluster as the scheduler sees it: nodes, queues (teams), requests, allocations.

Everything here crosses the wire (signals, queries, continue-as-new), so every field has a
default where it can, and times are the workflow's deterministic `workflow.now()`.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from functools import cached_property
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    model_validator,
)

from workflows.contracts.held_items import MAX_ADVERTISED_HELD
from workflows.contracts.spec import NAME_PATTERN

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
DEFAULT_QUEUE = "default"
# The two levels every cluster has: its pods, and the nodes inside (ClusterConfig.levels lie in
# between).
TOPOLOGY_EDGES = ("pod", "node")


# --- nodes -------------------------------------------------------------------------------------

# The most dataset snapshots a node advertises (NodeInfo.cached, its most recently used first),
# and the most the Cluster workflow keeps of any node's list. Every node's list travels in the
# workflow's state, hence in each continue-as-new input, query answer and grant, which Temporal
# caps at 2 MB: 8 ids of ~20 characters are ~200 bytes a node, under 0.5 MB at 2,500 nodes. More
# would buy little: placement only asks whether a node holds the one snapshot a run reads, and
# the snapshots worth placing a run by are the few its node used last.
MAX_ADVERTISED_CACHED = 8


class NodeInfo(BaseModel):
    """What a node agent announces when it registers."""

    node_id: str
    host: str = "127.0.0.1"
    gpus: int = 1
    gpu_type: str = "cpu"
    pod: str = "local"
    rdzv_port: int = Field(description="port this node serves the rendezvous store on as head")
    # A grant's rendezvous port is rdzv_port + generation % rdzv_ports: each grant a port of its
    # own, so a fenced gang's torchrun still sitting on the last one never blocks the next.
    rdzv_ports: int = Field(default=1, ge=1, le=4096, description="ports from rdzv_port up")
    incarnation: str = Field(description="changes every time the agent process starts")
    cached: list[str] = Field(
        default=[],
        description="dataset snapshots held whole in the node's cache, most recently used first "
        f"(the Cluster workflow keeps at most {MAX_ADVERTISED_CACHED})",
    )
    memory_bytes: int = Field(default=0, ge=0, description="per GPU (0: not reported)")
    held: dict[str, int] = Field(
        default={},
        description="what the node's cache holds whole, by id (dataset snapshots, checkpoints: "
        "workflows.contracts.held_items) with its bytes, most recently used first (the Cluster "
        f"workflow keeps at most {MAX_ADVERTISED_HELD}); agents before it sent only `cached`",
    )
    topology: dict[Name, Name] = Field(
        default={},
        description="where the node sits inside its pod, by the cluster's levels: level -> "
        "unit, e.g. {'block': 'b1', 'rack': 'r3'} (from the agent's --topology)",
    )
    # What MFU divides by when the spec names no peak: the data sheet's, or measured at start.
    peak_flops: float = Field(default=0.0, ge=0, description="per GPU / rank slot (0: unknown)")
    confinement: str = Field(
        default="",
        max_length=300,
        description="how the node runs users' code: 'box' (each job's ranks in a sandbox), "
        "'unconfined: …' (its operator allowed them to run as the agent runs), or 'refuses user "
        "code: …' (it cannot box them), with why; '' from an agent before it",
    )
    container_runtime: str = Field(
        default="",
        max_length=100,
        description="what runs a spec's train.image on the node ('podman 4.3.1'); '': none, and "
        "the node refuses runs that name an image",
    )

    @property
    def holdings(self) -> dict[str, int]:
        """What the node holds, by id, with bytes (0: not said, from an agent before `held`)."""
        return self.held or dict.fromkeys(self.cached, 0)


class JoinRequest(BaseModel):
    """An agent joining the cluster (the `join_node` update): its node, and the incarnation the
    agent that ran from the same state folder had, which is how a restart on the same host is
    told from a second host claiming a node that is alive."""

    info: NodeInfo
    previous_incarnation: str | None = None


class Health(StrEnum):
    HEALTHY = "healthy"
    DOWN = "down"


class Admin(StrEnum):
    """What an operator decided: take work, take no new work, or give back what it runs."""

    ACTIVE = "active"
    CORDONED = "cordoned"
    DRAINING = "draining"


class NodeReport(BaseModel):
    """A run said this node is at fault because its ranks did (a straggler swapped out, silent
    corruption quarantined): evidence a user's script can write as well as the SDK. It keeps
    that run's gangs off the node; the cluster cordons the node only once runs of
    `ClusterConfig.cordon_teams` teams have reported it (workflows.scheduling.node_reports)."""

    run_id: str
    team: str
    kind: str  # straggler | corruption
    reason: str
    at: datetime


class Node(BaseModel):
    info: NodeInfo
    health: Health = Health.HEALTHY
    admin: Admin = Admin.ACTIVE
    spare: bool = False  # held back for swapping into a gang after a failure
    jobs: dict[str, int] = {}  # run id -> GPUs it holds here
    down_reason: str | None = None
    health_reason: str | None = None  # the node's own check is failing, and why
    reports: list[NodeReport] = Field(
        default=[],
        description="runs whose ranks reported this node at fault, the newest of each team within "
        "cordon_window_h: not yet enough to cordon it",
    )

    @property
    def used(self) -> int:
        return sum(self.jobs.values())

    @property
    def free(self) -> int:
        return self.info.gpus - self.used

    @property
    def schedulable(self) -> bool:
        return self.health == Health.HEALTHY and self.admin == Admin.ACTIVE

    @property
    def state(self) -> str:
        """One word for people: down, draining, cordoned, spare, allocated, partial, idle."""
        if self.health == Health.DOWN:
            return "down"
        if self.admin != Admin.ACTIVE:
            return self.admin.value
        if self.spare:
            return "spare"
        if not self.jobs:
            return "idle"
        return "allocated" if self.free == 0 else "partial"


# --- queues and configuration ------------------------------------------------------------------


MAX_TEAM_SOURCES = 64
_GLOB_CHARS = "*?["


def _team_source(entry: str) -> str:
    """One entry of a team's `sources`, a place and never a pattern: an absolute folder
    (/data/corpora/nlp), a store prefix (store:datasets-in/nlp/) or an S3 bucket or prefix
    (s3://nlp-corpora/raw/). A trailing '/' is dropped: entries name folders, matched part by
    part, so store:datasets-in/nlp does not take store:datasets-in/nlp-private/."""
    scheme = next((s for s in ("store:", "s3://") if entry.startswith(s)), "")
    place = entry.removeprefix(scheme)
    if not (scheme or entry.startswith("/")) or any(c in entry for c in _GLOB_CHARS):
        raise ValueError(
            f"{entry!r} is not a folder, store: prefix or s3:// prefix: write /data/corpora/nlp, "
            "store:datasets-in/nlp/ or s3://nlp-corpora/raw/ (no wildcard, no ?endpoint=: "
            "endpoints go in s3_endpoints)"
        )
    if scheme == "store:" and place.startswith("/"):
        raise ValueError(f"{entry!r}: a store: prefix is a key of the store, with no leading '/'")
    parts = place.strip("/").split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{entry!r}: name a folder, with no empty, '.' or '..' part")
    return (scheme or "/") + "/".join(parts)


def _s3_endpoint(url: str) -> str:
    """An endpoint a team's s3:// sources may name: a URL without credentials, as the sources
    write it (compared without a trailing '/')."""
    if not url.startswith(("http://", "https://")) or "@" in url or any(c in url for c in "?# "):
        raise ValueError(
            f"{url!r} is not an endpoint: write its URL, such as https://s3.internal:9000 "
            "(no credentials, query or fragment)"
        )
    return url.rstrip("/")


TeamSource = Annotated[
    str, StringConstraints(min_length=1, max_length=1024), AfterValidator(_team_source)
]
S3Endpoint = Annotated[
    str, StringConstraints(min_length=1, max_length=1024), AfterValidator(_s3_endpoint)
]


class QueueConfig(BaseModel):
    """A node of the queue tree (an org, or a team under one)."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    parent: Name | None = None
    guaranteed_gpus: int = Field(0, ge=0)
    max_gpus: int | None = Field(None, ge=0, description="None: no ceiling but the cluster")
    # Priority is the scheduler's first sort key across every team: without an allowance any
    # submitter could jump every queue. The API refuses a run above it unless an admin submits.
    max_priority: int = Field(
        0,
        ge=0,
        le=100,
        description="the highest resources.priority this team's runs may ask for (an admin "
        "may submit above it)",
    )
    # Without a list a team's runs may read whatever the data workers' roots hold and every
    # store key and bucket: one team reads another's corpora. The API checks each submission's
    # data.sources against these (worker/team_sources.py); the lists travel in the Cluster
    # workflow's state, hence their bounds.
    sources: list[TeamSource] | None = Field(
        None,
        max_length=MAX_TEAM_SOURCES,
        description="what this team's data.sources may name: folders inside the data roots "
        "(/data/corpora/nlp), store: prefixes (store:datasets-in/nlp/) and S3 prefixes "
        "(s3://nlp-corpora/raw/); None: anything inside the data roots, any store key or bucket",
    )
    s3_endpoints: list[S3Endpoint] | None = Field(
        None,
        max_length=MAX_TEAM_SOURCES,
        description="the endpoints an s3:// source of this team may name (?endpoint=URL); with "
        "sources or this declared, any other endpoint is refused",
    )

    @model_validator(mode="after")
    def _guarantee_fits_ceiling(self) -> QueueConfig:
        if self.max_gpus is not None and self.guaranteed_gpus > self.max_gpus:
            raise ValueError(
                f"queue {self.name}: guaranteed_gpus ({self.guaranteed_gpus}) exceeds "
                f"max_gpus ({self.max_gpus})"
            )
        return self


class ClusterConfig(BaseModel):
    """What `forgeline cluster apply FILE` declares."""

    model_config = ConfigDict(extra="forbid")

    pods: list[Name] = []
    levels: list[Name] = Field(
        default=[],
        description="the fabric's levels inside a pod, widest first (e.g. block, rack): a gang "
        "goes in the smallest unit that holds it at the lowest level it can",
    )
    queues: list[QueueConfig] = []
    spare_nodes: int = Field(0, ge=0)
    cost_per_gpu_hour: float = Field(0.0, ge=0)
    preemption_grace_s: int = Field(120, ge=1, le=86_400)
    fair_share_half_life_h: float = Field(24.0, gt=0)
    default_max_runtime_h: float = Field(24.0 * 7, gt=0, description="for requests without one")
    aging_s: float = Field(3600.0, gt=0, description="waiting this long adds one priority level")
    # The starvation guard (`Switches.starvation_guard`, on in the default policy). Found in
    # simulation: with one reservation, the head's, a burst of 1,024-GPU gangs was served one at
    # a time while every node freed outside that reservation went to younger small jobs, and
    # gangs waited 45 h; 85 % of the preempted gangs had run less than an hour, just granted
    # and so the cheapest victims, then granted and preempted again (one 133 times).
    reserve_after_s: float = Field(
        6 * 3600.0, gt=0, description="a request waiting this long gets a reservation of its own"
    )
    preemption_shield_s: float = Field(
        3600.0, ge=0, description="a gang granted less than this long ago is not preempted"
    )
    preemption_restart_s: float = Field(
        600.0, ge=0, description="what a preempted gang loses beyond its unsaved work, per GPU"
    )
    # Found in simulation: of 1,576 preemptions in three weeks, 650 were reclaims made the
    # moment the request arrived, on 2,500 nodes where a gang ends every minute or so. Waiting
    # 15 min first: 406 reclaims, 1,137 preemptions in all.
    reclaim_after_s: float = Field(
        900.0,
        ge=0,
        description="a request within its team's guarantee waits this long after its "
        "submission for nodes to free before it preempts borrowers",
    )
    # Found in simulation: in a burst of 1,024-GPU gangs, a reservation made at 6 h started when
    # the running gangs' declared max runtimes said, 27 h later, and eleven gangs waited past
    # a day while small jobs overtook them on every node freed elsewhere.
    start_within_s: float = Field(
        20 * 3600.0,
        gt=0,
        description="a reserved request starts by this long after its submission: lower or "
        "equal priority gangs still on its reserved nodes then are preempted",
    )

    # The hot pool (workflows.scheduling.hot_pool): a share of the nodes keeps the most
    # requested base models on local disk, fetched ahead of the fine-tunes that will need them.
    hot_fraction: float = Field(
        0.0, ge=0, le=1, description="share of the nodes that hold a hot base model (0: no pool)"
    )
    hot_models: int = Field(4, ge=1, le=16, description="the most base models kept hot")
    hot_half_life_h: float = Field(
        24.0, gt=0, description="a base model's requests count half after this long"
    )
    # What a run's ranks say about a node (a straggler, silent corruption) is what its script
    # says: alone, it keeps only that run off the node (workflows.scheduling.node_reports).
    cordon_teams: int = Field(
        2,
        ge=1,
        le=16,
        description="runs of this many teams must report a node (straggler, corruption) within "
        "cordon_window_h before it is cordoned; 1 trusts any run's ranks",
    )
    cordon_window_h: float = Field(
        24.0, gt=0, description="how long a run's report on a node counts toward its cordon"
    )

    @model_validator(mode="after")
    def _levels_are_distinct(self) -> ClusterConfig:
        for level in self.levels:
            if level in TOPOLOGY_EDGES:
                raise ValueError(
                    f"levels: {level!r} is always there (the pod above every level, the node "
                    "below): declare only the levels in between, such as block and rack"
                )
            if self.levels.count(level) > 1:
                raise ValueError(f"levels: {level!r} is declared twice")
        return self

    @model_validator(mode="after")
    def _tree_is_sound(self) -> ClusterConfig:
        if self.start_within_s < self.reserve_after_s:
            # The deadline acts only on reserved requests: below reserve_after_s it would
            # evict at that moment, with no reservation held for it first.
            raise ValueError(
                f"start_within_s ({self.start_within_s:g}) is shorter than reserve_after_s "
                f"({self.reserve_after_s:g}): a run gets its reservation first, then its "
                "deadline; raise start_within_s or lower reserve_after_s"
            )
        names = [q.name for q in self.queues]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"queues declared twice: {', '.join(duplicates)}")
        known = set(names) | {DEFAULT_QUEUE}
        for queue in self.queues:
            if queue.parent is not None and queue.parent not in known:
                raise ValueError(f"queue {queue.name}: parent {queue.parent!r} is not declared")
        by_name = {q.name: q for q in self.queues}
        for queue in self.queues:  # a cycle would make every ancestor walk loop forever
            seen, current = {queue.name}, queue.parent
            while current is not None and current in by_name:
                if current in seen:
                    raise ValueError(f"queue {queue.name}: its parents form a cycle")
                seen.add(current)
                current = by_name[current].parent
        for parent in self.queues:
            children = [q for q in self.queues if q.parent == parent.name]
            promised = sum(c.guaranteed_gpus for c in children)
            if children and promised > parent.guaranteed_gpus:
                raise ValueError(
                    f"queue {parent.name}: its teams are guaranteed {promised} GPUs, more than "
                    f"its own guarantee of {parent.guaranteed_gpus}"
                )
        return self

    def queue(self, name: str) -> QueueConfig:
        for queue in self.queues:
            if queue.name == name:
                return queue
        return QueueConfig(name=name)  # undeclared teams: no guarantee, no ceiling

    def ancestry(self, name: str) -> list[QueueConfig]:
        """The queue and its parents, nearest first."""
        chain, current = [], self.queue(name)
        while True:
            chain.append(current)
            if current.parent is None:
                return chain
            current = self.queue(current.parent)


# --- requests and allocations ------------------------------------------------------------------


class GangRequest(BaseModel):
    run_id: str
    nodes: int
    gpus_per_node: int
    team: str = DEFAULT_QUEUE
    gpu_type: str | None = None  # None: any
    priority: int = 0
    preemptible: bool = True
    max_runtime_s: float | None = None  # None: the cluster's default_max_runtime_h
    cache_items: list[str] = []  # prefer nodes that hold these (dataset snapshots)
    needs: dict[str, int] = Field(
        default={},
        description="what every node of the gang reads, by id (workflows.contracts.held_items) "
        "with its bytes: placement goes where the least must be fetched",
    )
    base_model: str | None = Field(
        None,
        description="a fine-tune's base: the manifest key of the checkpoint it starts from (its "
        "id and bytes are in `needs`); the hot pool counts the requests for each",
    )
    allow_multi_pod: bool = True
    # All of the gang inside one unit of this level ("pod" or one of ClusterConfig.levels)...
    topology: str | None = None
    # ...for this long after it was queued (None: for ever), then the fewest units: a gang that
    # only prefers one rack (0) or is willing to wait a while for one.
    topology_wait_s: float | None = Field(None, ge=0)
    recovery: bool = False  # after a failure: may take a spare node
    avoid: list[str] = Field(
        default=[],
        description="nodes the run's own ranks reported at fault (a straggler, silent "
        "corruption): its gangs are placed elsewhere",
    )
    # Elastic: a recovering gang that cannot have `nodes` may be granted as few as this.
    min_nodes: int | None = None
    layout: str = Field(
        "", description="how the run splits its ranks (RunSpec.layout_summary), for people"
    )
    submitted_at: datetime | None = None  # first submission: a requeued run keeps its age
    # Requeued after running (a failure, a preemption): its start deadline counts from when it
    # was requeued (`waiting_since`), not from its first submission: a victim given that
    # deadline would evict others at once.
    started_before: bool = False
    waiting_since: datetime | None = Field(
        None,
        description="for a run queued again after it ran: when the Cluster workflow queued it "
        "again; it starts by start_within_s after this",
    )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class Preemption(BaseModel):
    for_run: str
    reason: str
    deadline: datetime
    grow_to: int | None = None  # not a victim: a shrunk gang stops to grow back to this many


class Allocation(BaseModel):
    run_id: str
    generation: int
    nodes: list[NodeInfo]
    gpus_per_node: int = 1  # as requested; see `held_on` for what each node is booked for
    team: str = DEFAULT_QUEUE
    priority: int = 0
    preemptible: bool = True
    granted_at: datetime | None = None
    expected_end: datetime | None = None  # granted_at + max runtime: backfill plans with it
    last_checkpoint_at: datetime | None = None  # what a preemption of it would lose
    preempting: Preemption | None = None
    # The fleet's record when granted (ClusterState.node_seconds, fail_stops).
    fleet_node_seconds: float = 0.0
    fleet_fail_stops: int = 0
    # A gang granted smaller than it asked (elastic): the full request it grows back to.
    wanted: GangRequest | None = None
    # Placed on nodes reserved for this run, on the condition that it leaves (preempted, with
    # its checkpoint) once the reservation could otherwise start: `workflows.scheduling.yielding`.
    yields_to: str | None = Field(
        None,
        description="the run whose reserved nodes this gang was lent: it is preempted, with its "
        "grace, when that reservation can start",
    )
    layout: str = Field("", description="the request's layout, as `forgeline jobs` shows it")
    devices: dict[str, list[int]] = Field(
        default={},
        description="node id -> which of that node's GPUs (by index, in PCI bus order) the gang "
        "holds, where it holds part of a node (cluster_ops.devices_for): its agent shows the job "
        "those alone. A node held whole is not listed; a grant from before listed none, and "
        "held the node's first `held_on`",
    )

    def held_on(self, node: NodeInfo) -> int:
        """A multi-node gang holds its nodes whole; a single-node job what it asked for."""
        return node.gpus if len(self.nodes) > 1 else self.gpus_per_node

    def devices_on(self, node_id: str) -> list[int]:
        """The indices of the GPUs the gang holds on node `node_id` (empty: not one of its
        nodes). A grant that named none held the node's first ones: ranks then used
        `cuda:LOCAL_RANK` on every node."""
        if node_id in self.devices:
            return self.devices[node_id]
        info = next((n for n in self.nodes if n.node_id == node_id), None)
        return list(range(self.held_on(info))) if info is not None else []

    @cached_property
    def gpus(self) -> int:
        # As the sum of `held_on` over the nodes, computed once (a gang's nodes never change):
        # quotas and usage ask for this of every allocation on every pass and every release.
        if len(self.nodes) == 1:
            return self.gpus_per_node
        return sum([node.gpus for node in self.nodes])

    def device_peak_flops(self, threads_per_rank: int = 1) -> float | None:
        """The peak FLOP/s of one of the gang's devices, as their agents reported it (the mean:
        MFU is then the share of all the gang's FLOP/s the run used). A CPU slot's peak is one
        thread's, so it scales with the threads each rank runs. None: no agent reported one."""
        peaks = [
            node.peak_flops * (threads_per_rank if node.gpu_type == "cpu" else 1)
            for node in self.nodes
            if node.peak_flops
        ]
        return sum(peaks) / len(peaks) if peaks else None

    @property
    def rdzv_endpoint(self) -> str:
        head = self.nodes[0]
        return f"{head.host}:{head.rdzv_port + self.generation % head.rdzv_ports}"


class NodeAdmin(BaseModel):
    """An operator's change to one node: cordon, drain, or back to active."""

    node_id: str
    admin: Admin


class Release(BaseModel):
    run_id: str
    generation: int
    # The run's next request, queued in the same step as the release: a gang recovering from a
    # failure keeps its survivors from the queue (a pass between a release and a later request
    # would grant them to the next run in line).
    requeue: GangRequest | None = None


class GrantCheck(BaseModel):
    """A grant a run received, to be checked against the Cluster workflow's own allocations:
    a signal says nothing of who sent it, and only the Cluster's grants hold nodes."""

    run_id: str
    generation: int
    nodes: list[tuple[str, str]]  # (node id, incarnation), in the grant's order
    # Where each node is reached, in the same order: (host, rdzv_port, rdzv_ports). The head's
    # make the gang's rendezvous endpoint, so a grant of the right nodes at another address
    # would send the ranks to whoever listens there. None: a check scheduled before they were.
    addresses: list[tuple[str, int, int]] | None = None

    @classmethod
    def of(cls, grant: Allocation) -> GrantCheck:
        return cls(
            run_id=grant.run_id,
            generation=grant.generation,
            nodes=[(n.node_id, n.incarnation) for n in grant.nodes],
            addresses=[(n.host, n.rdzv_port, n.rdzv_ports) for n in grant.nodes],
        )

    def holds(self, held: Allocation) -> bool:
        """Whether the cluster's allocation `held` is exactly this grant: its run, generation,
        nodes, their agents' incarnations, and where the ranks will meet."""
        expected = GrantCheck.of(held)
        if self.addresses is None:
            expected.addresses = None
        return expected == self


class NodeFailure(BaseModel):
    run_id: str
    generation: int
    node_id: str
    reason: str
    # fail-stop: the node is down until its agent comes back; unhealthy: down until its own
    # check passes; straggler or corruption (the run's ranks said so): recorded, and cordoned
    # (no new work until an operator has looked at it) once runs of enough teams said so.
    kind: str = "fail-stop"


class NodeAnswered(BaseModel):
    """A run took the node for dead (it did not answer the liveness probe at once, so the
    next gang went without it) and then its agent answered after all, as the incarnation
    granted, and its ranks have stopped: the node was only slow, and is back in service."""

    run_id: str
    generation: int
    node_id: str
    incarnation: str
    reason: str  # what the run reported it down for (NodeFailure.reason), matched exactly


class NodeHealthReport(BaseModel):
    """A node agent's own health check changed its verdict (infra.node_health)."""

    node_id: str
    incarnation: str
    healthy: bool
    reason: str = ""


class CheckpointCommitted(BaseModel):
    run_id: str
    generation: int
    step: int


class PreemptNotice(BaseModel):
    """Sent to a victim run: checkpoint within `grace_s` and give the gang back."""

    generation: int
    grace_s: int
    reason: str
    # Not a preemption: the run's shrunk gang checkpoints and is granted this many nodes.
    grow_to: int | None = None


class Reservation(BaseModel):
    run_id: str
    nodes: list[str]
    start: datetime  # when the nodes are expected to be free


class Claim(BaseModel):
    """Nodes held for a run that preempted others to get them, until it is granted there: the
    requeued victim (older, maybe higher priority) must not take them straight back."""

    run_id: str
    nodes: list[str]
    until: datetime


class Waiting(BaseModel):
    run_id: str
    position: int
    reason: str


class ModelDemand(BaseModel):
    """How much a base model is asked for: requests, halving every `hot_half_life_h`."""

    manifest_key: str
    bytes: int = 0
    weight: float = 0.0
    at: datetime  # when `weight` was last brought up to date


class Warming(BaseModel):
    """A node told to fetch a hot base model into its cache, ahead of demand."""

    item: str
    until: datetime  # given up (and planned again) if the node has not said it holds it by then


class WarmInput(BaseModel):
    """The `warm_cache` activity on one node: fetch this checkpoint into the node's cache and
    keep it (and the other hot models it holds) over what is not hot when room is made."""

    manifest_key: str
    hot: list[str] = Field(description="the ids of every hot base model (held_items)")


class ClusterState(BaseModel):
    config: ClusterConfig = ClusterConfig()
    nodes: list[Node] = []
    queue: list[GangRequest] = []
    allocations: list[Allocation] = []
    next_generation: int = 1
    usage: dict[str, float] = {}  # team -> decayed GPU-seconds
    usage_at: datetime | None = None
    reservation: Reservation | None = None
    # Every reservation of the last pass (the head's first): the starvation guard keeps those of
    # requests waiting past `reserve_after_s`.
    reservations: list[Reservation] = []
    waiting: list[Waiting] = []
    claims: list[Claim] = []
    # The fleet's failure record, for the runs' checkpoint intervals (checkpoint_every = auto).
    node_seconds: float = 0.0  # healthy node time observed so far
    fail_stops: int = 0  # nodes that died under a gang
    demand: dict[str, ModelDemand] = {}  # base model id -> its requests (the hot pool)
    warming: dict[str, Warming] = {}  # node id -> what it was told to fetch
    # node id -> node, rebuilt when `nodes` is replaced or grows (nodes are never removed):
    # never serialised, so a continued-as-new or replayed state rebuilds its own.
    _by_id: dict[str, Node] = PrivateAttr(default_factory=dict)
    _indexed: tuple[int, int] = PrivateAttr((0, -1))  # (id of the `nodes` list, its length)

    def node(self, node_id: str) -> Node | None:
        """The node with this id in one lookup: releases and heartbeats ask per node, and a
        sweep of 2,500 nodes each time was most of a simulated release's cost."""
        if self._indexed != (id(self.nodes), len(self.nodes)):
            self._by_id = {n.info.node_id: n for n in self.nodes}
            self._indexed = (id(self.nodes), len(self.nodes))
        return self._by_id.get(node_id)
