"""`forgeline chaos kill-node | hang-node | slow-node | corrupt-grad | flip-bit | fail-health
NODE`: faults on purpose, on the local stack, to watch detection and recovery work (and for the
tests that prove they do).

- kill-node: SIGKILL the node's agent (its torchrun and ranks follow it).
- hang-node: SIGSTOP the node's ranks; the agent keeps heartbeating, so only the gang's own
  lack of progress gives it away (recovery.hang_factor, hang_min_s).
- slow-node: the node's ranks run `--factor` times slower (a throttled GPU): stopped and
  continued many times a second by a detached process, until they exit. The gang's straggler
  check names the node (recovery.straggler_policy: report, or swap it for a spare).
- fail-health: the node's own health check fails with a reason (as a hardware checker would
  report ECC errors); `--clear` makes it pass again.
- corrupt-grad: the node's ranks poison their gradients once at their next step, or at
  `--at-step N`. A NaN, as a flipped bit would make: the gang stops before saving and resumes
  from the last checkpoint. With `--finite --scale S`, the gradients times S, as a device that
  is wrong rather than dead would make them: a large S is reported as a corruption suspect, and
  on a checked step (recovery.shadow_every) any S is a verdict.
- flip-bit: the lowest bit of one weight flips on the node's first rank, before its next step
  or `--at-step N`: the next shadow check it shows in names the node (AdamW's rounding may
  merge the two copies again first: then there is nothing left to find).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from infra import node_health
from infra.processes import ManagedProcess
from trainer.job import CHAOS_FILE
from trainer.launch import RANK_SCRIPT
from worker.cli_common import CliError, ExitCode, check_name, console, get_settings

chaos_app = typer.Typer(
    help="Inject faults on the local stack: kill, hang, slow down or corrupt a node."
)
_JOB_FILE = re.compile(r"[^\0 ]+/job\.json")
NodeArg = Annotated[str, typer.Argument(help="the node id, as `forgeline nodes` shows it")]
# A node with several GPUs can hold several runs' jobs at once; an order for one of them only.
RunOpt = Annotated[
    str | None, typer.Option("--run", help="only this run's ranks on the node (default: all)")
]

commands = typer.Typer()
commands.add_typer(chaos_app, name="chaos")


def trainer_processes(home: Path, node: str | None = None, run: str | None = None) -> list[int]:
    """Live torchrun and rank processes started by this stack's node agents (one node's, one
    run's, or all), found by the job file each was given."""
    marker = f"{home}/nodes/{node}/" if node else f"{home}/nodes/"
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (
            state != "Z"
            and RANK_SCRIPT.encode() in argv
            and marker.encode() in argv
            and (run is None or f"/runs/{run}/".encode() in argv)
        ):
            pids.append(int(proc.name))
    return pids


def _job_folders(pids: list[int]) -> set[Path]:
    """The job folders these processes run from. The job file is one of torchrun's arguments,
    and in a rank's name (trainer.entry.as_a_fresh_rank): one string, not separate arguments."""
    folders = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        folders |= {Path(job).parent for job in _JOB_FILE.findall(cmdline)}
    return folders


def _ranks_of(node: str, run: str | None = None) -> list[int]:
    if run is not None:
        check_name(run)  # it becomes part of a path pattern
    pids = trainer_processes(get_settings().home, node, run)
    if not pids:
        of_run = f" of run {run}" if run else ""
        raise CliError(f"node {node} runs no training ranks{of_run} now: nothing to do")
    return pids


@chaos_app.command("kill-node")
def kill_node(node: NodeArg) -> None:
    """SIGKILL the node's agent, as a machine that dies would."""
    check_name(node, "node id")
    pid = ManagedProcess(get_settings().home, node).pid()
    if pid is None:
        raise CliError(f"no running agent for node {node}: `forgeline nodes` lists the nodes")
    os.kill(pid, signal.SIGKILL)
    console.print(f"killed the agent of {node} (pid {pid}); `forgeline up` brings it back")


@chaos_app.command("hang-node")
def hang_node(node: NodeArg) -> None:
    """SIGSTOP the node's ranks: a gang stuck in a collective, with a healthy agent."""
    check_name(node, "node id")
    pids = _ranks_of(node)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    console.print(f"stopped {len(pids)} training process(es) on {node}")


