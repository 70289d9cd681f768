"""A real dataset snapshot and real torchrun training jobs for the trainer's tests."""

from __future__ import annotations

import asyncio
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch.distributed as dist

from dataprep.filters import FilterSettings
from dataprep.settings import SnapshotSettings
from dataprep.snapshot import Snapshot, prepare_snapshot
from infra.processes import free_port
from infra.store.local import LocalStore
from tests.conftest import SHAKESPEARE
from trainer.device_env import GrantedDevices
from trainer.job import ResumePoint, TrainJob
from trainer.launch import Rendezvous, printed_stacks, run_ranks
from trainer.manifest import committed_steps
from trainer.progress_tail import ProgressTail
from workflows.contracts.spec import ModelSpec, RecoverySpec, TrainSpec

_UNTIL_EVERY_RANK_WROTE = """
import os as _os, time as _time
_ours = out.name.rsplit("-", 1)[0] + "-*" + out.suffix
while len(list(out.parent.glob(_ours))) < int(_os.environ["WORLD_SIZE"]):
    _time.sleep(0.02)
"""


def returns_when_every_rank_wrote(script: str) -> str:
    """A rank script that writes what it saw to `out` (beside its job file) and never trains,
    made to return only once every rank's file of the same name is there. The first rank to
    return ends the whole gang, so on a busy machine another rank could be stopped before it
    wrote (it happened in CI, on two test workers)."""
    return textwrap.dedent(script) + _UNTIL_EVERY_RANK_WROTE


MODEL = ModelSpec(n_layer=2, n_head=2, n_embd=32, block_size=32)


@dataclass
class Trainer:
    """Runs single-node torchrun jobs against one store, each in its own folder."""

    root: Path
    store: LocalStore
    snapshot: Snapshot
    jobs: int = field(default=0)

    @property
    def shards(self) -> list[str]:
        return [str(self.store.root / s.key) for s in self.snapshot.manifest.splits["train"].shards]

    def job(
        self,
        run_id: str,
        train: TrainSpec,
        resume: ResumePoint | None = None,
        generation: int = 1,
        layout: dict | None = None,
        model: ModelSpec = MODEL,
        **fields: object,
    ) -> TrainJob:
        self.jobs += 1
        work = self.root / f"job-{self.jobs}"
        fields.setdefault("spikes", RecoverySpec().spike_settings())  # as a node agent sets it
        return TrainJob(
            run_id=run_id,
            node_id="n0",
            generation=generation,
            layout=layout or {},
            model={
                **model.architecture(),
                "vocab_size": self.snapshot.manifest.tokenizer.vocab_size,
            },
            train=train.model_dump(),
            train_shards=self.shards,
            dtype=self.snapshot.manifest.dtype,
            store_url=self.store.url,
            staging_dir=str(work / "staging"),
            progress_file=str(work / "progress.jsonl"),
            resume=resume,
            **fields,
        )

    async def start_until_committed(
        self, job: TrainJob, ranks: int, **launch: object
    ) -> asyncio.Task:
        """Start the job's ranks in the background; return their task once the run has
        committed its first checkpoint (the moment the fault tests strike). `launch`: more of
        run_ranks's arguments."""
        rdzv = Rendezvous(f"127.0.0.1:{free_port()}", f"{job.run_id}-{self.jobs}", 1, ranks)
        workdir = Path(job.progress_file).parent
        task = asyncio.create_task(
            run_ranks(job, workdir, rdzv, on_progress=lambda _: None, **launch)
        )
        deadline = time.monotonic() + 120
        while not committed_steps(self.store, job.run_id):
            assert time.monotonic() < deadline and not task.done(), "no checkpoint committed"
            await asyncio.sleep(0.02)
        return task

    def run(
        self,
        job: TrainJob,
        ranks: int,
        timeout_s: float = 240,
        start_limit_s: float = 0,
        devices: GrantedDevices | None = None,
        **launch: object,
    ) -> ProgressTail:
        """Run the job to the end; past `timeout_s`, fail with the ranks' stacks and log.
        `launch`: more of run_ranks's arguments."""
        rdzv = Rendezvous(f"127.0.0.1:{free_port()}", f"{job.run_id}-{self.jobs}", 1, ranks)
        workdir = Path(job.progress_file).parent
        launch = run_ranks(
            job,
            workdir,
            rdzv,
            on_progress=lambda _: None,
            start_limit_s=start_limit_s or None,
            devices=devices,
            **launch,
        )
        try:
            return asyncio.run(asyncio.wait_for(launch, timeout_s))
        except TimeoutError:
            # run_ranks has asked the ranks for their stacks (SIGUSR1) before stopping them.
            log = (workdir / "torchrun.log").read_text(errors="replace")
            stacks = printed_stacks(workdir)
            pytest.fail(
                f"{job.run_id} did not finish in {timeout_s} s; torchrun.log:\n{log[-8000:]}"
                f"\nstacks:\n{stacks[-8000:]}"
            )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    root = tmp_path_factory.mktemp("trainer")
    corpus = root / "corpus.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:300_000])
    store = LocalStore(root / "store")
    settings = SnapshotSettings(filters=FilterSettings(min_words=1))  # speeches are short
    snapshot = prepare_snapshot([str(corpus)], settings, store, root / "dataprep")
    return Trainer(root, store, snapshot)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """This test process as a gang of one rank (gloo): what a Checkpointer needs to save."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
