"""The peer tier's exchange between nodes of several ranks each: four gloo processes as two
"nodes" of two local ranks. Each node holds one of the checkpoint's two files; after the
exchange both nodes' folders hold both, verified, and only the nodes' local ranks 0 sent or
received them (a node's other ranks would only receive copies to drop)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from infra.digest import sha256_bytes
from infra.processes import free_port
from trainer.checkpoint_manifest import CheckpointFile, PeerManifest
from trainer.local_copies import LocalCopies
from trainer.peer_restore import gather_peer_checkpoint
from trainer.peer_tier import PeerTier

WORLD, PER_NODE = 4, 2
FILES = {"__0_0.distcp": b"node zero's shard " * 100, "__1_0.distcp": b"node one's shard " * 90}


def _manifest() -> PeerManifest:
    holders = {"__0_0.distcp": ["n0"], "__1_0.distcp": ["n1"]}
    files = [
        CheckpointFile(name=name, bytes=len(data), sha256=sha256_bytes(data), holders=holders[name])
        for name, data in FILES.items()
    ]
    return PeerManifest(step=30, generation=1, files=files)


def _rank_main(rank: int, root: Path, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)  # fmt: skip
    try:
        node, local_rank = f"n{rank // PER_NODE}", rank % PER_NODE
        copies = LocalCopies(root / node / "peer")
        if local_rank == 0:  # each node's own shard, as its peer saves left it
            name = f"__{rank // PER_NODE}_0.distcp"
            copies.hold(sha256_bytes(FILES[name]), FILES[name])
        dist.barrier()
        sent = []
        broadcast = dist.broadcast

        def counted(tensor, src, group=None):
            sent.append(src)
            return broadcast(tensor, src=src, group=group)

        dist.broadcast = counted
        try:
            why = gather_peer_checkpoint(
                _manifest(), PeerTier(copies, node, "pod", local_rank), root / "dest" / node,
                dist.new_group(backend="gloo"),
            )  # fmt: skip
        finally:
            dist.broadcast = broadcast
        (root / f"outcome-{rank}.json").write_text(json.dumps({"why": why, "sent": sent}))
    finally:
        dist.destroy_process_group()


def test_only_the_nodes_first_ranks_exchange_the_files(tmp_path: Path) -> None:
    mp.start_processes(_rank_main, args=(tmp_path, free_port()), nprocs=WORLD,
                       start_method="spawn")  # fmt: skip
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in range(WORLD)]
    assert all(o["why"] is None for o in outcomes), outcomes
    # Each file went once, from its node's local rank 0 (global ranks 0 and 2) to the other's.
    assert [o["sent"] for o in outcomes] == [[0, 2], [], [0, 2], []]
    for node in ("n0", "n1"):
        for name, data in FILES.items():
            assert (tmp_path / "dest" / node / name).read_bytes() == data
