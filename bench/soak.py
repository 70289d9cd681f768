"""A soak: two teams' runs on a private local stack while a seeded schedule of mixed faults
fires, then what was lost, what recovery cost and whether the weights are the ones a fault-free
run makes.

    python -m bench.soak [--minutes 60] [--mean-interval 60] [--seed 7] [--nodes 5]
                         [--steps 1500] [--checkpoint-every 100] [--outage 60] [--out soak.json]
                         [--only kill-agent,drain]

Team `nlp` (guaranteed every GPU) and team `vision` (guaranteed none: it borrows) each keep a
run in flight, cycling through the built-in GPT under DDP, FSDP and DDP with shadow checks;
vision's runs are preemptible. The faults (bench/soak_plan.py, drawn from the seed before the
soak starts, exponential gaps of the given mean) and how each is mended are in
bench/soak_faults.py. Every 0.5 s the cluster's state (GET /v1/cluster) is checked: no node
booked twice, no run with two gangs, and how long a gang waited while enough nodes were free.
When the time is up the faults stop, everything is mended, the runs finish, and one fault-free
reference run per kind runs (all at once); bench/soak_report.py then compares and prints the table.
The plan, every event and the report go to `--out` (SoakRecord), which a test can load.

Exits non-zero when a target is missed: a run not ended, a node double-booked, a committed
checkpoint lost, or a deterministic run's weights not bitwise its reference's.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster_invariants import booking_violations
from bench.local_stack import LocalStack
from bench.soak_faults import SHADOW_EVERY, Fired, Injector, PassedOver
from bench.soak_plan import (
    CONTROL_PLANE,
    DEFAULT_MIX,
    Fault,
    FaultKind,
    PlannedRun,
    RunKind,
    SoakEvent,
    SoakPlan,
    SoakRecord,
    draw_faults,
)
from bench.soak_report import build_report, print_report
from bench.stuck_runs import diagnose
from workflows.contracts.cluster_models import ClusterState, GangRequest
from workflows.contracts.models import Phase

REPO = Path(__file__).resolve().parent.parent
FINAL = {Phase.APPROVED, Phase.REJECTED, Phase.EXPIRED, Phase.FAILED, Phase.CANCELLED}
GUARANTEED, BORROWER = "nlp", "vision"
KINDS = (RunKind.DDP, RunKind.SHADOW, RunKind.FSDP)
MEND_TRIES, MEND_AGAIN_S = 6, 5.0  # a mend refused while a server is down is sent again
# Teams as queues: nlp may reclaim every GPU, vision only borrows; preemption at once (no
# shield, no patience) so a reclaim happens within the soak, with a short grace to checkpoint.
CLUSTER_FILE = """pods = ["local"]
preemption_grace_s = 30
preemption_shield_s = 0
reclaim_after_s = 0

[[queues]]
name = "nlp"
guaranteed_gpus = {nodes}

