"""Start this node's torchrun, follow its progress file, and stop it cleanly.

Plain asyncio, no Temporal: the node agent's activity passes a callback that heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.containers import IMAGE_PYTHON, ContainerBox, container_environment
from infra.host_network import is_loopback
from infra.parent_death import die_with_parent
from infra.sandbox import Box
from infra.user_envs import UserEnv
from trainer.container_launch import start_in_container, torchrun_in
from trainer.device_env import GrantedDevices, device_environment
from trainer.errors import NodeFault, RanksFailed, RanksHung, UserCodeFailed
from trainer.hang import HangWatch
from trainer.job import TrainJob
from trainer.progress_tail import ProgressTail
from trainer.rank_box import box_environment, standby_box
from trainer.rank_env import rank_environment
from trainer.rank_lines import MAX_READ, tail_lines
from trainer.script_folder import SCRIPT_STOP_GRACE_S, ScriptFolder, script_folder_environment
from trainer.start_watch import StartWatch, Verdict
from trainer.torchrun_process import RANK_SCRIPT, TorchrunProcess
from trainer.warm_launch import LaunchOrder, WarmLauncher

# What every rank runs (the built-in trainer or the user's script), RANK_SCRIPT: torchrun forks
# the ranks from itself and runs that file in them (`--start-method fork --run-path`): they
# inherit its imports (torch: 2.5 s a rank on a restart's path) instead of starting a fresh
# interpreter. A forked rank has torchrun's command line until it renames itself
# (trainer.entry.as_a_fresh_rank) with this path in the name, so the chaos commands and the stop
# path find ranks, and torchrun, by it.
# One frame of a stack as faulthandler prints it: `  File "/x/train.py", line 7 in main`.
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
STACKS_GLOB = "stacks-local-rank-*.txt"  # TrainJob.stacks_file, one a rank
# The folder of a job's compile caches, in its generation's folder unless the caller names one
# (the node agent keeps one per run, across generations).
COMPILE_CACHE = "compile-cache"
# How often the agent reads its ranks' progress file for a crash (reporting stays every
# report_every_s): the survivors of a dead node say so within milliseconds.
CRASH_POLL_S = 0.1


@dataclass
class Rendezvous:
    """A gang's rendezvous: torchrun's static one. Every node knows its place in the
    allocation, so the head (node_rank 0) serves the store at the endpoint and the others
    connect to it; no node waits on c10d's dynamic rendezvous, which polls once a second for
    the gang to fill (0.6 s of every start, measured), and the ranks' order is the
    allocation's by construction."""

    endpoint: str  # host:port of the store, on the gang's head
    run_id: str  # unique per generation: the store's keys are prefixed with it
    nnodes: int
    nproc_per_node: int
    node_rank: int = 0  # this node's place in the allocation; 0 serves the store


@dataclass(frozen=True)
class Fabric:
    """How this node's ranks reach their peers: the address the agent advertises and the
    interface that holds it."""

    address: str = "127.0.0.1"
    interface: str = "lo"

    def environment(self, agent_env: Mapping[str, str]) -> dict[str, str]:
        """gloo and NCCL bind the advertised interface; what the operator set on the agent
        (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, NCCL_IB_HCA and every other NCCL_* or
        TORCH_NCCL_*) reaches the ranks unchanged, since they inherit the agent's environment."""
        return {
            name: agent_env.get(name, self.interface)
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        }

    @property
    def loopback(self) -> bool:
        return is_loopback(self.address)


LOOPBACK = Fabric()  # the local stack: every node on this machine


def torchrun_argv(job_file: Path, rdzv: Rendezvous, fabric: Fabric = LOOPBACK) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(job_file, rdzv, fabric)]


