"""Record real workflow histories for the replay test (tests/workflows/test_replay.py).

    .venv/bin/python -m tests.workflows.record_histories tests/workflows/histories \
        [--scenario tiny-restart|byo|plain] [--label L]

Starts a private local stack with `forgeline up` (its own FORGELINE_HOME in a temporary folder,
free ports, the local-folder store, three node agents of one GPU slot), and drives a scenario
through the CLI as a person would.

`tiny-restart` (the default): one run of examples/tiny.toml (more steps, so a node can die
mid-run):

1. `forgeline run` (as the local user, the stack's admin), then SIGKILL the agent of one node
   of its gang after the gang's first checkpoint (tests/e2e/faults.py): the run recovers on
   the spare node as generation 2 from the last committed checkpoint; `forgeline up` brings
   the node back;
2. follow the run through evaluation and registration to AWAITING_APPROVAL, and
   `forgeline approve` it as bob (APPROVED).

`byo`: users' own training code (examples/byo/gru.toml, the spec's `[train] code`):

1. the GRU example as run `byo-gru-restart`, a node agent SIGKILLed after its first commit as
   above; it recovers, is followed to AWAITING_APPROVAL and approved as bob;
2. a copy of the GRU code whose train.py has a typo before the first step (`modle` for `model`
   in the optimizer line) as run `byo-typo`: the rank script fails before its first step, the
   node activity says UserCodeError, and the run is FAILED at once, with no restart.

`plain`: a plain torchrun script that keeps its own checkpoints (examples/byo/plain.toml) as
run `byo-plain-restart`, a node agent SIGKILLed a moment after the first commit of its folder;
it resumes from that commit, is followed to AWAITING_APPROVAL and approved as bob.

Then, for either: fetch the history of every workflow execution on the server (the TrainingRuns,
their DatasetSnapshot children, the Cluster workflow's run or runs, as they are at that moment),
check that each replays against the code that recorded it, and write each as
`<label>_<workflow type>_<workflow id>[_<n>].json` (gzipped above 300 KB) into OUT_DIR.

`forgeline down` always runs at the end and the temporary folder goes (`--keep` keeps it, to
read the stack's logs). It takes a few minutes on two cores.

Add a recording when a change adds a path through a workflow (a new phase, a new signal, a
patch): give it a new `--label` and keep the old files. They are what the runs already in
flight look like, and every later version of the code must go on replaying them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import WorkflowFailureError, WorkflowHistory

from infra.settings import Settings
from tests.e2e.conftest import Stack, variant
from tests.e2e.faults import kill_a_node_of, kill_after_a_commit
from tests.e2e.test_user_code import BYO, byo_spec
from tests.workflows.replaying import read_history, replayer, workflow_type, write_history
from worker.stack import free_port_flags
from worker.temporal_client import connect

TINY_RUN = "tiny-restart"
# 120 steps, a checkpoint every 40: the kill lands after the first commit (5-40 steps past it)
# and well before the end. A 5 s heartbeat timeout makes the dead node's activity time out soon.
TRAIN = {"steps": 120, "checkpoint_every": 40, "heartbeat_timeout_s": 5}
KILL_SEED = 14  # which node dies, and how far past the commit: the same recording each time

BYO_RUN = "byo-gru-restart"
BYO_TYPO_RUN = "byo-typo"
# The GRU example's 60 steps commit every 20: this seed kills 12 steps past the first commit,
# well before the end (seed 14 would land at step 58, racing the run's own finish).
BYO_KILL_SEED = 18
# The optimizer line of examples/byo/gru/train.py, and the typo that fails it before step 1.
OPTIMIZER_LINE = "optimizer = torch.optim.AdamW(model"
TYPO_LINE = "optimizer = torch.optim.AdamW(modle"
PLAIN_RUN = "byo-plain-restart"

# How a scenario kills a node of the run's first gang: it returns that gang's generation.
Kill = Callable[[Stack, str, random.Random], int]


def stack_env(home: Path) -> dict[str, str]:
    """This process's environment with nothing of another stack: only FORGELINE_HOME, so the
    stack uses its own folder store and servers."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FORGELINE_", "AWS_"))
    }
    return env | {"FORGELINE_HOME": str(home)}


