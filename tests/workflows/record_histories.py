"""Record real workflow histories for the replay test (tests/workflows/test_replay.py).

    .venv/bin/python -m tests.workflows.record_histories tests/workflows/histories [--label L]

Starts a private local stack with `forgeline up` (its own FORGELINE_HOME in a temporary folder,
free ports, the local-folder store, three node agents of one GPU slot), and drives one run of
examples/tiny.toml (more steps, so a node can die mid-run) as a person would:

1. `forgeline run` (owner alice), then SIGKILL the agent of one node of its gang after the
   gang's first checkpoint (tests/e2e/faults.py): the run recovers on the spare node as
   generation 2 from the last committed checkpoint; `forgeline up` brings the node back;
2. follow the run through evaluation and registration to AWAITING_APPROVAL, and
   `forgeline approve` it as bob (APPROVED);
3. fetch the history of every workflow execution on the server (the TrainingRun, its
   DatasetSnapshot child, the Cluster workflow's run or runs, as they are at that moment),
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
import datetime
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from temporalio.client import WorkflowHistory

from infra.processes import free_port
from infra.settings import Settings
from tests.e2e.conftest import Stack, variant
from tests.e2e.faults import kill_a_node_of
from tests.workflows.replaying import read_history, replayer, workflow_type, write_history
from worker.temporal_client import connect

RUN = "tiny-restart"
# 120 steps, a checkpoint every 40: the kill lands after the first commit (5-40 steps past it)
# and well before the end. A 5 s heartbeat timeout makes the dead node's activity time out soon.
TRAIN = {"steps": 120, "checkpoint_every": 40, "heartbeat_timeout_s": 5}
KILL_SEED = 14  # which node dies, and how far past the commit: the same recording each time


def stack_env(home: Path) -> dict[str, str]:
    """This process's environment with nothing of another stack: only FORGELINE_HOME, so the
    stack uses its own folder store and servers."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("FORGELINE_", "AWS_"))
    }
    return env | {"FORGELINE_HOME": str(home)}


def drive_run(stack: Stack) -> None:
    """Submit, kill a node mid-training, let the run recover, follow it to approval, approve."""
    spec = variant(stack.home, RUN, **TRAIN)
    stack.cli("run", str(spec), "--detach")
    killed = kill_a_node_of(stack, RUN, 0, random.Random(KILL_SEED))
    print(f"killed a node of generation {killed}", flush=True)
    stack.cli("up", "--nodes", "3")  # the node is repaired and its agent registers again
    followed = stack.cli("run", str(spec), timeout=600).stdout
    if "AWAITING_APPROVAL" not in followed:
        raise RuntimeError(f"run {RUN} did not reach AWAITING_APPROVAL:\n{followed}")
    status = stack.cli("status", RUN).stdout
    if re.search(r"attempts +0 restart", status):
        raise RuntimeError(f"run {RUN} shows no restart:\n{status}")
    approved = stack.cli("approve", RUN, "--as", "bob", "--note", "recorded for replay tests")
    if f"run {RUN}: APPROVED" not in approved.stdout:
        raise RuntimeError(f"approving {RUN} did not say APPROVED:\n{approved.stdout}")


async def fetch_histories(settings: Settings) -> list[WorkflowHistory]:
    """Every execution's history, the TrainingRun's once it has completed."""
    client = await connect(settings)
    # The approval update returns when the phase is final; the run completes a moment later.
    await client.get_workflow_handle(RUN).result()
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


def record(out: Path, label: str, keep: bool) -> list[Path]:
    home = Path(tempfile.mkdtemp(prefix="forgeline-record-"))
    # Only the helpers that drive the CLI and read the home are used: no S3 sites here.
    stack = Stack(home, stack_env(home), sites=None)  # type: ignore[arg-type]
    ports = ["--temporal-port", str(free_port()), "--ui-port", str(free_port())]
    ports += ["--mlflow-port", str(free_port())]
    try:
        stack.cli("up", "--nodes", "3", "--gpus-per-node", "1", *ports, timeout=240)
        drive_run(stack)
        histories = asyncio.run(fetch_histories(stack.settings))
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
        "--label",
        default=datetime.date.today().isoformat(),
        help="first part of every file name (default: today's date); new recordings need a "
        "new label",
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack's home folder")
    args = parser.parse_args(argv)
    if list(args.out.glob(f"{args.label}_*")):
        parser.error(f"{args.out} has recordings labelled {args.label} already: keep them")
    started = time.monotonic()
    written = record(args.out, args.label, args.keep)
    for path in written:
        events = len(read_history(path).events)
        print(f"{path}  {path.stat().st_size:,} bytes  {events} events")
    print(f"recorded in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