def torchrun_args(job_file: Path, rdzv: Rendezvous, fabric: Fabric = LOOPBACK) -> list[str]:
    """torchrun's arguments: the same for a cold start and for a standby (trainer.warm_launch)."""
    # --local-addr is what the peers are told to reach this node at; torchrun's own guess is
    # the hostname's, which fails in a network namespace or behind a second NIC.
    placement = [] if fabric.loopback else ["--local-addr", fabric.address]
    return [
        "--nnodes", str(rdzv.nnodes),
        "--nproc-per-node", str(rdzv.nproc_per_node),
        "--rdzv-backend", "static",
        "--rdzv-endpoint", rdzv.endpoint,
        "--rdzv-id", rdzv.run_id,
        "--node-rank", str(rdzv.node_rank),
        # The others wait this long for the head's store: its agent may still be fetching
        # the dataset.
        "--rdzv-conf", "timeout=600",
        *placement,
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "--start-method", "fork",
        "--run-path", RANK_SCRIPT, str(job_file),
    ]  # fmt: skip


async def run_ranks(
    job: TrainJob,
    workdir: Path,
    rdzv: Rendezvous,
    on_progress: Callable[[dict], None],
    threads_per_rank: int = 1,
    report_every_s: float = 1.0,
    exit_grace_s: float = 5.0,
    hang: HangWatch | None = None,
    start_limit_s: float | None = None,
    fabric: Fabric = LOOPBACK,
    launcher: WarmLauncher | None = None,
    box: Box | ContainerBox | None = None,
    compile_cache: Path | None = None,
    devices: GrantedDevices | None = None,
    python_env: UserEnv | None = None,
    script_folder: ScriptFolder | None = None,
    stop_grace_s: float = SCRIPT_STOP_GRACE_S,
) -> ProgressTail:
    """Run torchrun to completion; report progress every `report_every_s` (also when idle, so
    the caller can heartbeat); raise RanksFailed with the log tail if the ranks fail, or if
    `hang` sees them make no progress (their stacks then go to their stacks files); raise
    UserCodeFailed if the script's own set-up runs past `start_limit_s` (trainer.start_watch).
    With a `launcher`, its standby becomes torchrun if it has one, and it makes the next once
    the ranks train. With a `box` (trainer.rank_box), torchrun and its ranks run inside it; a
    ContainerBox is a box in the run's image (infra.containers), with the image's Python.
    `compile_cache`: where the ranks keep what torch.compile builds (trainer.device_env; by
    default in `workdir`), writable in the box. `devices`: what the job holds of the node (its
    grant's), the only GPUs its processes are shown. `python_env`: the environment built for the
    code folder's requirements (infra.user_envs), whose interpreter runs torchrun and the ranks
    (None: the node's own). `script_folder`: the checkpoint folder of a script that keeps its
    own (trainer.script_folder), committed while the ranks run; asked to stop, its ranks get a
    SIGTERM and `stop_grace_s` to save."""
    if script_folder is not None:
        # Such a script reports no steps and calls no SDK: the hang and start watches, which
        # read those, would take it for stuck.
        hang, start_limit_s = None, None
    workdir.mkdir(parents=True, exist_ok=True)
    job_file = job.write(workdir / "job.json")
    log_file = workdir / "torchrun.log"
    Path(job.progress_file).unlink(missing_ok=True)
    world = rdzv.nnodes * rdzv.nproc_per_node
    tail = ProgressTail(Path(job.progress_file), job.resume.step if job.resume else 0, world)
    env = {
        **rank_environment(os.environ),
        "OMP_NUM_THREADS": str(threads_per_rank),
        "PYTHONUNBUFFERED": "1",
        "FORGELINE_JOB": str(job_file),  # what forgeline.init() reads in a rank script
        **script_folder_environment(job),
        **fabric.environment(os.environ),
        **device_environment(
            os.environ, workdir, compile_cache or workdir / COMPILE_CACHE, devices
        ),
    }
    if python_env is not None:
        env.update(python_env.variables(env))
    if box is not None:
        env = box_environment(env)
    if isinstance(box, ContainerBox):
        env = container_environment(env)
    order = LaunchOrder(torchrun_args(job_file, rdzv, fabric), env, str(workdir), str(log_file))
    ranks = await _started(order, launcher, box, python_env)
    finished_at: float | None = None
    start = StartWatch(start_limit_s, time.monotonic()) if start_limit_s else None
    report_at = time.monotonic()
    stopping = whole = False
    if script_folder is not None:
        script_folder.start()
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ranks.wait(), timeout=CRASH_POLL_S)
            tail.poll()
            if script_folder is not None:  # its commits take the newest step it reported
                script_folder.heard(tail)
            if tail.crash is not None and ranks.returncode is None and not ranks.ranks_alive():
                # A rank died of an exception, and every rank has exited (a rank's exit waits
                # for its checkpoint upload in flight, which may still commit): the gang is
                # lost. torchrun would take seconds more to say so (its monitor's next look,
                # then its rendezvous shutdown against a store whose host may be the dead
                # node), and the run's recovery waits on this.
                await ranks.kill()
            if ranks.returncode is None and time.monotonic() < report_at:
                continue
            report_at = time.monotonic() + report_every_s
            on_progress(dict(tail.latest))
            if launcher is not None and tail.training and not isinstance(box, ContainerBox):
                # For the next generation, now that this one trains; before the exit check, so a
                # job that ends within one report of its first step still leaves one behind.
                await launcher.prepare(standby_box() if box is not None else None)
            if ranks.returncode is not None:
                break
            if script_folder is not None and (script_folder.asked_to_stop or script_folder.fenced):
                stopping = True
                whole = await ranks.ask_ranks_to_stop(stop_grace_s)
                break
            if start is not None and not tail.stepped:
                start.observe(tail.sdk, time.monotonic())
                if (verdict := start.verdict(time.monotonic())) is not None:
                    await _not_started(ranks, job, verdict, start.limit_s)
            if hang is not None and not tail.finished:
                hang.observe(int(tail.latest.get("step", 0)), time.monotonic())
                if (idle := hang.stuck_s(time.monotonic())) is not None:
                    raise RanksHung(
                        f"ranks on node {job.node_id} hung at step {tail.latest.get('step')}: "
                        f"no progress for {idle:.0f} s (limit {hang.limit_s():.0f} s, "
                        f"{hang.factor:g} × the median time between progress reports); "
                        + _stacks_are_in(job)
                    )
            if tail.finished:
                # The ranks are done or stopped, their checkpoint committed. torchrun may still
                # sit in its exit barrier on a rendezvous store whose host (another node's
                # torchrun) is gone; nothing is left to wait for after a short grace.
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > exit_grace_s:
                    await ranks.stop(dump_stacks=False)
                    break
    except BaseException as err:
        # A hung rank will not act on SIGTERM (it sits in a collective, or is stopped): kill it
        # soon. Anyone else gets the full grace to checkpoint on the way out.
        await ranks.stop(grace_s=2.0 if isinstance(err, RanksHung) else 10.0)
        raise
    finally:
        ranks.release()
        if script_folder is not None:
            await script_folder.stop()
    if launcher is not None and not isinstance(box, ContainerBox):
        # A job that ended before it showed it trained (a short script that reports no step,
        # committed only at its end) leaves one behind too: a no-op where one waits already.
        await launcher.prepare(standby_box() if box is not None else None)
    tail.drain()
    if script_folder is not None:
        # Whole: every rank returned, by itself or after saving on the SIGTERM it was sent.
        whole = ranks.returncode == 0 or (whole and len(tail.exited) >= rdzv.nproc_per_node)
        script_folder.heard(tail)
        await script_folder.end(whole, stopped=stopping)
        tail.drain()
    # torchrun exits non-zero when it was itself SIGTERMed (or stopped above), even though its
    # ranks finished or checkpointed and stopped as asked: their own word is what counts.
    if ranks.returncode != 0 and not tail.finished:
        if mistake := tail.latest.get("user_error"):
            detail = mistake.get("detail", "")
            raise UserCodeFailed(f"{mistake['reason']}" + (f"\n{detail}" if detail else ""))
        if "failure" in tail.latest:  # the ranks said why
            raise RanksFailed(f"ranks on node {job.node_id}: {tail.latest['failure']}")
        if tail.node_fault is not None:
            raise NodeFault(f"a device of node {job.node_id} is broken: {tail.node_fault}")
        if tail.crash is not None:
            raise RanksFailed(
                f"a rank on node {job.node_id} failed: {tail.crash}; last lines of {log_file}:"
                f"\n{tail_lines(log_file)}"
            )
        raise RanksFailed(
            f"torchrun exited with status {ranks.returncode} on node {job.node_id}; "
            f"last lines of {log_file}:\n{tail_lines(log_file)}"
        )
    return tail


