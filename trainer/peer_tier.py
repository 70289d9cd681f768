"""The peer tier: checkpoints between the store's, held by the nodes themselves.

A store checkpoint uploads every shard, so at scale it is taken every half hour or so and a
failure loses half of that on average. A peer checkpoint is cheap enough to take every few
minutes: each rank writes its shards to node-local disk as for any checkpoint, sends them to
the rank of the same local rank on its node's peer (the next node of a ring that alternates
failure domains, so that a node and its peer seldom die together), and rank 0 writes a small
manifest to the store: step, generation, the data cursor, and every file with its size, sha256
and the two nodes that hold it. No shard goes to the store.

Keys: `runs/<run>/peer/step-<n>/gen-<g>/MANIFEST.json`, one generation's own, as for the store
tier; only the newest is kept (the nodes hold only the newest files). Fencing applies as for the
store tier (`trainer.manifest.Fences`): a superseded generation commits no peer manifest, and one
that a generation committed after a later one had resumed is never used.

Restoring from it (the nodes sending one another what each lacks) is
`trainer.peer_restore`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from infra.digest import sha256_bytes
from infra.errors import IntegrityError, ObjectNotFound
from infra.store.protocol import ObjectStore
from trainer.checkpoint_manifest import CheckpointFile, CheckpointManifest, PeerManifest
from trainer.local_copies import LocalCopies
from trainer.manifest import (
    CommitOutcome,
    CommittedCheckpoint,
    Fences,
    commit_fenced,
    delete_unless_fenced,
)
from trainer.typed_exchange import all_gather_typed

_PEER_KEY = re.compile(r"/peer/step-(\d+)/gen-(\d+)/MANIFEST\.json$")


def peer_manifest_key(run_id: str, step: int, generation: int) -> str:
    return f"runs/{run_id}/peer/step-{step}/gen-{generation}/MANIFEST.json"


def ring(domains: list[str]) -> list[int]:
    """`peers[i]`: the node that holds node i's copies, given each node's failure domain (its
    pod). The ring takes one node of each domain in turn, so a node's successor is in another
    domain whenever the domains are balanced enough to allow it. One node has no peer (itself)."""
    groups: dict[str, list[int]] = {}
    for index, domain in enumerate(domains):
        groups.setdefault(domain, []).append(index)
    order: list[int] = []
    queues = list(groups.values())
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    peers = [0] * len(domains)
    for at, node in enumerate(order):
        peers[node] = order[(at + 1) % len(order)]
    return peers


@dataclass(frozen=True)
class PeerTier:
    """What a rank needs to take part in the peer tier: where its node keeps the copies, and
    which node and failure domain it is on."""

    holdings: LocalCopies  # by sha256; the node-local rank 0 prunes it to the newest commit
    node_id: str
    domain: str
    local_rank: int


@dataclass(frozen=True)
class _Seat:
    """One rank as the commit's all-gather reports it."""

    node_id: str
    domain: str
    files: list[CheckpointFile]


def send_to_peer(
    tier: PeerTier, mine: list[tuple[Path, CheckpointFile]], group: dist.ProcessGroup
) -> list[CheckpointFile]:
    """Every rank calls this: each sends its files to its counterpart on its node's peer, and
    keeps them and what it received in its node's holdings. Returns the manifest's file list,
    each file with the two nodes that now hold it."""
    rank = dist.get_rank(group)
    own = _Seat(tier.node_id, tier.domain, [entry for _, entry in mine])
    seats: list[_Seat | None] = list(all_gather_typed(own, _Seat, group))
    nodes: list[str] = []
    for seat in seats:
        assert seat is not None
        if seat.node_id not in nodes:
            nodes.append(seat.node_id)
    domains = [next(s.domain for s in seats if s and s.node_id == n) for n in nodes]
    peers = ring(domains)
    # Ranks are grouped by node; a rank's counterpart is the rank of the same index on the peer.
    ranks_of = {n: [r for r, s in enumerate(seats) if s and s.node_id == n] for n in nodes}
    to = []
    for seat_rank, seat in enumerate(seats):
        assert seat is not None
        node = nodes.index(seat.node_id)
        to.append(ranks_of[nodes[peers[node]]][ranks_of[seat.node_id].index(seat_rank)])
    if len(nodes) > 1:
        source = to.index(rank)
        expected = seats[source].files  # type: ignore[union-attr]
        # gloo sends no empty tensor: a rank without files sends one byte, which is dropped.
        payload = b"".join(path.read_bytes() for path, _ in mine) or b"\0"
        outgoing = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        incoming = torch.empty(max(1, sum(e.bytes for e in expected)), dtype=torch.uint8)
        sent = dist.isend(outgoing, to[rank], group=group)
        received = dist.irecv(incoming, source, group=group)
        sent.wait()
        received.wait()
        _hold_received(tier.holdings, incoming.numpy().tobytes(), expected)
    tier.holdings.keep([(path, entry.sha256) for path, entry in mine])
    files = []
    for seat in seats:
        assert seat is not None
        holder = nodes[peers[nodes.index(seat.node_id)]]
        for entry in seat.files:
            files.append(entry.model_copy(update={"holders": sorted({seat.node_id, holder})}))
    return files


