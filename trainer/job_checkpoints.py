"""A job's checkpoints as its ranks meet them: the Checkpointer its folders and tiers make,
and which checkpoint a new gang loads: the one the node agent prepared, or for a peer-tier
resume, the peer checkpoint gathered from the gang's nodes, or when the gang does not hold it
whole, the store checkpoint it names, fetched by the ranks only then."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from infra.store.protocol import ObjectStore
from trainer.checkpoint import Checkpointer, fetch_checkpoint
from trainer.job import ResumePoint, TrainJob
from trainer.local_copies import LocalCopies
from trainer.peer_restore import gather_peer_checkpoint
from trainer.peer_tier import PeerTier


def peer_tier_of(job: TrainJob, local_rank: int) -> PeerTier | None:
    """This rank's part in the peer tier, or None when the run takes no peer checkpoints."""
    if not job.peer_copies:
        return None
    return PeerTier(LocalCopies(Path(job.peer_copies)), job.node_id, job.node_domain, local_rank)


def checkpointer_for(
    job: TrainJob, store: ObjectStore, layout: dict, *, keep: int, asynchronous: bool,
    local_rank: int,
) -> Checkpointer:  # fmt: skip
    """The rank's Checkpointer: the job's staging folder, its node's copies of the last commit
    (pruned by the node-local rank 0) and its part in the peer tier, if the run takes one."""
    return Checkpointer(
        store=store,
        staging_dir=Path(job.staging_dir),
        run_id=job.run_id,
        generation=job.generation,
        keep=keep,
        layout=layout,
        asynchronous=asynchronous,
        run_uid=job.run_uid,
        local_copies=LocalCopies(Path(job.local_copies)) if job.local_copies else None,
        prunes_local_copies=local_rank == 0,
        peer=peer_tier_of(job, local_rank),
    )


def resolve(
    job: TrainJob,
    store: ObjectStore,
    local_rank: int,
    group: dist.ProcessGroup,
    say: Callable[[str], None],
) -> tuple[ResumePoint | None, str | None]:
    """The checkpoint to load, its files verified in its folder, and why a peer-tier resume
    fell back to the store tier (None if it did not). Every rank calls it (collectives)."""
    resume = job.resume
    if resume is None or resume.tier != "peer":
        return resume, None
    manifest = resume.manifest(store)
    tier = peer_tier_of(job, local_rank)
    if tier is None:  # every rank of the gang the same: the job has no peer-copies folder
        why = f"peer checkpoint step {resume.step} skipped: this run's nodes keep no peer copies"
    else:
        why = gather_peer_checkpoint(manifest, tier, Path(resume.folder), group)
    if why is None:
        say(f"resuming from the peer tier at step {resume.step}")
        return resume, None
    fallback = resume.fallback
    say(f"{why}; resuming from " + (f"the store at step {fallback.step}" if fallback else "step 0"))
    if fallback is not None and local_rank == 0:
        copies = LocalCopies(Path(job.local_copies)) if job.local_copies else None
        fetch_checkpoint(store, fallback.manifest(store), Path(fallback.folder), copies)
    dist.barrier(group=group)  # the node's other ranks read the folder once it is whole
    return fallback, why
