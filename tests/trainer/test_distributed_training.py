"""Real torchrun ranks (gloo): exact resume after a SIGKILL, resharding, corrupt checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infra.errors import IntegrityError
from infra.store.protocol import verify_stored_files
from tests.trainer.conftest import MODEL, Trainer
from trainer.checkpoint import fetch_checkpoint, load_model_weights
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import CheckpointError, RanksFailed
from trainer.evaluate import evaluate_checkpoint
from trainer.job import ResumePoint, TrainJob
from trainer.launch import RANK_SCRIPT
from trainer.manifest import (
    CommittedCheckpoint,
    committed_steps,
    find_latest,
    load_for_init,
    manifest_key,
    read_manifest,
)
from trainer.model import GPT, WEIGHT_LAYOUT, GPTConfig, laid_out_as
from workflows.contracts.spec import TrainSpec

TRAIN = TrainSpec(
    steps=120, batch_size=8, learning_rate=3e-3, warmup_steps=10, log_every=5,
    checkpoint_every=20, keep_checkpoints=10, seed=11,
)  # fmt: skip


@pytest.fixture(scope="module")
def reference_job(trainer: Trainer) -> TrainJob:
    """An uninterrupted 2-rank run: the curve every resumed run must reproduce."""
    job = trainer.job("reference", TRAIN)
    trainer.run(job, ranks=2)
    return job


@pytest.fixture(scope="module")
def reference(trainer: Trainer, reference_job: TrainJob) -> CheckpointManifest:
    found = find_latest(trainer.store, "reference", max_generation=1)
    assert found is not None and found.step == 120
    return found.manifest


def weights(trainer: Trainer, manifest: CheckpointManifest, tag: str) -> dict[str, torch.Tensor]:
    folder = fetch_checkpoint(trainer.store, manifest, trainer.root / "fetched" / tag)
    model = GPT(GPTConfig(**manifest.network))
    load_model_weights(model, folder)
    return model.state_dict()


def resume_point(trainer: Trainer, manifest: CheckpointManifest, tag: str, key: str) -> ResumePoint:
    folder = fetch_checkpoint(trainer.store, manifest, trainer.root / "fetched" / tag)
    return ResumePoint(
        folder=str(folder),
        step=manifest.step,
        tokens_seen=manifest.tokens_seen,
        manifest_key=key,
        loss_history=manifest.loss_history,
    )


def test_checkpoints_commit_with_a_manifest_listing_every_file(
    trainer: Trainer, reference: CheckpointManifest
) -> None:
    assert committed_steps(trainer.store, "reference") == [120, 100, 80, 60, 40, 20]
    assert reference.world_size == 2 and reference.generation == 1
    assert reference.layout == {
        "replicate": 2, "shard": 1, "tensor": 1, "strategy": "ddp", "world_size": 2,
    }  # fmt: skip
    assert reference.samples_seen == 120 * TRAIN.batch_size
    assert reference.data_cursor["samples_seen"] == reference.samples_seen
    assert {f.name for f in reference.files} >= {".metadata", "__0_0.distcp"}
    verify_stored_files(trainer.store, reference.files, "checkpoint file")
    assert [s for s, _ in reference.loss_history] == list(range(5, 121, 5))


def test_each_logged_step_says_how_much_of_it_the_sdk_took(reference_job: TrainJob) -> None:
    """The share of each logged window that the ranks spent in the SDK's own per-step code:
    what the platform adds to a step (bench/trainer.py reports it beside the throughput)."""
    events = [
        json.loads(line) for line in Path(reference_job.progress_file).read_text().splitlines()
    ]
    shares = [e["sdk_share"] for e in events if e["event"] == "step"]
    assert len(shares) == 1 + 120 // TRAIN.log_every  # the first step of a start, then the grid
    assert all(0 < share < 1 for share in shares), shares


def killed_and_resumed(
    trainer: Trainer, make: Callable[..., TrainJob], ranks: int
) -> CommittedCheckpoint:
    """SIGKILL the ranks of `make()` after its first commit, resume it from there as
    `make(resume=..., generation=2)` on as many ranks, and return its last checkpoint."""
    job = make()
    workdir = Path(job.progress_file).parent

    async def run_and_kill() -> None:
        task = await trainer.start_until_committed(job, ranks=ranks)
        for pid in job_processes(workdir / "job.json"):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(Exception, match="exited with status"):
            await task

    asyncio.run(run_and_kill())
    found = find_latest(trainer.store, job.run_id, max_generation=1)
    steps = job.train["steps"]
    assert found is not None and found.step < steps, "the kill came too late to test resume"

    resume = resume_point(trainer, found.manifest, job.run_id, found.key)
    trainer.run(make(resume=resume, generation=2), ranks=ranks)
    final = find_latest(trainer.store, job.run_id, max_generation=2)
    assert final is not None and final.step == steps and final.generation == 2
    return final


def test_killed_run_resumes_exactly(trainer: Trainer, reference: CheckpointManifest) -> None:
    """SIGKILL the ranks after the first commit; the resumed run matches bit for bit."""
    final = killed_and_resumed(trainer, lambda **kw: trainer.job("killed", TRAIN, **kw), ranks=2)
    assert final.manifest.loss_history == reference.loss_history
    assert final.tokens_seen == reference.tokens_seen
    for name, tensor in weights(trainer, reference, "ref").items():
        assert torch.equal(tensor, weights(trainer, final.manifest, "killed-final")[name]), name


# With the slow tests, to keep `make test` within 15 minutes (16 s); two ranks' exact resume
# stays in test_killed_run_resumes_exactly.
@pytest.mark.slow
def test_three_ranks_resume_exactly(trainer: Trainer) -> None:
    """Over three ranks a ring all-reduce adds an element's values in an order that depends on
    where it sits in DDP's bucket, and DDP lays its buckets out anew after a process's first
    backward: unless every attempt starts in the same layout (trainer.ddp_buckets), the resumed
    run's first step adds up otherwise and the run drifts in the last bits."""
    three = TRAIN.model_copy(update={"steps": 40, "batch_size": 12, "checkpoint_every": 10})
    trainer.run(trainer.job("three", three), ranks=3)
    reference = find_latest(trainer.store, "three", max_generation=1)
    assert reference is not None and reference.step == 40
    final = killed_and_resumed(trainer, lambda **kw: trainer.job("three-killed", three, **kw),
                               ranks=3)  # fmt: skip
    assert final.manifest.loss_history == reference.manifest.loss_history
    ours = weights(trainer, final.manifest, "three-killed-final")
    for name, tensor in weights(trainer, reference.manifest, "three").items():
        assert torch.equal(tensor, ours[name]), name