[[queues]]
name = "vision"
guaranteed_gpus = 0
max_gpus = {nodes}
"""


def run_spec(plan: SoakPlan, run: PlannedRun) -> dict[str, Any]:
    """examples/tiny.toml (or tiny-fsdp.toml) as the soak runs it: every step logged (the step
    a fault interrupted is exact), a restart budget no soak exhausts, a dead node found in 5 s
    and a stopped one past 15, an approval window that closes at once (nobody deploys)."""
    example = "tiny-fsdp.toml" if run.kind == RunKind.FSDP else "tiny.toml"
    spec = tomllib.loads((REPO / "examples" / example).read_text())
    spec["name"] = run.name
    spec["data"]["sources"] = [str(REPO / "examples" / "data" / "tinyshakespeare.txt")]
    spec["train"] |= {"steps": plan.steps, "checkpoint_every": plan.checkpoint_every,
                      "log_every": 1}  # fmt: skip
    spec["resources"] |= {"team": run.team, "preemptible": run.preemptible}
    spec["recovery"] |= {"max_restarts": 100, "heartbeat_timeout_s": 5, "hang_min_s": 15}
    if run.kind == RunKind.SHADOW:
        spec["recovery"]["shadow_every"] = SHADOW_EVERY
    spec["registry"]["approval_window_hours"] = 0.001
    return spec


@dataclass
class Soak:
    stack: LocalStack
    plan: SoakPlan
    record: SoakRecord
    started: float = field(default_factory=time.monotonic)
    runs: dict[str, PlannedRun] = field(default_factory=dict)
    ended: dict[str, Phase] = field(default_factory=dict)
    numbering: itertools.count = field(default_factory=itertools.count)
    mends: list[tuple[float, Fault, Fired]] = field(default_factory=list)
    waiting_free_since: dict[str, float] = field(default_factory=dict)
    waiting_why: dict[str, str] = field(default_factory=dict)  # what the cluster said of it

    def __post_init__(self) -> None:
        # The events count seconds from this clock's start, and the recoveries are read against
        # the runs' own records (epoch seconds) as `started_epoch + at_s`: the two start
        # together. Stamped when the record was made, before `cluster apply` (seconds of CLI),
        # every recovery of the soaks before 2026-12-07's last was that much too long.
        self.record.started_epoch = time.time() - (time.monotonic() - self.started)

    def now(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def note(self, what: str, target: str = "", detail: str = "", **victim: Any) -> None:
        event = SoakEvent(at_s=self.now(), what=what, target=target, detail=detail, **victim)
        self.record.events.append(event)
        print(f"{event.at_s:8.1f}  {what:<16} {target:<22} {detail}", flush=True)

    def submit(self, team: str, kind: RunKind | None = None) -> str:
        """Submit the team's next run; raises what the API raised (Temporal or the API down:
        the stream tries again at its next turn, under the next number)."""
        number = next(self.numbering)
        run = PlannedRun(
            name=f"soak-{team}-{number:02d}", team=team, kind=kind or KINDS[number % len(KINDS)],
            preemptible=team == BORROWER,
        )  # fmt: skip
        try:
            self.stack.api().submit(run_spec(self.plan, run))
        except Exception as refused:
            self.note("submit-failed", run.name, str(refused)[-200:])
            raise
        self.runs[run.name] = run
        self.record.runs.append(run)
        self.note("submit", run.name, f"{run.kind} team {team}")
        return run.name

    def state(self) -> ClusterState | None:
        try:
            return self.stack.api().cluster()
        except Exception:  # the API, Temporal or the control worker is down: seen, not fatal
            return None

    def watch(self, state: ClusterState) -> None:
        for violation in booking_violations(state):
            self.note("violation", detail=violation)
        free_ids = _free_ids(state)
        free = len(free_ids)
        now = self.now()
        queued = {r.run_id: r for r in state.queue}
        for run_id, since in list(self.waiting_free_since.items()):
            if run_id not in queued or queued[run_id].nodes > free:
                if now - since > 10:
                    why = self.waiting_why.get(run_id, "")
                    self.note("waited-free", run_id, f"{now - since:.1f} s: {why}")
                del self.waiting_free_since[run_id]
        for run_id, request in queued.items():
            if request.nodes <= free:
                self.waiting_free_since.setdefault(run_id, now)
                # Said while it waits: by the time it stops, the preemption is over.
                self.waiting_why[run_id] = _why_waiting(state, run_id, request, free_ids)

    def follow_runs(self) -> None:
        try:
            views = self.stack.api().runs()
        except Exception:
            return
        for view in views:
            name, phase = view.status.name, view.status.phase
            if name in self.runs and phase in FINAL and name not in self.ended:
                self.ended[name] = phase
                self.note("ended", name, f"{phase.value} {view.status.error or ''}".strip())

    def keep_streams(self) -> None:
        for team in (GUARANTEED, BORROWER):
            in_flight = [n for n, r in self.runs.items() if r.team == team and n not in self.ended]
            if not in_flight:
                with contextlib.suppress(Exception):  # noted; tried again next turn
                    self.submit(team)

    def fire(self, fault: Fault, state: ClusterState | None, injector: Injector) -> None:
        try:
            if state is None and fault.kind not in CONTROL_PLANE:
                raise PassedOver("the cluster's state could not be read")
            fired = injector.fire(fault, state or ClusterState(), self.runs)
        except PassedOver as why:
            self.note(fault.kind.value, detail=f"passed over: {why}")
            return
        self.note(fault.kind.value, fired.target, fired.detail, hold_s=fault.hold_s,
                  free_nodes=_free_nodes(state) if state else None,
                  **_victim(fired.target, state))  # fmt: skip
        if fired.mend is not None:
            self.mends.append((self.now() + fired.mend_after_s, fault, fired))

    def mend_due(self, repairs: ThreadPoolExecutor, pending: list[Future], all_: bool) -> None:
        due = [m for m in self.mends if all_ or m[0] <= self.now()]
        for mend in due:
            self.mends.remove(mend)
            _, fault, fired = mend
            pending.append(repairs.submit(self._mend, fault, fired))

    def _mend(self, fault: Fault, fired: Fired) -> None:
        """Mended as an operator would: again a little later while it fails. An undrain sent
        while another fault had Temporal down failed once and nothing sent it again: the node
        stayed drained for the rest of the soak."""
        assert fired.mend is not None
        for attempt in range(1, MEND_TRIES + 1):
            try:
                self.note("mend", fired.target, f"{fault.kind.value}: {fired.mend()}")
                return
            except Exception as error:
                self.note("mend-failed", fired.target, f"try {attempt}: {str(error)[-300:]}")
                time.sleep(MEND_AGAIN_S)


def _free_nodes(state: ClusterState) -> int:
    """Nodes a gang could be granted now (in service, not held back as spares, a GPU free)."""
    return len(_free_ids(state))


def _free_ids(state: ClusterState) -> list[str]:
    return [n.info.node_id for n in state.nodes if n.schedulable and not n.spare and n.free >= 1]


def _why_waiting(state: ClusterState, run_id: str, request: GangRequest, free: list[str]) -> str:
    """What the cluster's state says of a run that waited with nodes free: the scheduler's
    reason, or (it gives none for a run it reclaims for) the gang it preempts for it, and which
    nodes were free and which the run's ranks had reported (a run avoids those)."""
    reason = next((w.reason for w in state.waiting if w.run_id == run_id), "")
    victims = [
        a.run_id for a in state.allocations if a.preempting and a.preempting.for_run == run_id
    ]
    said = [reason or "no reason given"]
    if victims:
        said.append(f"preempting {', '.join(victims)} for it")
    said.append(f"free {', '.join(free) or 'none'} now")
    if request.avoid:
        said.append(f"avoids {', '.join(request.avoid)}")
    return "; ".join(said)


