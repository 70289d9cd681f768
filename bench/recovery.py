"""Recovery from a dead node on the local stack, phase by phase, against a fresh start.

    python -m bench.recovery [--kills 3] [--steps 600] [--checkpoint-every 100]
                             [--heartbeat-timeout 10] [--seed 6] [--only cold|warm|peer ...]

Three times: node agents that start torchrun cold (as before warm restarts), with their warm
standby (trainer/warm_launch.py), and warm with the peer tier (`peer_every = 10`: a failure
loses the steps since the last peer checkpoint, not the store's); the table of each and all
side by side:
starts a private stack (Temporal dev server, MLflow, control worker, 2 + kills node agents), runs a
fault-free two-node run of examples/tiny.toml for the baseline, then the same spec under
another name with `--kills` node agents SIGKILLed at random steps (each recovery takes a node
that has not failed). For every kill, from the run's own records (the workflow's attempt
timeline, the ranks' ledgers and progress files):

    detection     SIGKILL → the failed gang torn down (the survivors' collectives fail at
                  once and their agents report it; the dead node misses its liveness probe)
    reallocation  torn down → the next gang granted (backoff, release, grant)
    restart       granted → ranks ready, less the checkpoint load (fetch into the node cache,
                  torchrun, rendezvous, model build), split below into
      to spawn    granted → rank 0's process started (the activity reaching the agent, the
                  fetch into the node cache, torchrun or its standby, the rendezvous)
      imports     → rank 0 calls forgeline.init() (ranks are forked from torchrun: what it
                  had not imported; a warm standby has the trainer's modules too)
      set-up      → ready, less the load (process group, model, optimizer)
    load          the ranks reading the checkpoint
    first step    ready → the first step after resume
    work lost     steps trained after the checkpoint resumed from, against the interval

The baseline is the fresh run's own start: granted → its first step (no checkpoint to load).
The goodput breakdown of the run with the faults closes the report.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import tempfile
import time
from pathlib import Path

from bench.local_stack import LocalStack
from worker.chaos import trainer_processes
from worker.render import goodput_lines
from workflows.contracts.models import AttemptRecord

REPO = Path(__file__).resolve().parent.parent


def spec_file(
    folder: Path, name: str, steps: int, every: int, heartbeat_s: int, kills: int,
    extra: dict[str, int],
) -> str:  # fmt: skip
    text = (REPO / "examples" / "tiny.toml").read_text()
    for key, value in extra.items():  # keys the example leaves at their defaults
        text = text.replace("[train]\n", f"[train]\n{key} = {value}\n")
    text = text.replace('name = "tiny"', f'name = "{name}"')
    text = text.replace('"data/tinyshakespeare.txt"', f'"{REPO}/examples/data/tinyshakespeare.txt"')
    for key, value in (
        ("steps", steps),
        ("checkpoint_every", every),
        ("heartbeat_timeout_s", heartbeat_s),
        ("max_restarts", kills + 2),
        ("log_every", 1),  # every step on record: the step a kill interrupted is exact
    ):
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
    path = folder / f"{name}.toml"
    path.write_text(text)
    return str(path)


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def current_gang(stack: LocalStack, run: str) -> tuple[int, list[str]]:
    found = re.search(r"allocation +generation (\d+) on (.+)", stack.cli("status", run))
    return (int(found.group(1)), found.group(2).split(", ")) if found else (0, [])


def kill_once(stack: LocalStack, run: str, after: int, chance: random.Random) -> tuple[int, float]:
    """Kill a random node of the next generation at a random step; (generation, kill time)."""
    generation = wait_for(lambda: (g := current_gang(stack, run)[0]) > after and g, 300, "gang")
    past = chance.randint(10, 90)

    def trained() -> bool:
        events = stack.events(run, generation)
        started = [e["step"] for e in events if e["event"] == "started"]
        steps = [e["step"] for e in events if e["event"] == "step"]
        return bool(started and steps) and max(steps) >= min(started) + past

    wait_for(trained, 300, f"generation {generation} to train {past} steps")
    victim = chance.choice(current_gang(stack, run)[1])
    pid = int((stack.home / "run" / f"{victim}.pid").read_text().split()[0])
    killed_at = time.time()
    os.kill(pid, 9)
    wait_for(lambda: not trainer_processes(stack.home, victim, run), 60, "the ranks to die")
    return generation, killed_at


def first_step_at(stack: LocalStack, run: str, generation: int) -> float:
    return next(e["time"] for e in stack.events(run, generation) if e["event"] == "step")


def phases(stack: LocalStack, run: str, killed_at: float, failed: AttemptRecord,
           resumed: AttemptRecord) -> dict[str, float]:  # fmt: skip
    assert failed.ended_at is not None and resumed.ledger is not None
    ready = resumed.ledger.ready_at or 0.0
    first = first_step_at(stack, run, resumed.generation)
    before_kill = [
        e["step"]
        for e in stack.events(run, failed.generation)
        if e["event"] == "step" and e["time"] <= killed_at
    ]
    return {
        "detection": failed.ended_at.timestamp() - killed_at,
        "reallocation": (resumed.granted_at - failed.ended_at).total_seconds(),
        "restart": ready - resumed.granted_at.timestamp() - resumed.ledger.load_s,
        **start_split(resumed),
        "load": resumed.ledger.load_s,
        "first step": first - ready,
        "SIGKILL → first step": first - killed_at,
        "steps lost": max(before_kill, default=0) - resumed.ledger.resume_step,
    }


def start_split(attempt: AttemptRecord) -> dict[str, float]:
    """An attempt's start, granted → ready less the load, in three: until rank 0's process
    exists, its imports, its set-up (NaN where the ledger lacks a mark)."""
    ledger = attempt.ledger
    assert ledger is not None
    nan = float("nan")
    marks = [attempt.granted_at.timestamp(), ledger.spawned_at, ledger.init_at,
             (ledger.ready_at or nan) - ledger.load_s]  # fmt: skip
    spans = [b - a if a is not None and b is not None else nan
             for a, b in itertools.pairwise(marks)]  # fmt: skip
    return dict(zip(("  to spawn", "  imports", "  set-up"), spans, strict=True))


# The ways of restarting compared, each on a stack of its own, one after the other in one run.
# Each variant: the node agents' settings, and [train] keys the runs add to the spec.
# --only's name -> (the table's label, the stack's settings, the spec's extra [train] keys)
VARIANTS: dict[str, tuple[str, dict[str, str], dict[str, int]]] = {
    "cold": ("cold torchrun (before)", {"FORGELINE_NODE_WARM_STANDBY": "false"}, {}),
    "warm": ("warm standby", {"FORGELINE_NODE_WARM_STANDBY": "true"}, {}),
    "peer": ("warm + peer tier", {"FORGELINE_NODE_WARM_STANDBY": "true"}, {"peer_every": 10}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument(
        "--only", choices=VARIANTS, action="append",
        help="measure only this variant (repeat for more); all three by default",
    )  # fmt: skip
    args = parser.parse_args()
    means = {}
    for name in args.only or VARIANTS:
        label, settings, extra = VARIANTS[name]
        rows, fresh_start = measure(args, settings, extra)
        print(f"\n== {label}")
        report(rows, fresh_start, args, extra.get("peer_every", args.checkpoint_every))
        means[label] = {name: sum(r[name] for r in rows) / len(rows) for name in rows[0]}
    columns = list(means.values())
    before, after = columns[0], columns[-1]
    print(f"\n{'mean of the kills':<24}" + "".join(f"{label:>24}" for label in means)
          + "   ratio last/first")  # fmt: skip
    for name in before:
        unit = "" if name == "steps lost" else " s"
        ratio = after[name] / before[name] if before[name] else float("nan")
        cells = "".join(f"{column[name]:>22.1f}{unit:<2}" for column in columns)
        print(f"{name:<24}{cells}{ratio:>8.2f}")


def measure(
    args: argparse.Namespace, settings: dict[str, str], extra: dict[str, int]
) -> tuple[list[dict], float]:
    """One stack with `settings`, runs with the `extra` [train] keys: the fresh run's start,
    then every kill's phases."""
    home = Path(tempfile.mkdtemp(prefix="forgeline-bench-recovery-"))
    stack = LocalStack(home, settings)
    # A node for every kill beyond the gang's two: dead nodes stay dead, and no repaired agent's
    # start-up (seconds of CPU on this one machine) competes with a restart it is not part of.
    stack.up(2 + args.kills)
    try:
        folder = home / "specs"
        folder.mkdir()
        shape = (args.steps, args.checkpoint_every, args.heartbeat_timeout, args.kills, extra)
        stack.cli("run", spec_file(folder, "fresh", *shape))
        fresh = stack.status("fresh").gang_attempts[0]
        fresh_start = first_step_at(stack, "fresh", fresh.generation) - fresh.granted_at.timestamp()
        split = ", ".join(f"{k.strip()} {v:.1f} s" for k, v in start_split(fresh).items())
        print(f"fresh start: {fresh_start:.1f} s to the first step ({split})")

        run = "faulty"
        stack.cli("run", spec_file(folder, run, *shape), "--detach")
        chance = random.Random(args.seed)
        kills, generation = [], 0
        for _ in range(args.kills):
            generation, killed_at = kill_once(stack, run, generation, chance)
            kills.append((generation, killed_at))
        stack.cli("run", spec_file(folder, run, *shape))  # follow it to the approval gate
        status = stack.status(run)
        by_generation = {a.generation: a for a in status.gang_attempts}
        rows = []
        for failed_generation, killed_at in kills:
            failed = by_generation[failed_generation]
            resumed = next(a for a in status.gang_attempts if a.generation > failed_generation)
            rows.append(phases(stack, run, killed_at, failed, resumed))
        if status.goodput is not None:
            print(f"\ngoodput of the run with {args.kills} SIGKILLs ({args.steps} steps):")
            print("\n".join(goodput_lines(status.goodput)))
        return rows, fresh_start
    finally:
        stack.cli("down")