@chaos_app.command("slow-node")
def slow_node(
    node: NodeArg,
    factor: Annotated[float, typer.Option(min=1.01, help="2 runs the ranks at half speed")] = 3.0,
    seconds: Annotated[
        float | None, typer.Option(min=1, help="stop slowing after this (default: until exit)")
    ] = None,
) -> None:
    """Run the node's ranks `factor` times slower, as a throttled GPU would."""
    check_name(node, "node id")
    pids = _ranks_of(node)
    argv = [sys.executable, "-m", "infra.throttle", "--factor", str(factor)]
    if seconds is not None:
        argv += ["--seconds", str(seconds)]
    # Detached: it outlives this command and stops by itself when the ranks exit.
    throttler = subprocess.Popen(
        [*argv, *map(str, pids)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    console.print(
        f"{node}: {len(pids)} training process(es) now run {factor:g}× slower "
        f"(throttle pid {throttler.pid}; it ends when they do)"
    )


@chaos_app.command("fail-health")
def fail_health(
    node: NodeArg,
    reason: Annotated[str, typer.Option(help="what the checker found")] = "ECC errors",
    clear: Annotated[bool, typer.Option(help="make the check pass again")] = False,
) -> None:
    """Make the node's own health check fail (or pass again, with --clear)."""
    check_name(node, "node id")
    node_dir = get_settings().home / "nodes" / node
    if not node_dir.is_dir():
        raise CliError(
            f"no node {node} on this stack: `forgeline nodes` lists the nodes", ExitCode.NOT_FOUND
        )
    if clear:
        node_health.repaired(node_dir)
        console.print(f"{node}: health check passes again; the node returns within seconds")
        return
    node_health.fail(node_dir, reason)
    console.print(f"{node}: health check now fails ({reason}); its gangs move elsewhere")


@chaos_app.command("corrupt-grad")
def corrupt_grad(
    node: NodeArg,
    # None, not 0, when not given: typer checks a default against `min` too, and refused
    # every call without --at-step.
    at_step: Annotated[
        int | None,
        typer.Option(min=1, help="poison at this step (or the next, if it has passed)"),
    ] = None,
    finite: Annotated[
        bool, typer.Option("--finite", help="scale the gradients (--scale) instead of a NaN")
    ] = False,
    scale: Annotated[
        float, typer.Option(help="with --finite: multiply this rank's gradients by this")
    ] = 1.02,
    run: RunOpt = None,
) -> None:
    """Make the node's ranks poison their gradients once, at their next step (or `--at-step`):
    a NaN, or with `--finite` the gradients times `--scale`, as a device that is wrong rather
    than dead would make them."""
    check_name(node, "node id")
    if finite and not (math.isfinite(scale) and scale != 1.0):
        raise CliError(
            f"--scale {scale} changes nothing or is not finite: give a finite factor other "
            "than 1 (e.g. --scale 1.02 for gradients 2 % too large)",
            ExitCode.BAD_INPUT,
        )
    words = ["corrupt-grad", str(at_step or 0)] + ([repr(scale)] if finite else [])
    jobs = _order(node, words, run)
    how = f"scaled by {scale}" if finite else "corrupted (NaN)"
    console.print(f"{node}: gradients will be {how} {_when(at_step)} ({jobs} job(s))")


@chaos_app.command("flip-bit")
def flip_bit(
    node: NodeArg,
    at_step: Annotated[
        int | None,
        typer.Option(min=1, help="flip before this step (or the next, if it has passed)"),
    ] = None,
    run: RunOpt = None,
) -> None:
    """Flip the lowest bit of one weight on the node's first rank, before its next step (or
    `--at-step`): a finite error that stays in that rank's copy of the model. Only a shadow
    check (recovery.shadow_every) sees it: it names the node at the next checked step."""
    check_name(node, "node id")
    jobs = _order(node, ["flip-bit", str(at_step or 0)], run)
    console.print(f"{node}: one weight's lowest bit will flip {_when(at_step)} ({jobs} job(s))")


def _when(at_step: int | None) -> str:
    return f"at step {at_step}" if at_step else "at the next step"


def _order(node: str, words: list[str], run: str | None) -> int:
    """Leave a fault for the node's running jobs' first ranks (trainer.grad_watch.chaos_order),
    or one run's only; how many jobs got it."""
    folders = _job_folders(_ranks_of(node, run))
    for folder in folders:
        # Written whole, then renamed: a rank reading a half-written file would act at once.
        partial = folder / f".{CHAOS_FILE}.partial"
        partial.write_text(" ".join(words) + "\n")
        partial.replace(folder / CHAOS_FILE)
    return len(folders)
