"""The peer tier with three real gloo processes, one a "node": a checkpoint held on the nodes,
restored when a node is replaced, refused (naming why) when a node and its peer are both gone
or the only copy left is corrupt, and never committed by a superseded generation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infra.processes import free_port
from infra.store.local import LocalStore
from trainer.checkpoint import Checkpointer, load_training_state
from trainer.checkpoint_manifest import PeerManifest
from trainer.job import ResumePoint, TrainJob
from trainer.job_checkpoints import resolve
from trainer.local_copies import LocalCopies
from trainer.manifest import record_generation
from trainer.peer_restore import gather_peer_checkpoint
from trainer.peer_tier import PeerTier, find_peer, ring

NODES = 3
DOMAINS = ["pod-a", "pod-b", "pod-a"]  # the ring: n0 -> n1 -> n2 -> n0


def test_the_ring_puts_a_node_s_peer_in_another_domain_when_it_can() -> None:
    assert ring(["a", "b", "a", "b"]) == [1, 2, 3, 0]
    assert ring(["a", "a", "b", "b"]) == [2, 3, 1, 0]  # order a0 b0 a1 b1
    for node, peer in enumerate(peers := ring(["a", "a", "b", "b"])):
        assert ["a", "a", "b", "b"][node] != ["a", "a", "b", "b"][peer]
    assert sorted(peers) == [0, 1, 2, 3]  # a ring: every node holds exactly one other's
    assert ring(["a"]) == [0]
    assert ring(DOMAINS) == [1, 2, 0]


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # Several tensors, so DCP spreads the (replicated) state over the three ranks' files.
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def tier(root: Path, node: str, rank: int) -> PeerTier:
    return PeerTier(LocalCopies(root / node / "peer"), node, DOMAINS[rank], local_rank=0)


def job_on(root: Path, node: str, rank: int, resume: ResumePoint) -> TrainJob:
    """The parts of a node's job that choosing the checkpoint reads."""
    return TrainJob(run_id="r", node_id=node, generation=2, model={}, train={}, train_shards=[],
                    dtype="float32", store_url="", staging_dir=str(root / "staging-new"),
                    progress_file="", resume=resume, peer_copies=str(root / node / "peer"),
                    node_domain=DOMAINS[rank])  # fmt: skip


def _rank_main(rank: int, root: Path, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=NODES)  # fmt: skip
    try:
        _scenarios(rank, root)
    finally:
        dist.destroy_process_group()


