"""The job a node's ranks are handed, made before they are launched.

Before a generation's ranks start, the node agent brings what they will read into its node
cache (the dataset's shards, the checkpoint to resume from, the weights a fine-tune starts
from, the run's code), builds the Python environment the code declares, restores a script's own
checkpoint folder, and writes it all down as one TrainJob.

Apart from activities.node, which launches the ranks, heartbeats and reports on them: setting a
job up runs once per attempt, before anything is launched, and reads only the store and the
node's cache. The agent lays out its folders for the run and hands them over (`JobSite`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from temporalio.exceptions import ApplicationError

from activities.fetch import NodeCacheLease
from activities.script_folders import keeps_its_own, restore_script_folder
from infra import code_snapshot
from infra.containers import ImageUnusable, ensure_image
from infra.store.protocol import ObjectStore
from infra.user_envs import EnvironmentBuildFailed, UserEnv
from trainer.checkpoint_manifest import CheckpointManifest, PeerManifest
from trainer.job import CHAOS_FILE, ResumePoint, TrainJob
from trainer.local_copies import LocalCopies
from trainer.manifest import read_manifest
from trainer.model import laid_out_as
from workflows.contracts.models import CheckpointRef, NodeTrainInput
from workflows.gang_outcome import USER_CODE_ERROR

# In the generation's folder: the agent's request that the ranks checkpoint and exit
# (activities.node.stop_training writes it; the job names it to the ranks).
STOP_FILE = "STOP"


@dataclass(frozen=True)
class JobSite:
    """This node as a job is set up on it: who it is, the store its ranks use, and its folders
    for the run (activities.node lays them out, and uses them once the ranks run)."""

    node_id: str
    node_domain: str  # the node's pod, as its grant names it
    store: ObjectStore
    twin_store_url: str
    generation_dir: Path  # this generation's: job file, logs, progress, staging
    copies: LocalCopies  # the files of the run's checkpoint this node's ranks committed last
    peer_copies: Path  # the peer tier's files on this node


def prepare_job(site: JobSite, inp: NodeTrainInput, cache: NodeCacheLease) -> TrainJob:
    """This node's job for the generation, every file it names in the node's cache (or, for
    a script that keeps its own checkpoints, its folder restored) before the ranks start."""
    dataset = cache.dataset_manifest(inp.dataset)
    shards = cache.split(dataset, "train")
    # The built-in GPT is built as the weights it starts from are laid out: a run begun
    # (or a base model trained) before the fused layout resumes in the layout it has.
    resume, stored = _resume_from(site, inp, cache)
    code_dir = _user_code(site.store, inp, cache, site.generation_dir.parent / "code")
    init_weights = ""
    if inp.init_from is not None and inp.resume is None:
        folder, base = cache.checkpoint(inp.init_from)
        init_weights = str(folder)
        stored = base.network
    spec = inp.spec
    node_ids = [node.node_id for node in inp.allocation.nodes]
    gen_dir = site.generation_dir
    job = TrainJob(
        run_id=inp.run_id,
        run_uid=inp.run_uid,
        node_id=site.node_id,
        node_index=node_ids.index(site.node_id),
        layout=spec.job_layout(),
        val_shards=(
            [str(p) for p in cache.split(dataset, "val")]
            if spec.train.eval_every or inp.code is not None  # a script evaluates itself
            else []
        ),
        generation=inp.allocation.generation,
        model=laid_out_as(
            {**spec.model.architecture(), "vocab_size": inp.dataset.vocab_size},
            stored if inp.code is None else None,  # a script's model_config is its own
        ),
        train={
            **spec.train.model_dump(),
            # MFU against what this gang's devices can do, unless the spec says otherwise.
            "peak_flops_per_gpu": spec.train.peak_flops_per_gpu
            or inp.allocation.device_peak_flops(spec.train.threads_per_rank),
        },
        train_shards=[str(p) for p in shards],
        dtype=dataset.dtype,
        store_url=site.store.url,
        twin_store_url=site.twin_store_url,
        staging_dir=str(gen_dir / "staging"),
        local_copies=str(site.copies.folder),
        # A multi-node run (or an elastic one, shrunk) holds its nodes whole, so one run at
        # a time prunes the folder; a single-node run has no peer to send to.
        peer_copies=str(site.peer_copies)
        if spec.train.peer_every
        and (spec.resources.nodes > 1 or spec.resources.min_nodes is not None)
        else "",
        node_domain=site.node_domain,
        progress_file=str(gen_dir / "progress.jsonl"),
        stop_file=str(gen_dir / STOP_FILE),
        chaos_file=str(gen_dir / CHAOS_FILE),
        lineage={
            "dataset_snapshot": inp.dataset.snapshot_id,
            "dataset_manifest_sha256": inp.dataset.manifest_sha256,
            "init_from": inp.init_from.manifest_key if inp.init_from else None,
        },
        resume=resume,
        init_weights=init_weights,
        mtbf_s=spec.recovery.gang_mtbf_s(
            spec.resources.nodes,
            inp.allocation.fleet_node_seconds,
            inp.allocation.fleet_fail_stops,
        ),
        nodes=len(node_ids),
        stragglers=spec.recovery.straggler_settings(),
        spikes=spec.recovery.spike_settings(),
        shadow=spec.recovery.shadow_settings(),
        code_dir=str(code_dir) if code_dir else "",
    )
    if keeps_its_own(inp):
        restore_script_folder(site.store, inp, job)
    return job


def _resume_from(
    site: JobSite, inp: NodeTrainInput, cache: NodeCacheLease
) -> tuple[ResumePoint | None, dict]:
    """Where the ranks resume, and how the weights they resume are laid out (their manifest's
    model_config); None and {} for a gang that starts afresh."""
    if keeps_its_own(inp):
        return None, {}  # the script's own folder is restored once the job is made
    if inp.resume is not None and inp.resume.tier == "peer":
        return _peer_resume(site, inp.resume)
    if inp.resume is not None:
        folder, manifest = cache.checkpoint(inp.resume, site.copies)
        return _resume_point(inp.resume, folder, manifest), manifest.network
    return None, {}


def _peer_resume(site: JobSite, ref: CheckpointRef) -> tuple[ResumePoint, dict]:
    """A peer-tier checkpoint: the ranks gather its files from the gang's nodes, or fetch the
    fallback's from the store. Both manifests are kept beside the job."""
    gen_dir = site.generation_dir
    manifest = PeerManifest.parse(site.store.get_bytes(ref.manifest_key), ref.manifest_key)
    resume = _resume_point(ref, gen_dir / "peer-checkpoint", manifest)
    resume.manifest_file = _keep_beside_job(manifest, gen_dir / "peer-manifest.json")
    if (fallback := ref.fallback) is not None:
        kept = read_manifest(site.store, fallback.manifest_key)
        resume.fallback = _resume_point(fallback, gen_dir / "store-checkpoint", kept)
        resume.fallback.manifest_file = _keep_beside_job(kept, gen_dir / "store-manifest.json")
    return resume, manifest.network