def _victim(target: str, state: ClusterState | None) -> dict[str, Any]:
    """The run (and its generation) whose gang held the node a fault hit: `node`, or
    `run@node` for a fault aimed at one run."""
    node = target.rsplit("@", 1)[-1]
    for allocation in state.allocations if state else []:
        if node in {n.node_id for n in allocation.nodes}:
            return {"run": allocation.run_id, "generation": allocation.generation}
    return {}


def drive(soak: Soak, injector: Injector, wait_s: float) -> list[str]:
    """The soak's loop, then everything mended and every run followed to its end; returns the
    runs that did not end within `wait_s`."""
    faults = list(soak.plan.faults)
    pending: list[Future] = []
    with ThreadPoolExecutor(max_workers=1) as repairs:  # one `up` at a time
        while soak.now() < soak.plan.duration_s:
            state = soak.state()
            if state is not None:
                soak.watch(state)
            soak.follow_runs()
            soak.keep_streams()
            while faults and faults[0].at_s <= soak.now():
                soak.fire(faults.pop(0), state, injector)
            soak.mend_due(repairs, pending, all_=False)
            time.sleep(0.5)
        soak.note("stack", detail="faults stop; everything is mended")
        soak.mend_due(repairs, pending, all_=True)
        for future in pending:
            future.result()
    injector.repair()
    deadline = time.monotonic() + wait_s
    while len(soak.ended) < len(soak.runs) and time.monotonic() < deadline:
        if (state := soak.state()) is not None:
            soak.watch(state)
        soak.follow_runs()
        time.sleep(1)
    if stuck := sorted(set(soak.runs) - set(soak.ended)):
        # Said now, while the stack that holds them is still up to be read.
        soak.note("stuck", ", ".join(stuck), f"not ended {wait_s:.0f} s after the faults "
                  "stopped:\n" + diagnose(soak.stack, stuck))  # fmt: skip
    return stuck