def kill_in_the_first_gang(stack: Stack, run: str, chance: random.Random) -> int:
    return kill_a_node_of(stack, run, 0, chance)


def restart_and_approve(
    stack: Stack, run: str, spec: Path, seed: int, kill: Kill = kill_in_the_first_gang
) -> None:
    """Submit, kill a node mid-training, let the run recover, follow it to approval, approve."""
    stack.cli("run", str(spec), "--detach")
    killed = kill(stack, run, random.Random(seed))
    print(f"{run}: killed a node of generation {killed}", flush=True)
    stack.cli("up", "--nodes", "3")  # the node is repaired and its agent registers again
    followed = stack.cli("run", str(spec), timeout=600).stdout
    if "AWAITING_APPROVAL" not in followed:
        raise RuntimeError(f"run {run} did not reach AWAITING_APPROVAL:\n{followed}")
    status = stack.cli("status", run).stdout
    if re.search(r"attempts +0 restart", status):
        raise RuntimeError(f"run {run} shows no restart:\n{status}")
    approved = stack.cli("approve", run, "--note", "recorded for replay tests",
                         as_person=("bob", "approve:*"))  # fmt: skip
    if f"run {run}: APPROVED" not in approved.stdout:
        raise RuntimeError(f"approving {run} did not say APPROVED:\n{approved.stdout}")


def drive_tiny_restart(stack: Stack) -> None:
    restart_and_approve(stack, TINY_RUN, variant(stack.home, TINY_RUN, **TRAIN), KILL_SEED)


def code_with_a_typo(folder: Path) -> Path:
    """A copy of the GRU example's code whose script fails before its first step."""
    shutil.copytree(BYO / "gru", folder, ignore=shutil.ignore_patterns("__pycache__"))
    script = folder / "train.py"
    text = script.read_text()
    if text.count(OPTIMIZER_LINE) != 1:
        raise RuntimeError(f"{BYO / 'gru' / 'train.py'} no longer has one {OPTIMIZER_LINE!r}")
    script.write_text(text.replace(OPTIMIZER_LINE, TYPO_LINE))
    return folder


def drive_byo(stack: Stack) -> None:
    """The GRU example through a dead node to approval; then its code with a typo, FAILED."""
    spec = byo_spec(stack.home, BYO_RUN, BYO / "gru", heartbeat_timeout_s=5)
    restart_and_approve(stack, BYO_RUN, spec, BYO_KILL_SEED)

    code = code_with_a_typo(stack.home / "user-code" / BYO_TYPO_RUN)
    failed = stack.cli("run", str(byo_spec(stack.home, BYO_TYPO_RUN, code)), check=False)
    if failed.returncode != 1 or "NameError: name 'modle' is not defined" not in failed.stdout:
        raise RuntimeError(f"run {BYO_TYPO_RUN} did not fail on its typo:\n{failed.stdout}")
    status = stack.cli("status", BYO_TYPO_RUN).stdout
    if not (re.search(r"phase +FAILED", status) and re.search(r"attempts +0 restart", status)):
        raise RuntimeError(f"run {BYO_TYPO_RUN} is not FAILED without a restart:\n{status}")


def drive_plain(stack: Stack) -> None:
    """A plain torchrun script (level 1: it keeps its own checkpoints) through a dead node to
    approval: its folder committed, restored for the next gang, registered by its files."""
    spec = byo_spec(stack.home, PLAIN_RUN, BYO / "plain", "plain.toml", heartbeat_timeout_s=5)
    restart_and_approve(stack, PLAIN_RUN, spec, KILL_SEED, kill=kill_after_a_commit)


