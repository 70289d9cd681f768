"""What a soak cost and lost, worked out from the runs' own records (the workflow's attempts,
the ranks' progress lines, the store), independently of the goodput Forgeline reports so the
two can be compared:

- per run: how it ended, restarts by cause, steps lost at each failure against half the
  checkpoint interval, committed checkpoints lost (a generation that resumed from a step older
  than the newest commit made before it started), goodput as reported and as measured (the
  steps it kept, at its median step time, over its GPUs' time from the first request to the
  end of its last gang; a median step includes the wait for the slowest rank, which Forgeline
  books as straggler time, so that share is shown beside the two), the failure model's
  terms measured (the kept work, the saves' stalls, the work done again and the restarts:
  what `infra.capacity_plan.goodput` charges, and nothing it leaves out, such as the queue,
  the first start or evaluation) against what the model predicts from the run's checkpoint
  interval, failure and preemption rates and measured restart, and its final weights against
  the fault-free reference of its kind, bitwise; and the same over every run together;
- per fault kind: recovery, from the fault to the victim's first step after it, and for a node
  lost under a gang, where those seconds went (bench/recovery_phases.py);
- for the soak: nodes double-booked, gangs that waited with nodes free, runs not ended.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import torch

from bench.local_stack import LocalStack
from bench.probe_answers import read_probe_answers
from bench.recovery_phases import PARTS, medians, phases
from bench.soak_plan import (
    CONTROL_PLANE,
    FaultKind,
    Interruption,
    RecoveryPhases,
    RunFigures,
    SoakEvent,
    SoakRecord,
    SoakReport,
)
from infra.capacity_plan import goodput as modelled_goodput
from trainer.checkpoint import fetch_checkpoint
from trainer.evaluate import load_model
from trainer.manifest import find_latest
from workflows.contracts.models import (
    AttemptCause,
    AttemptOutcome,
    AttemptRecord,
    Phase,
    RunStatus,
)

FAULT_KINDS = {k.value for k in FaultKind}
NODE_LOSSES = {FaultKind.KILL_AGENT, FaultKind.FAIL_HEALTH, FaultKind.DRAIN}
NODE_LOSS_KINDS = {k.value for k in NODE_LOSSES}
GANG_ENDINGS = {AttemptOutcome.FAILED, AttemptOutcome.PREEMPTED, AttemptOutcome.SWAPPED}


def _steps(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["time"] for e in events if e["event"] == "step"}


def _commits(events: list[dict]) -> list[tuple[float, int]]:
    return [(e["time"], e["step"]) for e in events
            if e["event"] == "checkpoint" and e.get("manifest_key")]  # fmt: skip


def run_figures(stack: LocalStack, status: RunStatus, every: int) -> RunFigures:
    """One run's restarts, lost steps, lost commits and goodput, from its records."""
    attempts = sorted(status.gang_attempts, key=lambda a: a.generation)
    events = {a.generation: stack.events(status.name, a.generation) for a in attempts}
    steps = {g: _steps(e) for g, e in events.items()}
    every_step = [t for g in steps.values() for t in _intervals(g)]
    step_s = statistics.median(every_step) if every_step else 0.0
    kept = status.total_steps if status.phase not in {Phase.FAILED, Phase.CANCELLED} else 0
    gpus = attempts[0].gpus if attempts else 0
    # The GPUs' time as Forgeline counts it (the first request to the end of the last gang),
    # so that only what is called productive differs between the two.
    end = attempts[-1].ended_at if attempts else None
    span = (end - attempts[0].requested_at).total_seconds() if end else 0.0
    reported = status.goodput
    figures = RunFigures(
        phase=status.phase.value,
        error=status.error or "",
        restarts=Counter(a.after.value for a in attempts if a.after != AttemptCause.START),
        interruptions=interruptions(attempts, steps),
        half_interval=every / 2,
        lost_commits=_lost_commits(status, attempts, events, steps),
        step_s=step_s,
        gpus=gpus,
        gpu_s=reported.gpu_s if reported else 0.0,
        lost_gpu_s=reported.lost_gpu_s if reported else {},
        goodput_reported=reported.goodput if reported else None,
        goodput_measured=kept * step_s / span if span else None,
    )
    if kept and step_s:
        _model_scope(figures, kept, every)
    return figures


