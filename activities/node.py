"""The activity a node agent runs: this node's share of a training gang.

It fetches the data and the checkpoint to resume from into the node cache, starts torchrun,
and heartbeats the ranks' progress. Cancellation (the gang is being torn down) arrives through
the heartbeat; the ranks are stopped before the cancellation is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from temporalio import activity
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from activities.errors import domain_errors
from activities.fetch import NodeCache, NodeCacheLease
from activities.job_setup import STOP_FILE, JobSite, job_environment, prepare_job
from activities.metric_tap import MetricTap
from activities.node_confinement import (
    door_policy,
    quoted_output,
    refuse_what_this_node_cannot_run,
)
from activities.node_work import read_train_input
from activities.script_folders import keeps_its_own, script_folder_watch
from infra import node_health
from infra.containers import ContainerBox, ContainerRuntime
from infra.gpu_devices import device_minors
from infra.node_hardware import CPU
from infra.sandbox import Box
from infra.settings import Settings
from infra.user_envs import UserEnv
from registry.metric_stream import MetricShipper, MetricSpool
from trainer.device_env import GrantedDevices
from trainer.errors import NodeFault, RanksFailed, UserCodeFailed
from trainer.hang import HangWatch
from trainer.job import TrainJob
from trainer.launch import COMPILE_CACHE, LOOPBACK, Fabric, Rendezvous, run_ranks
from trainer.local_copies import LocalCopies
from trainer.rank_box import DOOR_SOCKET, Confinement, NodeConfinement, door_url, rank_box
from trainer.rank_logs import LogShipper, shipped_while_running
from trainer.store_door import StoreDoor, door_folder, door_path
from trainer.warm_launch import WarmLauncher
from workflows.contracts.cluster_models import (
    Allocation,
    CheckpointCommitted,
    NodeInfo,
    WarmInput,
)
from workflows.contracts.models import (
    HealthEvent,
    NodeStopInput,
    NodeTrainInput,
    NodeTrainResult,
    TrainProgress,
)
from workflows.contracts.names import CLUSTER_WORKFLOW_ID, HEALTH_SIGNAL
from workflows.gang_outcome import NODE_UNHEALTHY, USER_CODE_ERROR

# Health signals of each kind a node sends a run per attempt (_Reporter.new_health).
HEALTH_SIGNALS = 10

T = TypeVar("T")
# In a run's folder on the node: its ranks' copies of its newest checkpoint, and of the peer tier.
CHECKPOINT_COPIES = "checkpoint-copies"
PEER_COPIES = "peer-copies"
# How long a finished attempt waits for its metrics to reach MLflow (a healthy MLflow takes
# well under a second for a run's backlog); longer, and the run moves on without them.
METRICS_DELIVERY_S = 5.0


class NodeUnhealthy(Exception):
    """This node's own health check failed while it trained (infra.node_health)."""


@contextlib.contextmanager
def as_run_errors(node_dir: Path) -> Iterator[None]:
    """What the ranks' failure means for the run, as the error its workflow reads: the user's
    mistake fails it now (the same on every attempt and node); a node whose device says it is
    broken, or whose own check fails, is reported and the run moves on without it (the first
    also fails the node's check from now on, until it is repaired); any other crash restarts
    the gang."""
    try:
        yield
    except UserCodeFailed as err:
        raise ApplicationError(
            quoted_output(err), type=USER_CODE_ERROR, non_retryable=True
        ) from err
    except NodeFault as err:
        node_health.fail(node_dir, str(err))
        raise ApplicationError(str(err), type=NODE_UNHEALTHY, non_retryable=True) from err
    except RanksFailed as err:
        raise ApplicationError(quoted_output(err), type="RanksFailed") from err
    except NodeUnhealthy as err:
        raise ApplicationError(str(err), type=NODE_UNHEALTHY, non_retryable=True) from err