def test_resume_on_a_different_world_size(trainer: Trainer, reference: CheckpointManifest) -> None:
    """A 2-rank checkpoint resumes on 1 rank: same global batch, same curve (to rounding)."""
    key = manifest_key("reference", 60, generation=1)
    resume = resume_point(trainer, read_manifest(trainer.store, key), "reshard", key)
    trainer.run(trainer.job("reshard", TRAIN, resume=resume, generation=2), ranks=1)
    final = find_latest(trainer.store, "reshard", max_generation=2)
    assert final is not None and final.manifest.world_size == 1
    ours = dict((int(s), v) for s, v in final.manifest.loss_history)
    theirs = dict((int(s), v) for s, v in reference.loss_history)
    for step in range(65, 121, 5):
        assert ours[step] == pytest.approx(theirs[step], abs=2e-3), step


def test_corrupt_and_torn_checkpoints_fall_back(
    trainer: Trainer, reference: CheckpointManifest
) -> None:
    store = trainer.store
    # Copy the reference's last two checkpoints to a new run so the others stay intact.
    for step in (100, 120):
        for key in store.list(f"runs/reference/checkpoints/step-{step}/"):
            store.put_bytes(key.replace("runs/reference/", "runs/damaged/"), store.get_bytes(key))
    for key in store.list("runs/damaged/"):
        if key.endswith("MANIFEST.json"):
            manifest = json.loads(store.get_bytes(key))
            for entry in manifest["files"]:
                entry["key"] = entry["key"].replace("runs/reference/", "runs/damaged/")
            store.put_bytes(key, json.dumps(manifest).encode())
    shard = next(
        k for k in store.list("runs/damaged/checkpoints/step-120/") if k.endswith(".distcp")
    )
    data = bytearray(store.get_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(shard, bytes(data))
    # A torn save: files of step 140 but no manifest.
    store.put_bytes("runs/damaged/checkpoints/step-140/gen-1/__0_0.distcp", b"partial")

    skipped: list[str] = []
    found = find_latest(store, "damaged", max_generation=1, on_skip=skipped.append)
    assert found is not None and found.step == 100
    assert len(skipped) == 1 and shard in skipped[0] and "corrupt" in skipped[0]
    with pytest.raises(IntegrityError, match="is corrupt"):
        fetch_checkpoint(
            store, read_manifest(store, manifest_key("damaged", 120, 1)), trainer.root / "bad"
        )
    # Manifests from a later generation than the caller's are never used.
    assert find_latest(store, "damaged", max_generation=0) is None


def test_evaluation_in_a_plain_process(trainer: Trainer, reference: CheckpointManifest) -> None:
    folder = fetch_checkpoint(trainer.store, reference, trainer.root / "fetched" / "eval")
    manifest = trainer.snapshot.manifest
    tokenizer = trainer.root / "tokenizer.json"
    trainer.store.get_file(manifest.tokenizer.key, tokenizer)
    result = evaluate_checkpoint(
        checkpoint_folder=folder,
        model_config=reference.network,
        val_shards=[trainer.store.root / s.key for s in manifest.splits["val"].shards],
        dtype=manifest.dtype,
        tokenizer_file=tokenizer,
        batch_size=8,
        max_batches=5,
        prompts=["ROMEO:", "JULIET:"],
        sample_tokens=30,
        seed=0,
    )
    assert result.val_tokens == 5 * 8 * 32
    assert 1.0 < result.val_loss < reference.loss_history[0][1]  # it learned something
    for prompt, sample in zip(["ROMEO:", "JULIET:"], result.samples, strict=True):
        assert sample.startswith(prompt) and len(sample) > len(prompt)


def test_fine_tuning_starts_from_a_checkpoint_s_weights(
    trainer: Trainer, reference: CheckpointManifest
) -> None:
    key = manifest_key("reference", 120, generation=1)
    found = load_for_init(trainer.store, key, reference.network)
    folder = fetch_checkpoint(trainer.store, found.manifest, trainer.root / "fetched" / "init")
    short = TRAIN.model_copy(update={"steps": 10, "warmup_steps": 1, "learning_rate": 1e-4})
    trainer.run(trainer.job("tuned", short, init_weights=str(folder)), ranks=1)
    tuned = find_latest(trainer.store, "tuned", max_generation=1)
    assert tuned is not None and tuned.step == 10
    scratch_first, trained_last = reference.loss_history[0][1], reference.loss_history[-1][1]
    # It starts where the reference ended, far below where training from scratch starts.
    assert tuned.manifest.loss_history[0][1] < trained_last + 0.1 < scratch_first - 0.5

    other = {**reference.network, "n_layer": 3, "dropout": 0.1}
    with pytest.raises(CheckpointError, match=r"different network \(n_layer: 2 there, 3 here\)"):
        load_for_init(trainer.store, key, other)
    with pytest.raises(CheckpointError, match="no checkpoint manifest at"):
        load_for_init(trainer.store, manifest_key("reference", 7, 1), other)


def job_processes(job_file: Path, launcher: bool = False) -> list[int]:
    """The rank processes running `trainer/entry.py <job_file>`, or with `launcher` its
    torchrun (a forked rank's name is one string: trainer.entry.as_a_fresh_rank)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            RANK_SCRIPT.encode() in cmdline
            and str(job_file).encode() in cmdline
            and (b"torch.distributed.run" in cmdline) == launcher
        ):
            pids.append(int(proc.name))
    return pids


# With the slow tests (make test's 15 minutes): the layout rule itself (trainer.model's
# stored_layout and laid_out_as) is what every resume in the default suite goes through.
@pytest.mark.slow
def test_a_checkpoint_from_before_the_fused_layout_resumes_in_its_own(trainer: Trainer) -> None:
    """A run begun before qkv was fused (separate q, k, v with biases, a model_config without
    the layout keys) resumes after the upgrade: the node agent builds the GPT as the
    checkpoint is laid out (trainer.model.laid_out_as), not as the spec's defaults say."""
    before = MODEL.model_copy(update={"fused_qkv": False, "bias": True})
    first = TRAIN.model_copy(update={"steps": 20, "checkpoint_every": 10})
    trainer.run(trainer.job("old-layout", first, model=before), ranks=1)
    key = manifest_key("old-layout", 20, generation=1)
    manifest = read_manifest(trainer.store, key)
    stored = {k: v for k, v in manifest.network.items() if k not in WEIGHT_LAYOUT}
    resume = resume_point(trainer, manifest, "old-layout", key)
    more = TRAIN.model_copy(update={"steps": 30, "checkpoint_every": 10})

    as_the_spec_says = trainer.job("old-layout", more, resume=resume, generation=2)
    with pytest.raises(RanksFailed, match=r"attn\.q"):  # the fused GPT cannot take these weights
        trainer.run(as_the_spec_says, ranks=1)

    job = trainer.job("old-layout", more, resume=resume, generation=3)
    job.model = laid_out_as(job.model, stored)  # what the node agent does
    trainer.run(job, ranks=1)
    final = find_latest(trainer.store, "old-layout", max_generation=3)
    assert final is not None and final.step == 30
    assert final.manifest.network["fused_qkv"] is False