@dataclass(frozen=True)
class Scenario:
    drive: Callable[[Stack], None]
    runs: tuple[str, ...]  # its TrainingRuns: each has ended before the histories are fetched


SCENARIOS = {
    "tiny-restart": Scenario(drive_tiny_restart, (TINY_RUN,)),
    "byo": Scenario(drive_byo, (BYO_RUN, BYO_TYPO_RUN)),
    "plain": Scenario(drive_plain, (PLAIN_RUN,)),
}


async def fetch_histories(settings: Settings, runs: tuple[str, ...]) -> list[WorkflowHistory]:
    """Every execution's history, each TrainingRun's once it has ended."""
    client = await connect(settings)
    for run in runs:
        # The approval update returns when the phase is final; the run completes a moment
        # later. A FAILED run's workflow fails: its history has ended all the same.
        with contextlib.suppress(WorkflowFailureError):
            await client.get_workflow_handle(run).result()
    executions = [execution async for execution in client.list_workflows()]
    executions.sort(key=lambda execution: execution.start_time)
    return [
        await client.get_workflow_handle(e.id, run_id=e.run_id).fetch_history() for e in executions
    ]


async def check_replays(histories: list[WorkflowHistory]) -> None:
    """A recording that does not replay against the code that made it is no baseline."""
    for history in histories:
        await replayer().replay_workflow(history)


def write_all(histories: list[WorkflowHistory], out: Path, label: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    runs_of: dict[str, int] = {}
    for history in histories:  # in start order: a continued-as-new workflow's runs count up
        runs_of[history.workflow_id] = runs_of.get(history.workflow_id, 0) + 1
        stem = f"{label}_{workflow_type(history)}_{history.workflow_id}"
        if runs_of[history.workflow_id] > 1:
            stem += f"_{runs_of[history.workflow_id]}"
        written.append(write_history(history, out / stem))
    return written


def record(out: Path, label: str, scenario: Scenario, keep: bool) -> list[Path]:
    home = Path(tempfile.mkdtemp(prefix="forgeline-record-"))
    # Only the helpers that drive the CLI and read the home are used: no S3 sites here.
    stack = Stack(home, stack_env(home), sites=None)  # type: ignore[arg-type]
    try:
        stack.cli("up", "--nodes", "3", "--gpus-per-node", "1", *free_port_flags(), timeout=240)
        scenario.drive(stack)
        histories = asyncio.run(fetch_histories(stack.settings, scenario.runs))
    finally:
        stack.cli("down", timeout=120, check=False)
        leftovers = sorted(pid.name for pid in (home / "run").glob("*.pid"))
        if leftovers:  # their pid files are how to find and stop them: keep the folder
            print(f"`forgeline down` left {', '.join(leftovers)} running", file=sys.stderr)
            keep = True
        if keep:
            print(f"stack home kept at {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    asyncio.run(check_replays(histories))
    return write_all(histories, out, label)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the histories into")
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="tiny-restart",
        help="what to drive through the stack (default: tiny-restart)",
    )
    parser.add_argument(
        "--label",
        help="first part of every file name (default: today's date, then -SCENARIO for any "
        "scenario but tiny-restart); new recordings need a new label",
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack's home folder")
    args = parser.parse_args(argv)
    if args.label is None:
        args.label = datetime.date.today().isoformat()
        if args.scenario != "tiny-restart":
            args.label += f"-{args.scenario}"
    if list(args.out.glob(f"{args.label}_*")):
        parser.error(f"{args.out} has recordings labelled {args.label} already: keep them")
    started = time.monotonic()
    written = record(args.out, args.label, SCENARIOS[args.scenario], args.keep)
    for path in written:
        events = len(read_history(path).events)
        print(f"{path}  {path.stat().st_size:,} bytes  {events} events")
    print(f"recorded in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
