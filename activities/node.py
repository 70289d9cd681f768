"""The activity a node agent runs: this node's share of a training gang.

It fetches the data and the checkpoint to resume from into the node cache, starts torchrun,
and heartbeats the ranks' progress. Cancellation (the gang is being torn down) arrives through
the heartbeat; the ranks are stopped before the cancellation is acknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.errors import domain_errors
from activities.fetch import NodeCache
from infra.settings import Settings
from infra.store import open_store
from trainer.errors import RanksFailed
from trainer.job import ResumePoint, TrainJob
from trainer.launch import Rendezvous, run_ranks
from workflows.models import NodeTrainInput, NodeTrainResult, TrainProgress

T = TypeVar("T")


class NodeActivities:
    def __init__(self, settings: Settings, node_id: str) -> None:
        self.settings = settings
        self.node_id = node_id
        self.store = open_store(settings.store)
        self.workdir = settings.home / "nodes" / node_id
        self.cache = NodeCache(self.workdir / "cache", self.store)

    @activity.defn(name="train_on_node")
    async def train_on_node(self, inp: NodeTrainInput) -> NodeTrainResult:
        allocation = inp.allocation
        generation = allocation.generation
        spec = inp.spec

        def beat(state: str, **progress: object) -> None:
            activity.heartbeat(
                TrainProgress(
                    node_id=self.node_id,
                    generation=generation,
                    total_steps=spec.train.steps,
                    state=state,
                    **progress,
                )
            )

        with domain_errors():
            job = await _heartbeating(self._prepare_job(inp), lambda: beat("fetching"))
        rdzv = Rendezvous(
            endpoint=allocation.rdzv_endpoint,
            run_id=f"{inp.run_id}-g{generation}",
            nnodes=len(allocation.nodes),
            nproc_per_node=spec.resources.gpus_per_node,
        )
        try:
            tail = await run_ranks(
                job,
                self._generation_dir(inp),
                rdzv,
                on_progress=lambda p: beat(**{"state": "starting", **p}),
                threads_per_rank=spec.train.threads_per_rank,
            )
        except RanksFailed as err:
            raise ApplicationError(str(err), type="RanksFailed") from err
        last = tail.latest
        return NodeTrainResult(
            node_id=self.node_id,
            generation=generation,
            final_step=int(last.get("step", 0)),
            final_loss=last.get("loss"),
            tokens_per_s=last.get("tokens_per_s"),
            mfu=last.get("mfu"),
        )

    def _generation_dir(self, inp: NodeTrainInput) -> Path:
        """This node's folder for one generation of a run: job file, logs, progress, staging."""
        return self.workdir / "runs" / inp.run_id / f"gen-{inp.allocation.generation}"

    async def _prepare_job(self, inp: NodeTrainInput) -> TrainJob:
        return await asyncio.to_thread(self._prepare_job_sync, inp)

    def _prepare_job_sync(self, inp: NodeTrainInput) -> TrainJob:
        dataset = self.cache.dataset_manifest(inp.dataset)
        shards = self.cache.split(dataset, "train")
        resume = None
        if inp.resume is not None:
            folder, manifest = self.cache.checkpoint(inp.resume)
            resume = ResumePoint(
                folder=str(folder),
                step=inp.resume.step,
                tokens_seen=inp.resume.tokens_seen,
                manifest_key=inp.resume.manifest_key,
                loss_history=manifest.get("loss_history", []),
            )
        gen_dir = self._generation_dir(inp)
        return TrainJob(
            run_id=inp.run_id,
            node_id=self.node_id,
            generation=inp.allocation.generation,
            model={**inp.spec.model.model_dump(), "vocab_size": inp.dataset.vocab_size},
            train=inp.spec.train.model_dump(),
            train_shards=[str(p) for p in shards],
            dtype=dataset["dtype"],
            store_url=self.store.url,
            staging_dir=str(gen_dir / "staging"),
            progress_file=str(gen_dir / "progress.jsonl"),
            lineage={
                "dataset_snapshot": inp.dataset.snapshot_id,
                "dataset_manifest_sha256": inp.dataset.manifest_sha256,
            },
            resume=resume,
        )


async def _heartbeating(work: Awaitable[T], beat: Callable[[], None], every_s: float = 1.0) -> T:
    """Await `work` while heartbeating, so a long fetch is not mistaken for a dead node."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            beat()
    except asyncio.CancelledError:
        task.cancel()
        raise