def _flipping_what_it_sends(send, me: int):
    def flipping(tensor: torch.Tensor, src: int, group=None) -> None:
        if src == me and tensor.numel() > 1:
            tensor = tensor.clone()
            tensor[tensor.numel() // 2] ^= 0xFF
        send(tensor, src=src, group=group)

    return flipping


def _scenarios(rank: int, root: Path) -> None:
    store = LocalStore(root / "store")
    group = dist.new_group(backend="gloo")
    model, optimizer = model_and_optimizer(seed=1)
    saver = Checkpointer(store=store, staging_dir=root / f"staging-{rank}", run_id="r",
                         generation=1, keep=2, layout={}, asynchronous=False,
                         peer=tier(root, f"n{rank}", rank))  # fmt: skip
    # A store checkpoint at step 5 first: the tier a peer-tier resume falls back to.
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    saver.save(model, optimizer, 5, {"tokens_seen": 5})
    store_save = saver.wait()
    at_5 = {k: v.clone() for k, v in model.state_dict().items()}
    reports = []
    for step in (10, 20):
        model(torch.ones(2, 16)).sum().backward()
        optimizer.step()
        saver.save(model, optimizer, step, {"tokens_seen": step}, peer=True)
        reports.append(saver.wait())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    found = find_peer(store, "r", max_generation=1)
    assert found is not None and found.step == 20
    manifest = found.manifest
    outcome: dict = {"keys": [r.manifest_key for r in reports if r is not None and r.peer]}

    # n1 dies; a fresh node n3 takes its place: n2 holds n1's shards.
    replaced = ["n0", "n3", "n2"][rank]
    dest = root / "restore-a" / replaced
    outcome["replaced"] = gather_peer_checkpoint(manifest, tier(root, replaced, rank), dest, group)
    fresh, fresh_optimizer = model_and_optimizer(seed=7)
    load_training_state(fresh, fresh_optimizer, dest)
    outcome["weights_equal"] = all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())

    # The same, but n1's shard is corrupted on its way from n2 (a bit flipped on the wire, the
    # one fault here that only a stand-in can cause): no rank raises, every rank skips the tier.
    send = dist.broadcast
    if rank == 2:
        dist.broadcast = _flipping_what_it_sends(send, rank)
    try:
        dest = root / "restore-w" / replaced
        wire = gather_peer_checkpoint(manifest, tier(root, replaced, rank), dest, group)
    finally:
        dist.broadcast = send
    outcome["wire"] = [wire, (dest / "__1_0.distcp").exists()]

    # n1 and its peer n2 both die: n1's shards are held nowhere.
    both = ["n0", "n3", "n4"][rank]
    why = gather_peer_checkpoint(manifest, tier(root, both, rank), root / "restore-b" / both, group)
    outcome["both_dead"] = why

    # n1 dies and n2's copy of its data file has a flipped byte.
    dist.barrier(group=group)
    if rank == 2:
        n1_data = next(f for f in manifest.files if f.name.startswith("__1_"))
        held = root / "n2" / "peer" / n1_data.sha256
        data = bytearray(held.read_bytes())
        data[len(data) // 2] ^= 0xFF
        held.write_bytes(bytes(data))
    dist.barrier(group=group)
    dest = root / "restore-c" / replaced
    outcome["flipped"] = gather_peer_checkpoint(manifest, tier(root, replaced, rank), dest, group)

    # The same, as a new gang's ranks meet it: they fall back to the store tier, saying why.
    # They read both manifests from the copies their agent kept beside the job, not the store
    # (the keys given here name nothing there).
    assert store_save is not None and store_save.manifest_key is not None
    kept = root / f"kept-{rank}"
    kept.mkdir()
    (kept / "peer.json").write_bytes(store.get_bytes(found.key))
    (kept / "store.json").write_bytes(store.get_bytes(store_save.manifest_key))
    fallback = ResumePoint(folder=str(root / "fallback" / replaced), step=5, tokens_seen=5,
                           manifest_key="runs/r/nothing-here/MANIFEST.json",
                           manifest_file=str(kept / "store.json"))  # fmt: skip
    peer_point = ResumePoint(folder=str(root / "restore-d" / replaced), step=20, tokens_seen=20,
                             manifest_key="runs/r/nothing-here/MANIFEST.json", tier="peer",
                             fallback=fallback, manifest_file=str(kept / "peer.json"))  # fmt: skip
    said: list[str] = []
    chosen, why = resolve(job_on(root, replaced, rank, peer_point), store, 0, group, said.append)
    fresh, fresh_optimizer = model_and_optimizer(seed=7)
    load_training_state(fresh, fresh_optimizer, Path(chosen.folder))
    outcome["fallback"] = [chosen.step, why, said]
    outcome["fallback_weights_equal"] = all(
        torch.equal(at_5[k], v) for k, v in fresh.state_dict().items()
    )

    # Generation 2 has started: generation 1's next peer save commits nothing.
    if rank == 0:
        record_generation(store, "r", 2, resume_step=20)
    dist.barrier(group=group)
    saver.save(model, optimizer, 30, {"tokens_seen": 30}, peer=True)
    late = saver.wait()
    saver.close()
    outcome["fenced"] = late is not None and late.fenced and late.manifest_key is None
    outcome["n1_files"] = [f.name for f in manifest.files if f.name.startswith("__1_")]
    (root / f"outcome-{rank}.json").write_text(json.dumps(outcome))


def test_a_peer_checkpoint_survives_one_dead_node_and_says_why_when_it_cannot(
    tmp_path: Path,
) -> None:
    mp.start_processes(_rank_main, args=(tmp_path, free_port()), nprocs=NODES,
                       start_method="spawn")  # fmt: skip
    outcomes = [json.loads((tmp_path / f"outcome-{r}.json").read_text()) for r in range(NODES)]
    store = LocalStore(tmp_path / "store")
    # Only the newest peer manifest is kept, and no peer shard went to the store.
    assert store.list("runs/r/peer/") == ["runs/r/peer/step-20/gen-1/MANIFEST.json"]
    in_store = store.list("runs/r/checkpoints/")
    assert "runs/r/checkpoints/step-5/gen-1/MANIFEST.json" in in_store
    assert all(key.startswith("runs/r/checkpoints/step-5/") for key in in_store)
    key = "runs/r/peer/step-20/gen-1/MANIFEST.json"
    manifest = PeerManifest.parse(store.get_bytes(key), key)
    holders = {f.name: f.holders for f in manifest.files}
    assert holders["__1_0.distcp"] == ["n1", "n2"] and holders["__2_0.distcp"] == ["n0", "n2"]
    # Each node holds its own shards and its predecessor's, nothing older; n2's copy of n1's
    # shard, flipped, was deleted when it did not verify.
    n2 = {p.name for p in (tmp_path / "n2" / "peer").iterdir()}
    flipped = next(f.sha256 for f in manifest.files if f.name == "__1_0.distcp")
    assert n2 == {f.sha256 for f in manifest.files if "n2" in f.holders} - {flipped}
    n0 = {p.name for p in (tmp_path / "n0" / "peer").iterdir()}
    assert n0 == {f.sha256 for f in manifest.files if "n0" in f.holders}
    for rank, outcome in enumerate(outcomes):
        assert outcome["replaced"] is None and outcome["weights_equal"], outcome
        assert outcome["n1_files"] == ["__1_0.distcp"]
        assert outcome["both_dead"] == (
            "peer checkpoint step 20 (generation 1) skipped: __1_0.distcp: n1 is not in this "
            "gang, n2 is not in this gang"
        )
        assert outcome["flipped"] == (
            "peer checkpoint step 20 (generation 1) skipped: __1_0.distcp: n1 is not in this "
            "gang, n2's copy does not verify (size or sha256)"
        )
        assert outcome["fenced"]
        assert outcome["wire"] == [
            "peer checkpoint step 20 (generation 1) skipped: __1_0.distcp arrived from n2 "
            "corrupt (sha256)",
            rank == 2,  # n2's own verified copy; n0 and n3 wrote nothing of what arrived
        ]
        # n2's corrupt copy was deleted when it did not verify: now it has none.
        skipped = (
            "peer checkpoint step 20 (generation 1) skipped: __1_0.distcp: n1 is not in this "
            "gang, n2 has no copy"
        )
        said = [f"{skipped}; resuming from the store at step 5"]
        assert outcome["fallback"] == [5, skipped, said]
        assert outcome["fallback_weights_equal"]
    assert outcomes[0]["keys"] == [
        "runs/r/peer/step-10/gen-1/MANIFEST.json",
        "runs/r/peer/step-20/gen-1/MANIFEST.json",
    ]