def run_soak(stack: LocalStack, plan: SoakPlan, out: Path, wait_s: float = 1800) -> SoakRecord:
    """The whole soak on a stack that is up: returns (and saves to `out`) its record."""
    record = SoakRecord(plan=plan)
    cluster = out.parent / "soak-cluster.toml"
    cluster.write_text(CLUSTER_FILE.format(nodes=plan.nodes))
    stack.cli("cluster", "apply", str(cluster))
    soak = Soak(stack, plan, record)  # its clock starts now, and record.started_epoch
    injector = Injector(stack, plan.nodes, lambda: soak.submit(GUARANTEED))
    try:
        stuck = drive(soak, injector, wait_s)
        # A stack that left runs stuck is no place for references: it would strand them too.
        refs = {} if stuck else run_references(soak, wait_s)
        record.report = build_report(stack, soak.record, refs, soak.ended, out.parent)
    finally:
        record.save(out)
    return record


def run_references(soak: Soak, wait_s: float) -> dict[str, str]:
    """One fault-free run of each kind the soak ran, on the quiet stack, all submitted at once
    (the cluster queues what does not fit; a CPU run's weights do not depend on its
    neighbours); returns run name -> the reference it is compared with."""
    of_kind: dict[RunKind, str] = {}
    for kind in sorted({r.kind for r in soak.runs.values()}):
        run = PlannedRun(name=f"soak-ref-{kind.value}", team=GUARANTEED, kind=kind,
                         preemptible=False)  # fmt: skip
        soak.stack.api().submit(run_spec(soak.plan, run))
        soak.note("reference", run.name, kind.value)
        of_kind[kind] = run.name
    pending = set(of_kind.values())
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            phase = soak.stack.api().status(name).status.phase
            if phase in FINAL:
                soak.note("ended", name, phase.value)
                pending.discard(name)
        time.sleep(1)
    return {name: of_kind[run.kind] for name, run in soak.runs.items()}


def _kinds(text: str) -> dict[FaultKind, float]:
    """`--only`'s kinds, with their shares of the default mix."""
    try:
        kinds = [FaultKind(k.strip()) for k in text.split(",")]
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise argparse.ArgumentTypeError(
            f"unknown fault kind in {text!r}; known: {known}"
        ) from None
    return {kind: DEFAULT_MIX[kind] for kind in kinds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--mean-interval", type=float, default=60, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--outage", type=float, default=60, help="MLflow down, a node unhealthy")
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument(
        "--only", type=_kinds, default=None, metavar="KIND[,KIND]",
        help="draw only these fault kinds, in the default mix's shares (e.g. kill-agent to "
        "measure node deaths' recovery alone)",
    )  # fmt: skip
    args = parser.parse_args()
    plan = SoakPlan(
        seed=args.seed, duration_s=args.minutes * 60, mean_interval_s=args.mean_interval,
        outage_s=args.outage, steps=args.steps, checkpoint_every=args.checkpoint_every,
        nodes=args.nodes,
        faults=draw_faults(args.seed, args.minutes * 60, args.mean_interval, args.outage,
                           mix=args.only),
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="forgeline-soak-") as tmp:
        stack = LocalStack(Path(tmp) / "home", {})
        stack.up(args.nodes)
        try:
            record = run_soak(stack, plan, args.out.resolve())
        finally:
            stack.cli("down")
    return print_report(record)


if __name__ == "__main__":
    sys.exit(main())
