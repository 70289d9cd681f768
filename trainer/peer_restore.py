"""Resuming from the peer tier: the new gang's nodes send one another what each lacks.

Each node's local rank 0 places every file of the peer manifest that its node holds into the
checkpoint folder, each checked by size and sha256 (a copy that does not verify is deleted);
the ranks all-gather what each node placed and what it found corrupt; for every file some node
lacks, its first holder broadcasts it to the nodes' local ranks 0 (a group of their own: the
folder is one per node, and an 8-GPU node's other seven ranks would only receive copies to
drop), and the others check it again before they write it. The
survivors hold their own shards, and the dead node's successor in the ring holds the dead
node's, so after one failure the gang holds the whole checkpoint.

A file that no node of the gang holds (a node and its peer both died), or that none holds a
verified copy of, makes the tier unusable: every rank reaches the same verdict from the same
gathered inventory, and the caller resumes from the store tier, saying what was skipped. So does
a file that arrives corrupt from its holder: the receiving node does not write it, and the ranks
gather who received what corrupt before any of them decides, so that one bad transfer costs the
tier, not the attempt (a rank that raised alone would leave the others in the next collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from infra.digest import sha256_bytes
from trainer.checkpoint import local_path
from trainer.checkpoint_manifest import CheckpointFile, CheckpointManifest
from trainer.peer_tier import PeerTier
from trainer.typed_exchange import all_gather_typed


@dataclass(frozen=True)
class Inventory:
    """What one node found of a peer manifest's files in its holdings."""

    node_id: str
    placed: list[str]  # file names now in the checkpoint folder, verified
    rejected: list[str]  # names whose copy here did not verify (and is gone)


def gather_peer_checkpoint(
    manifest: CheckpointManifest, tier: PeerTier, dest: Path, group: dist.ProcessGroup
) -> str | None:
    """Every rank calls this. None: `dest` on every node holds every file of the peer
    checkpoint, verified. Otherwise why the tier cannot be used (the same on every rank)."""
    files = manifest.files
    mine: Inventory | None = None
    if tier.local_rank == 0:
        dest.mkdir(parents=True, exist_ok=True)
        placed, rejected = [], []
        for entry in files:
            held = tier.holdings.holds(entry)
            if tier.holdings.place(entry, local_path(dest, entry.name)):
                placed.append(entry.name)
            elif held:
                rejected.append(entry.name)
        mine = Inventory(tier.node_id, placed, rejected)
    gathered = all_gather_typed(mine, Inventory | None, group)
    nodes = {rank: inv for rank, inv in enumerate(gathered) if inv is not None}
    unusable = [why for entry in files if (why := _why_missing(entry, nodes))]
    if unusable:
        more = f" (and {len(unusable) - 3} more)" if len(unusable) > 3 else ""
        return _skipped(manifest, "; ".join(unusable[:3]) + more)
    corrupt: list[str] = []
    me = dist.get_rank(group)
    # Every rank makes the group (a collective), from the same gathered inventories.
    leaders = sorted(nodes)
    exchange = group
    if len(leaders) < len(gathered):
        exchange = dist.new_group([dist.get_global_rank(group, r) for r in leaders], backend="gloo")
    for entry in files:
        lacking = [rank for rank, inv in nodes.items() if entry.name not in inv.placed]
        if lacking and me in nodes:
            source = min(rank for rank, inv in nodes.items() if entry.name in inv.placed)
            sender = dist.get_global_rank(group, source)
            if not _broadcast_file(entry, sender, me in lacking, dest, exchange):
                corrupt.append(f"{entry.name} arrived from {nodes[source].node_id} corrupt")
    # Also the barrier: the node's other ranks read `dest` only once it is whole.
    verdicts = all_gather_typed(corrupt, list[str], group)
    arrived_corrupt = sorted({why for said in verdicts for why in said or []})
    if arrived_corrupt:
        return _skipped(manifest, "; ".join(arrived_corrupt) + " (sha256)")
    return None


def _skipped(manifest: CheckpointManifest, why: str) -> str:
    """The one line every rank says, and `forgeline status` lists, when the tier is unusable."""
    step, generation = manifest.step, manifest.generation
    return f"peer checkpoint step {step} (generation {generation}) skipped: {why}"


def _why_missing(entry: CheckpointFile, nodes: dict[int, Inventory]) -> str | None:
    """Why no node of the gang placed this file, naming each node said to hold it."""
    if any(entry.name in inv.placed for inv in nodes.values()):
        return None
    present = {inv.node_id: inv for inv in nodes.values()}
    said = []
    for holder in entry.holders:
        if holder not in present:
            said.append(f"{holder} is not in this gang")
        elif entry.name in present[holder].rejected:
            said.append(f"{holder}'s copy does not verify (size or sha256)")
        else:
            said.append(f"{holder} has no copy")
    return f"{entry.name}: " + ", ".join(said or ["no node holds it"])


def _broadcast_file(
    entry: CheckpointFile, source: int, write: bool, dest: Path, group: dist.ProcessGroup
) -> bool:
    """`source` is a global rank. False when this rank was to write the file and what
    arrived does not verify."""
    size = entry.bytes
    path = local_path(dest, entry.name)
    if size == 0:  # gloo broadcasts no empty tensor; there is nothing to send
        if write:
            path.write_bytes(b"")
        return True
    if dist.get_rank() == source:
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    else:
        data = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(data, src=source, group=group)
    if not write:
        return True
    received = data.numpy().tobytes()
    if sha256_bytes(received) != entry.sha256:
        return False
    path.write_bytes(received)
    return True