async def _started(
    order: LaunchOrder,
    launcher: WarmLauncher | None,
    box: Box | ContainerBox | None,
    python_env: UserEnv | None,
) -> TorchrunProcess:
    """torchrun started for `order`: the warm standby's if there is one, else a fresh one (in a
    container, a fresh one in the image's Python)."""
    if isinstance(box, ContainerBox):
        command = [IMAGE_PYTHON, "-m", "torch.distributed.run", *order.args]
        box = box.named()
        proc, lifeline = await start_in_container(
            command, box, order.env, order.cwd, order.log_file
        )
        return TorchrunProcess(proc, True, lambda: torchrun_in(box.name), lifeline)
    # A standby is the node's interpreter with torch imported from the node's packages: a job
    # with an environment of its own starts cold, in its environment's interpreter.
    warm = launcher if python_env is None else None
    proc = await warm.start(order, box) if warm is not None else None
    if proc is None:
        proc = await _start_cold(order, box, str(python_env.python) if python_env else None)
    return TorchrunProcess(proc, boxed=box is not None)


async def _start_cold(
    order: LaunchOrder, box: Box | None, python: str | None = None
) -> asyncio.subprocess.Process:
    """torchrun in a fresh interpreter (`python`, else the node's), in `box` when there is one."""
    command = [python or sys.executable, "-m", "torch.distributed.run", *order.args]
    with open(order.log_file, "ab") as log:
        return await asyncio.create_subprocess_exec(
            *(box.argv(command, order.cwd) if box is not None else command),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=order.env,
            cwd=order.cwd,
            # torchrun dies with the agent, and its ranks with it (trainer.runtime; in a box,
            # the whole box with bwrap): a dead agent is a failed node, not a preemption, so
            # nothing gets a SIGTERM to checkpoint with peers whose node is gone.
            preexec_fn=die_with_parent,
        )