def report(
    rows: list[dict[str, float]], fresh_start: float, args: argparse.Namespace, interval: int
) -> None:
    """One variant's table; `interval`: the steps between the checkpoints a failure falls back
    to (the peer tier's where there is one)."""
    names = list(rows[0])
    width = max(map(len, names)) + 2
    header = f"{'':<{width}}" + "".join(f"{f'kill {i + 1}':>10}" for i in range(len(rows)))
    print(f"\nrecovery on the local stack, heartbeat timeout {args.heartbeat_timeout} s, "
          f"checkpoint every {args.checkpoint_every} steps")  # fmt: skip
    print(header + f"{'mean':>9}")
    for name in names:
        values = [row[name] for row in rows]
        unit = "" if name == "steps lost" else " s"
        cells = "".join(f"{v:>8.1f}{unit:<2}" if unit else f"{v:>8.0f}  " for v in values)
        print(f"{name:<{width}}{cells} {sum(values) / len(values):>6.1f}{unit}")
    mean_total = sum(row["SIGKILL → first step"] for row in rows) / len(rows)
    mean_restart = sum(row["restart"] + row["load"] + row["first step"] for row in rows)
    mean_restart /= len(rows)
    lost = sum(row["steps lost"] for row in rows) / len(rows)
    print(f"\n{'':<38}{'measured':>10}{'baseline':>10}{'ratio':>8}")
    print(f"{'SIGKILL → first step vs 20 s target':<38}{mean_total:>9.1f}s{20:>9.1f}s"
          f"{mean_total / 20:>8.2f}")  # fmt: skip
    print(f"{'restart+load+step vs fresh start':<38}{mean_restart:>9.1f}s{fresh_start:>9.1f}s"
          f"{mean_restart / fresh_start:>8.2f}")  # fmt: skip
    print(f"{'steps lost vs checkpoint interval':<38}{lost:>10.0f}{interval:>10}"
          f"{lost / interval:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