def interruptions(
    attempts: list[AttemptRecord], steps: dict[int, dict[int, float]]
) -> list[Interruption]:
    """Each gang that trained and ended early, with the steps the next gang that trained did
    again and the time between the two (gangs that failed before a step between them are
    part of that restart). A wait for nodes to free is not the restart's: after a failure the
    run waits for a spare or a mended node (the model's restart), after a preemption or a swap
    it queues like any run."""
    trained = [a for a in attempts if steps[a.generation]]
    found = []
    for before, after in itertools.pairwise(trained):
        if before.outcome not in GANG_ENDINGS:
            continue
        ran, resumed = steps[before.generation], steps[after.generation]
        queued = sum(
            (a.granted_at - a.requested_at).total_seconds()
            for a in attempts
            if before.generation < a.generation <= after.generation
            and a.after not in (AttemptCause.FAILURE, AttemptCause.GROW)
        )
        found.append(Interruption(
            outcome=before.outcome.value,
            lost_steps=max(ran) - (min(resumed) - 1),
            restart_s=min(resumed.values()) - max(ran.values()) - queued,
        ))  # fmt: skip
    return found


def _lost_commits(
    status: RunStatus,
    attempts: list[AttemptRecord],
    events: dict[int, list[dict]],
    steps: dict[int, dict[int, float]],
) -> list[str]:
    """Gangs that resumed from a step older than the newest commit made before they trained
    (a commit passed over as corrupt is said, not lost)."""
    lost = []
    committed: list[tuple[float, int]] = []
    for attempt, following in itertools.pairwise(attempts):
        committed += _commits(events[attempt.generation])
        resumed = steps[following.generation]
        if attempt.outcome not in GANG_ENDINGS or not resumed:
            continue
        resume_step, resumed_at = min(resumed) - 1, min(resumed.values())
        newest = max((s for t, s in committed if t < resumed_at), default=0)
        skipped = any(f"step-{newest}/" in why for why in status.skipped_checkpoints)
        if resume_step < newest and not skipped:
            lost.append(f"gen {following.generation} resumed at {resume_step}, "
                        f"step {newest} was committed")  # fmt: skip
    return lost


def _model_scope(figures: RunFigures, kept: int, every: int) -> None:
    """The failure model's terms of the run, measured, and what the model makes of them: the
    kept steps' work at the median step, each save's stall (as the run reported its saves),
    the steps trained again and each restart. The model charges a failure half an interval of
    work; the soak measures what each lost."""
    step_s, found = figures.step_s, figures.interruptions
    work_s = kept * step_s
    stall_s = figures.lost_gpu_s.get("checkpoint stall", 0.0) / max(figures.gpus, 1)
    failed = [i.restart_s for i in found if i.outcome == AttemptOutcome.FAILED]
    saved = [i.restart_s for i in found if i.outcome != AttemptOutcome.FAILED]  # saved first
    scope_s = work_s + stall_s + sum(i.lost_steps for i in found) * step_s
    scope_s += sum(failed) + sum(saved)
    saves = kept // every + len(saved)
    figures.scope_s = scope_s
    figures.goodput_scope_measured = work_s / scope_s
    figures.goodput_predicted = modelled_goodput(
        save_s=stall_s / saves if saves else 0.0,
        interval_s=every * step_s,
        restart_s=statistics.mean(failed) if failed else 0.0,
        mtbf_s=scope_s / len(failed) if failed else math.inf,
        mtbp_s=scope_s / len(saved) if saved else math.inf,
        resume_s=statistics.mean(saved) if saved else None,
    )


def fleet_goodput(report: SoakReport) -> dict[str, float | None]:
    """Every run together: goodput reported and measured over all their GPU-time, and the
    failure model's scope measured and predicted (each run weighted by its own scope)."""
    runs = list(report.runs.values())
    gpu_s = sum(r.gpu_s for r in runs if r.goodput_measured is not None)
    scoped = [r for r in runs if r.goodput_predicted is not None and r.scope_s]
    scope_s = sum(r.scope_s * r.gpus for r in scoped)

    def weighted(pairs: list[tuple[float, float]], total: float) -> float | None:
        return sum(v * w for v, w in pairs) / total if total else None

    measured = [r for r in runs if r.goodput_measured is not None]
    return {
        "reported": weighted([(r.goodput_reported or 0.0, r.gpu_s) for r in measured], gpu_s),
        "measured": weighted([(r.goodput_measured or 0.0, r.gpu_s) for r in measured], gpu_s),
        "straggler": sum(r.lost_gpu_s.get("straggler", 0.0) for r in measured) / gpu_s
        if gpu_s
        else None,
        "scope measured": weighted(
            [(r.goodput_scope_measured or 0.0, r.scope_s * r.gpus) for r in scoped], scope_s
        ),
        "predicted": weighted(
            [(r.goodput_predicted or 0.0, r.scope_s * r.gpus) for r in scoped], scope_s
        ),
    }