def _user_code(
    store: ObjectStore, inp: NodeTrainInput, cache: NodeCacheLease, dest: Path
) -> Path | None:
    """The run's own copy of its code snapshot in `dest` (from this node's cache, every
    file verified); None for the built-in trainer."""
    if inp.code is None:
        return None
    ref = inp.code
    files = code_snapshot.manifest_files(store, ref.snapshot_id, ref.manifest_sha256)
    return code_snapshot.materialize(store, ref.snapshot_id, files, cache.code(ref), dest)


async def job_environment(
    job: TrainJob, cache: NodeCacheLease, node_id: str, image: str | None = None
) -> UserEnv | None:
    """The Python environment the run's code folder declares (infra.user_envs), built once
    on this node, before its ranks start; None when it declares none, or when the run names an
    `image` (pulled and checked here instead: infra.containers). A build that fails, or an
    image that cannot run the ranks, is the user's to fix: said once, by this agent, not as an
    ImportError by every rank."""
    if image is not None:
        try:
            await asyncio.to_thread(ensure_image, image)
        except ImageUnusable as err:
            raise ApplicationError(
                f"node {node_id}: {err}", type=USER_CODE_ERROR, non_retryable=True
            ) from err
        return None
    if not job.code_dir:
        return None
    try:
        return await asyncio.to_thread(cache.environment, Path(job.code_dir))
    except EnvironmentBuildFailed as err:
        raise ApplicationError(
            f"train.code's requirements cannot be installed on node {node_id}: {err}",
            type=USER_CODE_ERROR,
            non_retryable=True,
        ) from err


def _keep_beside_job(manifest: CheckpointManifest, path: Path) -> str:
    """A manifest the ranks read from the node's disk rather than each from the store."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(manifest.dump_bytes())
    return str(path)


def _resume_point(ref: CheckpointRef, folder: Path, manifest: CheckpointManifest) -> ResumePoint:
    """Where the ranks resume: the checkpoint's step and the loop's state its manifest keeps."""
    return ResumePoint(
        folder=str(folder),
        step=ref.step,
        tokens_seen=ref.tokens_seen,
        manifest_key=ref.manifest_key,
        loss_history=[[step, loss] for step, loss in manifest.loss_history],
        samples_seen=manifest.samples_seen,
        tier=ref.tier,
    )
