"""The soak's faults on a local stack, each as a fleet meets it, and how each is mended.

A fault chooses its target among what runs at that moment (the nodes of the gangs the cluster
has granted, the runs that are training) with the `pick` its plan drew; where nothing fits (no
gang, no shadow-checked run) it is recorded as passed over, not fired elsewhere. A fault that
lasts (a stopped rank, a failing health check, MLflow down, a drained node, a dead process) is
mended `hold_s` later: the process comes back with `forgeline up`, as an operator would bring
it back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.local_stack import LocalStack
from bench.soak_plan import Fault, FaultKind, PlannedRun, RunKind
from infra import node_health
from infra.processes import ManagedProcess
from worker.chaos import trainer_processes
from worker.process_names import CONTROL, MLFLOW, TEMPORAL
from workflows.contracts.cluster_models import ClusterState

SHADOW_EVERY = 10  # the shadow-checked runs' recovery.shadow_every
GRADIENT_SCALE = 1.5  # finite, wrong: only a shadow check can tell


@dataclass
class Fired:
    """What a fault did, and how to mend it (None: nothing to mend, or it mends itself)."""

    target: str
    detail: str
    mend: Callable[[], str] | None = None
    mend_after_s: float = 0.0


class PassedOver(Exception):
    """Nothing the fault could hit was running: it is recorded, not fired elsewhere."""


@dataclass
class Injector:
    stack: LocalStack
    nodes: int
    submit_reclaimer: Callable[[], str]  # the guaranteed team's extra run; returns its name

    def fire(self, fault: Fault, state: ClusterState, runs: dict[str, PlannedRun]) -> Fired:
        match fault.kind:
            case FaultKind.KILL_AGENT:
                return self._kill_agent(_gang_node(state, fault.pick), fault.hold_s)
            case FaultKind.STOP_RANK:
                return self._stop_ranks(_gang_node(state, fault.pick), fault.hold_s)
            case FaultKind.SCALE_GRAD:
                return self._scale_gradients(state, runs, fault.pick)
            case FaultKind.FAIL_HEALTH:
                return self._fail_health(_gang_node(state, fault.pick), fault.hold_s)
            case FaultKind.KILL_CONTROL:
                return self._kill(CONTROL, signal.SIGKILL, 2.0)
            case FaultKind.RESTART_TEMPORAL:
                # An upgrade: stopped as its service manager stops it, started again at once.
                return self._kill(TEMPORAL, signal.SIGTERM, 2.0)
            case FaultKind.MLFLOW_DOWN:
                return self._kill(MLFLOW, signal.SIGTERM, fault.hold_s)
            case FaultKind.PREEMPT:
                return self._reclaim()
            case FaultKind.DRAIN:
                return self._drain(_gang_node(state, fault.pick), fault.hold_s)
        raise ValueError(f"no injector for {fault.kind}")

    def repair(self) -> str:
        """Whatever is dead comes back (`forgeline up` is idempotent). Tried again while it
        fails: a server another fault stopped may still be on its way down when `up` looks."""
        for attempt in range(1, 4):
            try:
                self.stack.cli("up", "--nodes", str(self.nodes), "--gpus-per-node", "1",
                               timeout=300)  # fmt: skip
                return f"forgeline up (try {attempt})"
            except RuntimeError:
                if attempt == 3:
                    raise
                time.sleep(2)
        raise AssertionError("unreachable")

    def _cli(self, *args: str) -> None:
        """A `forgeline` command aimed at what ran a moment ago: refused because it is gone
        (the ranks ended, the node went down), the fault is passed over, saying why."""
        try:
            self.stack.cli(*args, timeout=120)
        except RuntimeError as refused:
            raise PassedOver(str(refused).strip().splitlines()[-1][-300:]) from refused

    def _reclaim(self) -> Fired:
        try:
            run = self.submit_reclaimer()
        except Exception as refused:  # the API or Temporal is down at that moment
            raise PassedOver(f"the reclaiming run was not accepted: {refused}") from refused
        return Fired(run, "the guaranteed team asks for its nodes")

    def _kill_agent(self, node: str, repair_after_s: float) -> Fired:
        pid = ManagedProcess(self.stack.home, node).pid()
        if pid is None:
            raise PassedOver(f"{node} has no agent running")
        os.kill(pid, signal.SIGKILL)
        return Fired(node, f"agent pid {pid} SIGKILLed", self.repair, repair_after_s)

    def _stop_ranks(self, node: str, hold_s: float) -> Fired:
        pids = trainer_processes(self.stack.home, node)
        if not pids:
            raise PassedOver(f"{node} runs no ranks")
        for pid in pids:
            _signal(pid, signal.SIGSTOP)

        def resume() -> str:
            for pid in pids:
                _signal(pid, signal.SIGCONT)
            return f"SIGCONT to {len(pids)} process(es)"

        return Fired(node, f"SIGSTOP to {len(pids)} process(es)", resume, hold_s)

    def _scale_gradients(
        self, state: ClusterState, runs: dict[str, PlannedRun], pick: int
    ) -> Fired:
        checked = sorted(
            a.run_id
            for a in state.allocations
            if a.run_id in runs and runs[a.run_id].kind == RunKind.SHADOW
        )
        if not checked:
            raise PassedOver("no shadow-checked run holds a gang")
        run = checked[pick % len(checked)]
        allocation = next(a for a in state.allocations if a.run_id == run)
        node = allocation.nodes[pick // len(checked) % len(allocation.nodes)].node_id
        # Held still while the step is read and the order written: the command takes a second
        # or more and the tiny model trains dozens of steps a second, so an order aimed ahead
        # of a moving run could arrive after its step and land on an unchecked one, changing
        # the weights unseen (2 of 13 runs of a 20-minute soak; a run of the short soak in CI).
        held = [pid for pid in trainer_processes(self.stack.home, run=run) if not _stopped(pid)]
        for pid in held:
            _signal(pid, signal.SIGSTOP)
        try:
            step = self._latest_step(run, allocation.generation)
            # The checked step after the next: a rank may be one step past its last line.
            at = (step // SHADOW_EVERY + 2) * SHADOW_EVERY
            self._cli("chaos", "corrupt-grad", node, "--finite", "--scale", str(GRADIENT_SCALE),
                      "--at-step", str(at), "--run", run)  # fmt: skip
        finally:
            for pid in held:
                _signal(pid, signal.SIGCONT)
        return Fired(f"{run}@{node}", f"gradients ×{GRADIENT_SCALE} at step {at}")

    def _latest_step(self, run: str, generation: int) -> int:
        """The furthest step `run`'s ranks logged in this generation or a later one (the gang
        may have been replaced since the cluster state was read: a resumed gang starts at or
        before where its predecessor got to)."""
        generations = self.stack.generations(run)
        return max(
            (
                event["step"]
                for g in generations
                if g >= generation
                for event in self.stack.events(run, g)
                if "step" in event
            ),
            default=0,
        )

    def _fail_health(self, node: str, hold_s: float) -> Fired:
        folder = self.stack.home / "nodes" / node
        node_health.fail(folder, "soak: ECC errors")

        def clear() -> str:
            node_health.repaired(folder)
            return "health check passes again"

        return Fired(node, "health check fails", clear, hold_s)

    def _kill(self, name: str, how: signal.Signals, back_after_s: float) -> Fired:
        pid = ManagedProcess(self.stack.home, name).pid()
        if pid is None:
            raise PassedOver(f"{name} is not running")
        os.killpg(pid, how)  # its own session: MLflow's workers and Temporal's go with it
        return Fired(name, f"{how.name} to pid {pid}", self.repair, back_after_s)

    def _drain(self, node: str, hold_s: float) -> Fired:
        self._cli("node", "drain", node)

        def undrain() -> str:
            self.stack.cli("node", "undrain", node)
            return "undrained"

        return Fired(node, "drained", undrain, hold_s)


def _gang_node(state: ClusterState, pick: int) -> str:
    nodes = sorted({n.node_id for a in state.allocations for n in a.nodes})
    if not nodes:
        raise PassedOver("no gang is running")
    return nodes[pick % len(nodes)]


def _stopped(pid: int) -> bool:
    """Whether the process is stopped already (by a stop-rank fault, which mends it later)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _signal(pid: int, how: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.kill(pid, how)