def _intervals(steps: dict[int, float]) -> list[float]:
    return [steps[s] - steps[s - 1] for s in steps if s - 1 in steps]


def recovery_by_kind(stack: LocalStack, record: SoakRecord) -> dict[str, list[float]]:
    """Seconds from each fault that hit a gang to its run's first step after it (a stopped
    rank: after it was let go), and each control-plane fault's outage (to its mend)."""
    found: dict[str, list[float]] = defaultdict(list)
    mends = [e for e in record.events if e.what == "mend"]
    for event in record.events:
        if event.what not in FAULT_KINDS or "passed over" in event.detail:
            continue
        kind = FaultKind(event.what)
        if kind in CONTROL_PLANE:
            back = next((m for m in mends if m.at_s >= event.at_s and m.target == event.target),
                        None)  # fmt: skip
            if back is not None:
                found[kind.value].append(back.at_s - event.at_s)
            continue
        if event.run and (seconds := _next_step_after(stack, record, event)) is not None:
            found[_recovery_key(kind, event)].append(seconds)
    return found


def phases_by_kind(
    stack: LocalStack, record: SoakRecord, statuses: dict[str, RunStatus]
) -> dict[str, list[RecoveryPhases]]:
    """Each node loss under a gang, its recovery by part (bench/recovery_phases.py)."""
    found: dict[str, list[RecoveryPhases]] = defaultdict(list)
    for event in record.events:
        if event.what not in NODE_LOSS_KINDS or "passed over" in event.detail:
            continue
        if (status := statuses.get(event.run)) is None:
            continue
        attempts = status.gang_attempts
        events = {a.generation: stack.events(event.run, a.generation) for a in attempts
                  if a.generation >= event.generation}  # fmt: skip
        found_at = record.started_epoch + event.at_s
        if parts := phases(found_at, event.generation, attempts, events):
            found[_recovery_key(FaultKind(event.what), event)].append(parts)
    return found


def _recovery_key(kind: FaultKind, event: SoakEvent) -> str:
    """A node lost under a gang is recovered from in seconds where another node is free to
    take its place, and only once it is mended where none is: the two apart."""
    if kind not in NODE_LOSSES or event.free_nodes is None:
        return kind.value
    return f"{kind.value}, {'a node free' if event.free_nodes else 'none free'}"


def _next_step_after(stack: LocalStack, record: SoakRecord, fault: SoakEvent) -> float | None:
    """Seconds from the fault to its victim's first step in a later gang (a stopped rank: its
    first step after it was let go, in any gang); None when the run never trained again."""
    at = record.started_epoch + fault.at_s
    stopped = fault.what == FaultKind.STOP_RANK
    if stopped:
        at += fault.hold_s
    generations = stack.generations(fault.run)
    later = [
        t
        for g in generations
        if g > fault.generation or (stopped and g == fault.generation)
        for t in _steps(stack.events(fault.run, g)).values()
        if t > at
    ]
    return min(later) - (record.started_epoch + fault.at_s) if later else None


def same_weights(stack: LocalStack, run: str, reference: str, scratch: Path) -> bool | None:
    """Whether two runs' last committed checkpoints hold bitwise the same model (None: one of
    them has none)."""
    store = stack.store()
    loaded = []
    for name in (run, reference):
        found = find_latest(store, name, max_generation=10**9)
        if found is None:
            return None
        folder = fetch_checkpoint(store, found.manifest, scratch / f"{name}-step-{found.step}")
        loaded.append(load_model(folder, found.manifest.network).state_dict())
    mine, theirs = loaded
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def build_report(
    stack: LocalStack,
    record: SoakRecord,
    references: dict[str, str],
    ended: dict[str, Phase],
    scratch: Path,
) -> SoakReport:
    api = stack.api()
    runs: dict[str, RunFigures] = {}
    statuses: dict[str, RunStatus] = {}
    for planned in record.runs:
        status = statuses[planned.name] = api.status(planned.name).status
        figures = run_figures(stack, status, record.plan.checkpoint_every)
        reference = references.get(planned.name)
        if reference and reference != planned.name and status.phase != Phase.FAILED:
            figures.bitwise = same_weights(stack, planned.name, reference, scratch)
        runs[planned.name] = figures
    fired = [e for e in record.events if e.what in FAULT_KINDS]
    return SoakReport(
        runs=runs,
        not_ended=sorted(r.name for r in record.runs if r.name not in ended),
        violations=[e.detail for e in record.events if e.what == "violation"],
        waited_free=[f"{e.target}: {e.detail}" for e in record.events if e.what == "waited-free"],
        recovery_s=recovery_by_kind(stack, record),
        recovery_phases=phases_by_kind(stack, record, statuses),
        faults=Counter(e.what for e in fired if "passed over" not in e.detail),
        passed_over=sum(1 for e in fired if "passed over" in e.detail),
        probes=read_probe_answers(stack.home),
    )