class NodeActivities:
    def __init__(
        self,
        settings: Settings,
        node_id: str,
        on_cache_changed: Callable[[dict[str, int]], Awaitable[None]] | None = None,
        fabric: Fabric = LOOPBACK,
        incarnation: str = "",
        confinement: NodeConfinement | None = None,
        container_runtime: ContainerRuntime | None = None,
    ) -> None:
        self.settings = settings
        # Whether this node boxes its ranks (trainer.rank_box.decide, at the agent's start).
        self.confinement = confinement or NodeConfinement(Confinement.UNCONFINED, "not asked")
        # What runs a spec's train.image here (infra.containers.detect; None: nothing does).
        self.container_runtime = container_runtime
        self.node_id = node_id
        self.incarnation = incarnation  # this agent process's, as it registered (NodeInfo)
        self.fabric = fabric  # the address this node advertises and its interface
        # Called with what this node holds (NodeCache.held: datasets, checkpoints) after each
        # job's fetch, which may have brought one in or evicted others.
        self.on_cache_changed = on_cache_changed
        self.store = settings.open_store()
        self.workdir = settings.home / "nodes" / node_id
        # The spool this shipper sends to MLflow; the agent starts and stops it
        # (worker.processes_main), for as long as it lives.
        self.metrics_dir = self.workdir / "metrics"
        self.shipper = MetricShipper(self.metrics_dir, settings.mlflow_uri)
        self.cache = NodeCache(self.workdir / "cache", self.store, settings.node_cache_bytes())
        self._training: set[str] = set()  # the runs whose ranks this agent runs now
        # A torchrun with its imports done, for this node's next job (trainer.warm_launch);
        # the agent makes the first at start-up (worker.processes_main).
        self.launcher = (
            WarmLauncher(self.workdir / "standby") if settings.node_warm_standby else None
        )

    @activity.defn(name="train_on_node")
    async def train_on_node(self, work: RawValue) -> NodeTrainResult:
        inp = read_train_input(work, self.workdir)  # not by the SDK: see activities.node_work
        # What the job uses (shards, checkpoint, code) is pinned until it ends: another job's
        # fetch on this node never evicts the files under these ranks.
        self._training.add(inp.run_id)
        try:
            with self.cache.lease() as cache:
                return await self._train(inp, cache)
        finally:
            self._training.discard(inp.run_id)

    async def _train(self, inp: NodeTrainInput, cache: NodeCacheLease) -> NodeTrainResult:
        refuse_what_this_node_cannot_run(
            inp, self.node_id, self.confinement, self.container_runtime
        )
        image = inp.spec.train.image
        allocation = inp.allocation
        generation = allocation.generation
        reporter = _Reporter(
            self.node_id,
            inp,
            self.workdir,
            # One node of the gang tells the cluster about commits: what a preemption would lose.
            tell_cluster=allocation.nodes[0].node_id == self.node_id,
        )
        with domain_errors():
            job = await _heartbeating(
                self._prepare_job(inp, cache), lambda: reporter.beat("fetching")
            )
            python_env = await _heartbeating(
                job_environment(job, cache, self.node_id, image),
                lambda: reporter.beat("pulling its image" if image else "building its environment"),
            )
        if self.on_cache_changed is not None:
            await self.on_cache_changed(self.cache.held())
        rdzv = Rendezvous(
            endpoint=allocation.rdzv_endpoint,
            run_id=f"{inp.run_id}-g{generation}",
            nnodes=len(allocation.nodes),
            nproc_per_node=inp.spec.resources.gpus_per_node,
            node_rank=[n.node_id for n in allocation.nodes].index(self.node_id),
        )
        reporter.stream_metrics(
            self.metrics_dir, self._generation_dir(inp.run_id, generation) / "progress.jsonl"
        )
        gen_dir = self._generation_dir(inp.run_id, generation)
        logs = LogShipper(self.store, inp.run_id, generation, self.node_id, gen_dir)
        try:
            with as_run_errors(self.workdir), self._confined(inp, job, python_env) as box:
                async with reporter.alive(), shipped_while_running(logs):
                    tail = await run_ranks(
                        job,
                        gen_dir,
                        rdzv,
                        on_progress=reporter.progress,
                        threads_per_rank=inp.spec.train.threads_per_rank,
                        hang=HangWatch(inp.spec.recovery.hang_factor, inp.spec.recovery.hang_min_s),
                        start_limit_s=inp.spec.recovery.start_limit_s,
                        fabric=self.fabric,
                        launcher=self.launcher,
                        box=box,
                        compile_cache=self._run_dir(inp.run_id) / COMPILE_CACHE,
                        devices=GrantedDevices(
                            allocation.devices_on(self.node_id),
                            cuda=self._node_info(allocation).gpu_type != CPU,
                        ),
                        python_env=python_env,
                        script_folder=script_folder_watch(
                            self.store, inp, job, self._folder_staging(inp)
                        )
                        if keeps_its_own(inp)
                        else None,
                    )
        finally:
            reporter.close_metrics()
            await reporter.flush()
        await _heartbeating(self._deliver_metrics(), lambda: reporter.beat("shipping metrics"))
        last = tail.latest
        return NodeTrainResult(
            health=[reporter.health_event(e) for e in last.get("health", [])],
            node_id=self.node_id,
            generation=generation,
            final_step=int(last.get("step", 0)),
            final_loss=last.get("loss"),
            tokens_per_s=last.get("tokens_per_s"),
            mfu=last.get("mfu"),
            stopped=tail.stopped,
            finished=last.get("state") == "done",
            stop_reason=last.get("stop_reason"),
            skipped=[last["peer_skipped"]] if "peer_skipped" in last else [],
        )

    async def _deliver_metrics(self) -> None:
        """Before the run moves on to evaluate and register: the attempt's last metrics in
        MLflow, so the model's run shows its whole curve. Bounded, and skipped while MLflow is
        down: they stay spooled and the shipper sends them when it is back."""
        if self.shipper.running:
            await asyncio.to_thread(self.shipper.deliver, METRICS_DELIVERY_S)

    @activity.defn(name="warm_cache")
    async def warm_cache(self, inp: WarmInput) -> int:
        """The hot pool: fetch a base model into this node's cache ahead of the fine-tunes
        that will ask for it (workflows.scheduling.hot_pool), then say what the node holds."""
        with domain_errors():
            size = await _heartbeating(
                asyncio.to_thread(self.cache.warm, inp.manifest_key, inp.hot),
                lambda: activity.heartbeat("fetching"),
            )
        if self.on_cache_changed is not None:
            await self.on_cache_changed(self.cache.held())
        return size

    @activity.defn(name="node_alive")
    async def node_alive(self) -> str:
        """The liveness probe a run sends when a gang fails: answered at once by a live agent,
        with its incarnation (a restarted agent's differs: the old one's work died with it).
        A dead or partitioned node never answers, and the run stops waiting for it."""
        return self.incarnation

    @activity.defn(name="stop_training")
    async def stop_training(self, inp: NodeStopInput) -> None:
        """Ask this node's ranks of one generation to checkpoint and exit (they poll the file;
        the request stands even if their training activity has not started yet)."""
        folder = self._generation_dir(inp.run_id, inp.generation)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STOP_FILE).write_text("checkpoint and exit\n")

    @contextlib.contextmanager
    def _confined(
        self, inp: NodeTrainInput, job: TrainJob, python_env: UserEnv | None
    ) -> Iterator[Box | ContainerBox | None]:
        """The box the job's ranks run in (None: this node runs them unconfined; a container
        of the spec's image where it names one), with the run's store door open for as long
        as they run: the job's store becomes the door, and no credential of the store goes
        into the box."""
        image = inp.spec.train.image
        if self.confinement.mode is not Confinement.BOX and image is None:
            yield None
            return
        run_dir = self._run_dir(inp.run_id)
        folder = door_folder(self.workdir, inp.run_id)
        job.store_url, job.twin_store_url = door_url(), ""
        gpus = device_minors(inp.allocation.devices_on(self.node_id), os.environ)
        env_folder = python_env.folder if python_env else None
        box = rank_box(job, run_dir, self._own_checkpoints(inp.run_id), folder, gpus, env_folder)
        with StoreDoor(self.store, door_policy(inp, run_dir), folder / DOOR_SOCKET):
            yield box if image is None else ContainerBox(image, box, self.node_id)

    def _own_checkpoints(self, run_id: str) -> Path:
        """Where this node's cache keeps the run's own checkpoints (NodeCacheLease.checkpoint:
        the folder of a manifest key `runs/<run>/checkpoints/...`)."""
        return self.cache.root / "checkpoints" / "runs" / run_id

    def _node_info(self, allocation: Allocation) -> NodeInfo:
        """This node as the grant carries it."""
        return next(n for n in allocation.nodes if n.node_id == self.node_id)

    def _folder_staging(self, inp: NodeTrainInput) -> Path:
        """Where a script's own folder is copied to be committed: the agent's, not in the
        run's folder, which its ranks' box can write (activities.script_folders)."""
        return self.workdir / "folder-staging" / inp.run_id / f"gen-{inp.allocation.generation}"

    def _run_dir(self, run_id: str) -> Path:
        """This node's folder for one run: its generations' folders, its code, its copies."""
        return self.workdir / "runs" / run_id

    def _generation_dir(self, run_id: str, generation: int) -> Path:
        """This node's folder for one generation of a run: job file, logs, progress, staging."""
        return self._run_dir(run_id) / f"gen-{generation}"

    def _copies(self, run_id: str) -> LocalCopies:
        """The files of the run's checkpoint this node's ranks committed last
        (trainer.local_copies): a recovering gang's survivors read their own shards from here,
        not from the store. In the run's folder, beside its staging: the ranks move a file
        there by a rename (a box binds the run's folder whole; a rename between two mounts
        fails), and no other run's ranks see it."""
        return LocalCopies(self._run_dir(run_id) / CHECKPOINT_COPIES)

    def _drop_what_other_runs_left(self) -> None:
        """Only the runs training here keep copies (one checkpoint's shards each), a compile
        cache and a door's folder: a run that left this node left them behind, and would come
        back to a node another run used. (Agents before kept one folder of copies for the whole
        node: gone too.)"""
        for legacy in (CHECKPOINT_COPIES, PEER_COPIES):
            shutil.rmtree(self.workdir / legacy, ignore_errors=True)
        for run_dir in (self.workdir / "runs").glob("*"):
            if run_dir.name not in self._training:
                for name in (CHECKPOINT_COPIES, PEER_COPIES, COMPILE_CACHE):
                    shutil.rmtree(run_dir / name, ignore_errors=True)
                shutil.rmtree(door_path(self.workdir, run_dir.name), ignore_errors=True)

    async def _prepare_job(self, inp: NodeTrainInput, cache: NodeCacheLease) -> TrainJob:
        return await asyncio.to_thread(self._prepare_job_sync, inp, cache)

    def _prepare_job_sync(self, inp: NodeTrainInput, cache: NodeCacheLease) -> TrainJob:
        self._drop_what_other_runs_left()
        return prepare_job(self._job_site(inp), inp, cache)

    def _job_site(self, inp: NodeTrainInput) -> JobSite:
        """This node and its folders for the run, as its job is set up (activities.job_setup)."""
        return JobSite(
            node_id=self.node_id,
            node_domain=self._node_info(inp.allocation).pod,
            store=self.store,
            twin_store_url=self.settings.twin_store_url,
            generation_dir=self._generation_dir(inp.run_id, inp.allocation.generation),
            copies=self._copies(inp.run_id),
            peer_copies=self._run_dir(inp.run_id) / PEER_COPIES,
        )