def _hold_received(holdings: LocalCopies, data: bytes, expected: list[CheckpointFile]) -> None:
    """Split what the predecessor sent into its files, each checked against what it said."""
    at = 0
    for entry in expected:
        chunk = data[at : at + entry.bytes]
        at += entry.bytes
        if sha256_bytes(chunk) != entry.sha256:
            raise IntegrityError(
                f"peer copy of {entry.name} arrived corrupt: expected sha256 "
                f"{entry.sha256[:12]}…, got {sha256_bytes(chunk)[:12]}…"
            )
        holdings.hold(entry.sha256, chunk)


def write_peer_manifest(
    store: ObjectStore,
    manifest: CheckpointManifest,
    run_id: str,
    step: int,
    generation: int,
    run_uid: str,
) -> str | None:
    """Rank 0's commit of a peer checkpoint: the manifest, create-if-absent at this generation's
    own key, taken back if a later generation resumed meanwhile (as for the store tier); then
    every older peer manifest of the run goes. Its key, or None if taken back."""
    key = peer_manifest_key(run_id, step, generation)
    outcome = commit_fenced(store, key, manifest.as_peer(), run_id, run_uid, generation, step)
    if outcome is not CommitOutcome.COMMITTED:
        return None
    older = store.list(f"runs/{run_id}/peer/")
    delete_unless_fenced(store, (k for k in older if k != key and _PEER_KEY.search(k)))
    return key


def find_peer(
    store: ObjectStore,
    run_id: str,
    max_generation: int,
    run_uid: str = "",
    on_skip: Callable[[str], None] = lambda _: None,
) -> CommittedCheckpoint | None:
    """The newest peer checkpoint a generation up to `max_generation` committed that the fences
    let count. Its files are on nodes, not in the store: whether the new gang holds them is
    for `trainer.peer_restore` to find out."""
    fences = Fences.read(store, run_id, run_uid)
    found = []
    for key in store.list(f"runs/{run_id}/peer/"):
        if match := _PEER_KEY.search(key):
            found.append((int(match.group(1)), int(match.group(2)), key))
    for step, generation, key in sorted(found, reverse=True):
        try:
            manifest = PeerManifest.parse(store.get_bytes(key), key)
        except (ObjectNotFound, IntegrityError) as err:
            on_skip(f"{key}: {err}")
            continue
        if not manifest.belongs_to(run_uid):
            on_skip(f"{key}: not this run's peer manifest")
            continue
        if generation > max_generation:
            on_skip(f"{key}: generation {generation} > {max_generation}")
            continue
        if stale := fences.why_stale(generation, step):
            on_skip(f"{key}: {stale}")
            continue
        return CommittedCheckpoint(key, manifest)
    return None


def peer_steps_of(store: ObjectStore, run_id: str, generation: int) -> list[int]:
    """The steps of the peer manifests `generation` committed that are still in the store
    (for accounting: at most one, the run's newest)."""
    return [
        int(match.group(1))
        for key in store.list(f"runs/{run_id}/peer/")
        if (match := _PEER_KEY.search(key)) and int(match.group(2)) == generation
    ]