def _percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p50, p95 = statistics.median(ordered), _at(ordered, 0.95)
    return f"{p50:.1f} / {p95:.1f} / {ordered[-1]:.1f} s (n={len(ordered)})"


def _at(ordered: list[float], share: float) -> float:
    """The value `share` of the way up sorted values (nearest rank)."""
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def print_report(record: SoakRecord) -> int:
    """The soak's tables; 1 when a target is missed (a run not ended, a node booked twice, a
    committed checkpoint lost, weights not bitwise their reference's), else 0."""
    report = record.report or SoakReport()
    plan = record.plan
    print(f"\nsoak: {plan.duration_s / 60:.0f} min, a fault every {plan.mean_interval_s:.0f} s on "
          f"average (seed {plan.seed}), {plan.nodes} nodes; fired {sum(report.faults.values())}"
          f" {dict(report.faults)}, passed over {report.passed_over}")  # fmt: skip
    header = ("run", "ended", "restarts", "lost steps: mean of half the interval",
              "goodput reported", "measured", "of the gap: straggler",
              "model's terms: measured", "predicted", "bitwise")  # fmt: skip
    rows = [header]
    for name, run in report.runs.items():
        lost = f"{statistics.mean(run.lost_steps):.0f}" if run.lost_steps else "-"
        rows.append((
            name, run.phase, str(sum(run.restarts.values())) + f" {run.restarts or ''}",
            f"{lost} of {run.half_interval:.0f} {run.lost_steps}",
            _share(run.goodput_reported), _share(run.goodput_measured),
            _share(run.lost_gpu_s.get("straggler", 0.0) / run.gpu_s if run.gpu_s else None),
            _share(run.goodput_scope_measured), _share(run.goodput_predicted),
            {True: "yes", False: "NO", None: "-"}[run.bitwise],
        ))  # fmt: skip
    fleet = fleet_goodput(report)
    rows.append(("all runs", "", "", "", _share(fleet["reported"]), _share(fleet["measured"]),
                 _share(fleet["straggler"]), _share(fleet["scope measured"]),
                 _share(fleet["predicted"]), ""))  # fmt: skip
    _table(rows)
    print()
    recovery = sorted(report.recovery_s.items())
    _table([("fault", "recovery p50 / p95 / max"), *((k, _percentiles(s)) for k, s in recovery)])
    if report.recovery_phases:
        print("\nnode losses, where the seconds went (median of each part):")
        rows = [("fault", "n", *PARTS, "sum")]
        for key, found in sorted(report.recovery_phases.items()):
            parts = medians(found)
            rows.append((key, str(len(found)), *(f"{parts[p]:.1f}" for p in PARTS),
                         f"{sum(parts.values()):.1f}"))  # fmt: skip
        _table(rows)
    if (probes := report.probes) is not None and probes.answered_ms:
        answered = sorted(probes.answered_ms)
        print(f"\nliveness probes: {len(answered)} answered in {statistics.median(answered):.0f}"
              f" / {_at(answered, 0.99):.0f} / {answered[-1]:.0f} ms (p50 / p99 / max), "
              f"{probes.unanswered} "
              "unanswered")  # fmt: skip
    lost = [c for run in report.runs.values() for c in run.lost_commits]
    mismatched = [n for n, run in report.runs.items() if run.bitwise is False]
    print()
    _table([
        ("check", "found"),
        ("runs not ended", str(report.not_ended or 0)),
        ("nodes or runs double-booked", str(len(report.violations))),
        ("committed checkpoints lost", str(len(lost))),
        ("gangs that waited > 10 s with nodes free", str(len(report.waited_free))),
        ("runs not bitwise their reference", str(mismatched or 0)),
    ])  # fmt: skip
    for line in report.violations[:10] + lost[:10] + report.waited_free[:10]:
        print("  ", line)
    return 1 if report.not_ended or report.violations or lost or mismatched else 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