class _Reporter:
    """Turns the ranks' progress into heartbeats, and commits into signals to the cluster."""

    def __init__(
        self, node_id: str, inp: NodeTrainInput, node_dir: Path, tell_cluster: bool
    ) -> None:
        self.node_id = node_id
        self.inp = inp
        self.node_dir = node_dir
        self.tell_cluster = tell_cluster
        self.committed: int | None = inp.resume.step if inp.resume else None
        self.health_told = 0  # health lines of the ranks already seen
        self.health_signalled: dict[str, int] = {}  # kind -> signals sent this attempt
        self.pending: set[asyncio.Task] = set()
        self.metrics: MetricTap | None = None
        self.last_beat: TrainProgress | None = None
        self.last_beat_at = 0.0

    def stream_metrics(self, spool_dir: Path, progress_file: Path) -> None:
        """Copy the ranks' step and eval lines to this node's metric spool, on the head node of
        a run tracked in MLflow. Tracking must never cost training: failures are logged only."""
        if not self.tell_cluster or not self.inp.mlflow_run_id:
            return
        # Its own file per attempt: a retried attempt never appends to a file already shipped.
        stream = f"g{self.inp.allocation.generation}-a{activity.info().attempt}"
        try:
            spool = MetricSpool(spool_dir, self.inp.mlflow_run_id, stream)
        except (OSError, ValueError):
            activity.logger.warning("training metrics will not reach MLflow", exc_info=True)
            return
        world = len(self.inp.allocation.nodes) * self.inp.spec.resources.gpus_per_node
        self.metrics = MetricTap(progress_file, spool, world)

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.drain()  # the last lines the ranks wrote before they exited
            self.metrics.spool.close()
            self.metrics = None

    def beat(self, state: str, **progress: object) -> None:
        self.last_beat = TrainProgress(
            node_id=self.node_id,
            generation=self.inp.allocation.generation,
            total_steps=self.inp.spec.train.steps,
            state=state,
            **progress,
        )
        self.last_beat_at = time.monotonic()
        activity.heartbeat(self.last_beat)

    @contextlib.asynccontextmanager
    async def alive(self, every_s: float = 1.0) -> AsyncIterator[None]:
        """Heartbeat at least every `every_s` for as long as the body runs, also while the
        ranks are being stopped after a cancellation (up to torchrun's grace): a survivor
        whose gang the run cancelled must end cancelled, not time out and be taken for dead."""

        async def repeat_the_last() -> None:
            while True:
                await asyncio.sleep(every_s)
                if self.last_beat is not None and time.monotonic() - self.last_beat_at >= every_s:
                    activity.heartbeat(self.last_beat)
                    self.last_beat_at = time.monotonic()

        task = asyncio.create_task(repeat_the_last())
        try:
            yield
        finally:
            task.cancel()

    def progress(self, latest: dict) -> None:
        if reason := node_health.failing(self.node_dir):  # raising here stops the ranks
            raise NodeUnhealthy(f"node {self.node_id}: {reason}")
        self.beat(**{"state": "starting", **latest})
        if self.metrics is not None:
            self.metrics.poll()
        if not self.tell_cluster:  # every node's ranks log the same; one node tells
            return
        step = latest.get("checkpoint_step")
        if step is not None and step != self.committed:
            self.committed = step
            committed = CheckpointCommitted(
                run_id=self.inp.run_id, generation=self.inp.allocation.generation, step=step
            )
            # Advisory: it only sharpens the cluster's preemption choices.
            self._signal(CLUSTER_WORKFLOW_ID, "checkpoint_committed", committed)
        for event in self.new_health(latest):
            self._signal(self.inp.run_id, HEALTH_SIGNAL, self.health_event(event))

    def new_health(self, latest: dict) -> list[dict]:
        """The health lines not yet signalled that may still be: at most HEALTH_SIGNALS of
        each kind per attempt. Each signal is an event in the run's history, which cannot
        continue as new during an attempt; a node flapping for a month would otherwise fill
        it. The attempt's result and the node's progress file keep the rest."""
        kept = latest.get("health", [])  # the newest HEALTH_KEPT of `seen` (trainer.launch)
        seen = latest.get("health_seen", len(kept))
        fresh = kept[max(len(kept) - (seen - self.health_told), 0) :]
        self.health_told = seen
        out = []
        for event in fresh:
            kind = event.get("kind", "")
            if self.health_signalled.get(kind, 0) < HEALTH_SIGNALS:
                self.health_signalled[kind] = self.health_signalled.get(kind, 0) + 1
                out.append(event)
        return out

    def health_event(self, event: dict) -> HealthEvent:
        """A health line of the ranks, with the node it names (ranks know only its index)."""
        nodes = self.inp.allocation.nodes
        index = event.get("node_index")
        return HealthEvent(
            generation=self.inp.allocation.generation,
            node_id=nodes[index].node_id if index is not None and index < len(nodes) else None,
            kind=event["kind"],
            step=event.get("step"),
            evidence=event.get("evidence", ""),
            action=event.get("action", "report"),
            at=datetime.fromtimestamp(event["time"], UTC),
        )

    def _signal(self, workflow_id: str, signal: str, arg: object) -> None:
        task = asyncio.ensure_future(self._send(workflow_id, signal, arg))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _send(self, workflow_id: str, signal: str, arg: object) -> None:
        # A lost signal costs a line of status, never the training: the result repeats it.
        with contextlib.suppress(Exception):
            await activity.client().get_workflow_handle(workflow_id).signal(signal, arg)

    async def flush(self) -> None:
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


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
