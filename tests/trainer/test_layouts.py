"""Declared layouts on real torchrun ranks (gloo): DDP, FSDP2, TP and FSDP+TP train the same
curve; checkpoints reshard to another layout; the data cursor survives a change of ranks;
SIGTERM checkpoints and stops."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from infra.processes import free_port
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import (
    job_processes,
    resume_point,
)
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import RanksFailed
from trainer.launch import Rendezvous, run_ranks
from trainer.manifest import find_latest, manifest_key, read_manifest
from workflows.contracts.spec import TrainSpec

TRAIN = TrainSpec(
    steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=5, log_every=5,
    checkpoint_every=10, keep_checkpoints=10, seed=5,
)  # fmt: skip
FSDP = {"replicate": 1, "shard": 2, "tensor": 1}
TP = {"replicate": 1, "shard": 1, "tensor": 2}
FSDP_TP = {"replicate": 1, "shard": 2, "tensor": 2}


def losses(manifest: CheckpointManifest) -> dict[int, float]:
    return {int(step): loss for step, loss in manifest.loss_history}


def final(trainer: Trainer, run: str, generation: int = 1) -> CheckpointManifest:
    found = find_latest(trainer.store, run, max_generation=generation)
    assert found is not None and found.step == TRAIN.steps
    return found.manifest


def sample_log(path: Path) -> dict[int, Counter]:
    """step → multiset of the samples every rank trained on in that step."""
    per_step: dict[int, Counter] = {}
    for line in path.read_text().splitlines():
        step, _rank, *indices = (int(v) for v in line.split())
        per_step.setdefault(step, Counter()).update(indices)
    return per_step


@pytest.fixture(scope="module")
def ddp(trainer: Trainer) -> CheckpointManifest:
    log = trainer.root / "ddp-samples.log"
    trainer.run(trainer.job("ddp", TRAIN, sample_log=str(log)), ranks=2)
    return final(trainer, "ddp")


@pytest.fixture(scope="module")
def fsdp(trainer: Trainer) -> CheckpointManifest:
    trainer.run(trainer.job("fsdp", TRAIN, layout=FSDP), ranks=2)
    return final(trainer, "fsdp")


@pytest.fixture(scope="module")
def tp(trainer: Trainer) -> CheckpointManifest:
    trainer.run(trainer.job("tp", TRAIN, layout=TP), ranks=2)
    return final(trainer, "tp")


def test_every_layout_trains_the_curve_of_plain_data_parallel(
    trainer: Trainer, ddp: CheckpointManifest, fsdp: CheckpointManifest, tp: CheckpointManifest
) -> None:
    trainer.run(trainer.job("fsdp-tp", TRAIN, layout=FSDP_TP), ranks=4)
    both = final(trainer, "fsdp-tp")
    assert fsdp.layout["strategy"] == "fsdp" and tp.layout["strategy"] == "tp"
    assert both.layout["strategy"] == "fsdp+tp" and both.world_size == 4
    reference = losses(ddp)
    for other in (fsdp, tp, both):
        for step, loss in losses(other).items():
            # Only the order of floating-point reductions differs between layouts.
            assert loss == pytest.approx(reference[step], abs=1e-4), (other.layout, step)


@pytest.mark.parametrize("source", ["fsdp", "tp"])
def test_a_sharded_checkpoint_resumes_on_one_plain_rank(
    trainer: Trainer, request: pytest.FixtureRequest, source: str
) -> None:
    """FSDP on 2 ranks → 1 rank, TP 2 → TP 1: DCP reshards the saved DTensors on load."""
    run = request.getfixturevalue(source)
    key = manifest_key(source, 20, generation=1)
    resume = resume_point(trainer, read_manifest(trainer.store, key), f"{source}-one", key)
    trainer.run(trainer.job(f"{source}-one", TRAIN, resume=resume, generation=2), ranks=1)
    resumed = final(trainer, f"{source}-one", generation=2)
    assert resumed.layout["strategy"] == "single" and resumed.world_size == 1
    theirs = losses(run)
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(theirs[step], abs=1e-4), step


# With the slow tests, to keep `make test` within 15 minutes (12 s); resharding to another
# world size stays here (tests/trainer/test_distributed_training.py).
@pytest.mark.slow
def test_changing_data_parallel_ranks_neither_skips_nor_repeats_a_sample(
    trainer: Trainer, ddp: CheckpointManifest
) -> None:
    """Resume the 2-rank run's step-20 checkpoint on 1 rank and on 4 FSDP ranks: every later
    step trains on exactly the samples the uninterrupted run did."""
    reference = sample_log(trainer.root / "ddp-samples.log")
    key = manifest_key("ddp", 20, generation=1)
    for ranks, layout in ((1, {}), (4, {"replicate": 1, "shard": 4, "tensor": 1})):
        run = f"ddp-on-{ranks}"
        log = trainer.root / f"{run}-samples.log"
        resume = resume_point(trainer, read_manifest(trainer.store, key), run, key)
        job = trainer.job(
            run, TRAIN, resume=resume, generation=2, layout=layout, sample_log=str(log)
        )
        trainer.run(job, ranks=ranks)
        resumed = sample_log(log)
        assert sorted(resumed) == list(range(20, 40))
        for step in range(20, 40):
            assert resumed[step] == reference[step], (ranks, step)
    every = Counter()
    for counter in reference.values():
        every.update(counter)
    assert max(every.values()) == 1, "a sample repeated inside one epoch"


# With the slow tests, to keep `make test` within 15 minutes (19 s); a SIGTERM agreed at one
# step is tested fast in tests/trainer/test_library_saves.py.
@pytest.mark.slow
def test_sigterm_finishes_the_step_commits_and_stops(trainer: Trainer) -> None:
    long = TRAIN.model_copy(update={"steps": 100_000, "checkpoint_every": 100_000})
    job = trainer.job("sigterm", long)
    workdir = Path(job.progress_file).parent
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", "sigterm-1", 1, 2)
    seen: list[dict] = []

    async def run_and_terminate():
        task = asyncio.create_task(run_ranks(job, workdir, rdzv, on_progress=seen.append))
        deadline = time.monotonic() + 120
        while not seen or seen[-1].get("step", 0) < 10:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        (launcher,) = job_processes(workdir / "job.json", launcher=True)
        os.kill(launcher, signal.SIGTERM)  # torchrun passes it to its ranks
        return await asyncio.wait_for(task, 60)

    tail = asyncio.run(run_and_terminate())
    assert tail.stopped and tail.latest["stop_reason"] == "preempted"
    found = find_latest(trainer.store, "sigterm", max_generation=1)
    assert found is not None and found.step == tail.latest["step"] >= 10
    assert not job_processes(workdir / "job.json"), "a rank outlived its launcher"


def test_rank_order_follows_the_allocation_not_arrival(trainer: Trainer) -> None:
    """Two node agents' torchruns on one rendezvous; the second node in the allocation starts
    first, and still gets rank 1 (c10d's dynamic rendezvous would make it rank 0)."""
    short = TRAIN.model_copy(update={"steps": 5})
    jobs = [trainer.job("order", short, node_index=i) for i in range(2)]
    endpoint = f"127.0.0.1:{free_port()}"

    async def start(index: int, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        job = jobs[index]
        rdzv = Rendezvous(endpoint, "order-1", nnodes=2, nproc_per_node=1, node_rank=index)
        await run_ranks(job, Path(job.progress_file).parent, rdzv, on_progress=lambda _: None)

    async def both() -> None:
        await asyncio.wait_for(asyncio.gather(start(1, 0.0), start(0, 3.0)), 180)

    asyncio.run(both())
    for index, job in enumerate(jobs):
        events = [json.loads(line) for line in Path(job.progress_file).read_text().splitlines()]
        started = next(e for e in events if e["event"] == "started")
        assert started["rank"] == index


def test_corrupt_gradients_roll_back_to_the_last_checkpoint(
    trainer: Trainer, ddp: CheckpointManifest
) -> None:
    """NaN gradients on one rank (`forgeline chaos corrupt-grad`) stop the gang before anything
    is saved; resuming from the last manifest reproduces the clean run exactly."""
    job = trainer.job("corrupt", TRAIN)
    workdir = Path(job.progress_file).parent
    job.chaos_file = str(workdir / "CORRUPT_GRAD")

    # Aimed between two checkpoints (`--at-step 25`): the rollback must go to step 20.
    Path(job.chaos_file).parent.mkdir(parents=True, exist_ok=True)
    Path(job.chaos_file).write_text("corrupt-grad 25\n")
    with pytest.raises(
        RanksFailed, match=r"non-finite loss or gradients at step 25 \(suspect ranks \[0\]\)"
    ):
        trainer.run(job, ranks=2)
    # The all-reduce spread the NaN to every rank; the norm before it names the one it came from.
    events = [json.loads(line) for line in Path(job.progress_file).read_text().splitlines()]
    (health,) = [e for e in events if e["event"] == "health"]
    verdict = (health["kind"], health["rank"], health["action"], health["step"])
    assert verdict == ("corruption", 0, "quarantine", 25)
    found = find_latest(trainer.store, "corrupt", max_generation=1)
    assert found is not None and found.step == 20
    assert all(math.isfinite(loss) for _, loss in found.manifest.loss_history)
    resume = resume_point(trainer, found.manifest, "corrupt", found.key)
    trainer.run(trainer.job("corrupt", TRAIN, resume=resume, generation=2), ranks=2)
    assert final(trainer, "corrupt", generation=2).loss_history == ddp.loss_history