async def _not_started(
    ranks: TorchrunProcess,
    job: TrainJob,
    verdict: Verdict,
    limit_s: float,
) -> None:
    """Stop ranks that never got to train, and say where the script was (from the stacks
    the ranks print on the way out)."""
    stacks = job.stacks_file(0)  # local rank 0 runs the same script as every other
    dumped_from = stacks.stat().st_size if stacks and stacks.exists() else 0
    await ranks.stop(grace_s=2.0)
    limit = f"recovery.start_limit_s = {limit_s:g}"
    if not verdict.users:
        raise RanksHung(
            f"ranks on node {job.node_id}: {verdict.what} ({limit}); {_stacks_are_in(job)}"
        )
    entry = job.train.get("entrypoint") or "the built-in trainer"
    where = _script_frame(stacks, dumped_from, job.code_dir) if stacks else "(no stacks)"
    raise UserCodeFailed(
        f"the rank script {entry} {verdict.what} ({limit}), at {where}: "
        "a script trains inside `for step in run.steps():`, which reports every step (raise "
        "the limit if its set-up takes longer; see README, Your own training code)"
    )


def _stacks_are_in(job: TrainJob) -> str:
    first = job.stacks_file(0)
    return f"every rank's stack is in {first.parent}/{STACKS_GLOB}" if first else ""


def printed_stacks(folder: Path) -> str:
    """Every stack the ranks of one generation folder printed (trainer.entry), rank by rank."""
    return "".join(path.read_text(errors="replace") for path in sorted(folder.glob(STACKS_GLOB)))


def _script_frame(stacks: Path, offset: int, code_dir: str) -> str:
    """The innermost frame of the script's own code folder in the stacks the rank printed
    (faulthandler lists the most recent call first)."""
    with contextlib.suppress(OSError), open(stacks, "rb") as printed:
        printed.seek(offset)
        # A rank writes the file: one bounded read, whatever it holds.
        for line in printed.read(MAX_READ).decode(errors="replace").splitlines():
            found = _FRAME.search(line)
            if found and (not code_dir or found["file"].startswith(code_dir)):
                path = Path(found["file"])
                shown = path.relative_to(code_dir) if code_dir else path
                return f"{shown}, line {found['line']}"
    return "a place its stacks do not show"
