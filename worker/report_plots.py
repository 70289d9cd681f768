"""The figures of a run report, drawn with matplotlib: loss, throughput and model FLOPs
utilisation per generation, and the goodput timeline with where the GPU-seconds went.

Each figure notes in `missing` what it had nothing to draw for, so the summary can say so.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from worker.report_data import (
    KEPT_LOSS,
    LOSS,
    MFU,
    TOKENS_PER_S,
    VAL_LOSS,
    CheckpointMark,
    Metrics,
    Point,
    by_time,
)
from workflows.contracts.models import (
    SELF_REPORTED,
    AttemptCause,
    AttemptOutcome,
    AttemptRecord,
    RunStatus,
)

_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:cyan")


def save_png(figure: Figure, path: Path) -> Path:
    # A bare Figure renders through Agg when saved as PNG without touching pyplot's global
    # backend or figure registry: safe in a CLI, a worker thread or a headless test.
    figure.savefig(path, format="png", dpi=100)
    return path


def loss_figure(status: RunStatus, metrics: Metrics, missing: list[str]) -> Figure:
    figure = Figure(figsize=(10, 5.5), layout="constrained")
    ax = figure.add_subplot()
    drew = _streamed(ax, metrics.get(LOSS, []), status.gang_attempts, "train loss")
    kept = metrics.get(KEPT_LOSS, [])
    if kept:
        steps, values = _xy(sorted(kept))
        ax.plot(steps, values, color="black", lw=2, label="train loss, kept lineage (registered)")
    val = metrics.get(VAL_LOSS, [])
    if val:
        steps, values = _xy(val)
        ax.plot(steps, values, "o--", color="tab:red", ms=4, label="val loss (during training)")
    if status.evaluation and status.evaluation.val_loss is not None:
        e = status.evaluation
        # Held-out loss of each kept checkpoint, where the evaluation recorded them (newer runs).
        curve = sorted((p.step, p.val_loss) for p in getattr(e, "curve", []))
        if curve:
            steps, values = zip(*curve, strict=True)
            ax.plot(steps, values, "s-", c="darkred", ms=4, label="val loss of kept checkpoints")
        label = f"val loss {e.val_loss:.4f}, perplexity {e.perplexity:.2f} (final evaluation)"
        if e.self_reported:
            label = f"val loss {e.val_loss:.4f} ({SELF_REPORTED})"
        ax.scatter([e.step], [e.val_loss], marker="*", s=220, c="tab:red", zorder=5, label=label)
    if not (drew or kept or val):
        missing.append(f"no loss in MLflow yet ({LOSS}, {KEPT_LOSS})")
        _empty(ax, "no loss metrics in MLflow yet")
    if not status.evaluation:
        missing.append(f"no final evaluation yet (phase {status.phase.value})")
    _resume_lines(ax, status.gang_attempts)
    ax.set(xlabel="step", ylabel="loss", title=f"{status.name}: loss")
    ax.grid(alpha=0.3)
    _legend(ax)
    return figure


def throughput_figure(status: RunStatus, metrics: Metrics, missing: list[str]) -> Figure:
    figure = Figure(figsize=(10, 6.5), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    attempts = status.gang_attempts
    for ax, key, label, overall, scale in (
        (top, TOKENS_PER_S, "tokens/s", status.tokens_per_s, 1.0),
        (bottom, MFU, "MFU %", status.mfu, 100.0),
    ):
        points = [(s, v * scale, t) for s, v, t in metrics.get(key, [])]
        if not _streamed(ax, points, attempts, label):
            missing.append(f"no {key} in MLflow yet")
            _empty(ax, f"no {key} in MLflow yet")
        if overall is not None:
            ax.axhline(overall * scale, color="black", ls="--", lw=1, label=f"{label} of the run")
        _resume_lines(ax, attempts)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        _legend(ax)
    top.set_title(f"{status.name}: throughput and model FLOPs utilisation")
    bottom.set_xlabel("step")
    return figure


def _streamed(ax: Axes, points: list[Point], attempts: list[AttemptRecord], what: str) -> bool:
    """Plot a streamed series as it happened: one line per generation, repeated steps and all."""
    labelled = set()
    for index, (label, run) in enumerate(_segments(points, attempts)):
        steps, values = _xy(run)
        name = f"{what} ({label})" if label else what
        ax.plot(
            steps,
            values,
            color=_COLORS[index % len(_COLORS)],
            lw=1.2,
            alpha=0.85,
            marker="." if len(run) < 40 else None,
            label=None if name in labelled else name,
        )
        labelled.add(name)
    return bool(points)


def _segments(points: list[Point], attempts: list[AttemptRecord]) -> list[tuple[str, list[Point]]]:
    """Cut a streamed series where its generation changes or its step goes back (a restart
    that the attempts do not explain), so a restart's repeated steps show as their own line."""
    segments: list[tuple[str, list[Point]]] = []
    for point in sorted(points, key=by_time):
        generation = _generation_at(point[2], attempts)
        label = f"gen {generation}" if generation is not None else ""
        if not segments or segments[-1][0] != label or point[0] <= segments[-1][1][-1][0]:
            segments.append((label, []))
        segments[-1][1].append(point)
    if not attempts and len(segments) > 1:
        segments = [(f"segment {i + 1}", run) for i, (_, run) in enumerate(segments)]
    return segments


def _generation_at(timestamp_ms: int, attempts: list[AttemptRecord]) -> int | None:
    found = None
    for attempt in sorted(attempts, key=lambda a: a.granted_at):
        if attempt.granted_at.timestamp() * 1000 <= timestamp_ms:
            found = attempt.generation
    return found


def _resume_lines(ax: Axes, attempts: list[AttemptRecord]) -> None:
    """A dotted line where each restarted generation picked up from its checkpoint."""
    for attempt in attempts:
        if attempt.after == AttemptCause.START or attempt.ledger is None:
            continue
        step = attempt.ledger.resume_step
        ax.axvline(step, color="grey", ls=":", lw=1)
        ax.annotate(
            f"gen {attempt.generation} resumes",
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="grey",
        )


# --- the goodput timeline ------------------------------------------------------------------------

# Phase of an attempt -> (colour, legend text).
_BANDS = {
    "wait": ("lightgrey", "waiting for a gang"),
    "start": ("gold", "startup / restore"),
    "kept": ("tab:green", "training, kept"),
    "lost": ("salmon", "training, lost (rework)"),
    "detect": ("firebrick", "failure detection"),
    "tail": ("steelblue", "final save, teardown"),
    "running": ("palegreen", "training (still running)"),
}


def goodput_figure(
    status: RunStatus, checkpoints: list[CheckpointMark], missing: list[str]
) -> Figure:
    figure = Figure(figsize=(11, 6.5), layout="constrained")
    timeline, causes = figure.subplots(2, 1, height_ratios=(3, 1))
    attempts = sorted(status.gang_attempts, key=lambda a: a.requested_at)
    goodput = status.goodput
    if goodput is not None:
        title = (
            f"{status.name}: goodput {goodput.goodput:.1%} of {goodput.gpu_s:,.0f} GPU-s, "
            f"{sum(goodput.lost_gpu_s.values()):,.0f} GPU-s lost over {goodput.attempts} attempt(s)"
        )
    else:
        title = f"{status.name}: goodput not accounted yet"
        missing.append("no goodput yet: no gang attempt has ended")
    timeline.set_title(title)
    if not attempts:
        missing.append("no gang attempts yet: nothing to put on the timeline")
        _empty(timeline, "no gang attempts yet")
    else:
        _draw_timeline(timeline, status, attempts, checkpoints)
    _draw_causes(causes, status)
    return figure


def _draw_timeline(
    ax: Axes,
    status: RunStatus,
    attempts: list[AttemptRecord],
    checkpoints: list[CheckpointMark],
) -> None:
    t0 = attempts[0].requested_at.timestamp()
    now = _now(status, attempts)
    rows = {attempt.generation: row for row, attempt in enumerate(attempts)}
    used: dict[str, object] = {}

    def band(row: int, kind: str, start: float, end: float) -> None:
        if end <= start:
            return
        color, label = _BANDS[kind]
        ax.broken_barh([(start - t0, end - start)], (row - 0.3, 0.6), color=color)
        used.setdefault(label, Patch(color=color, label=label))

    def mark(row: float, at: float, style: dict, label: str, text: str = "") -> None:
        handle = ax.scatter([at - t0], [row], zorder=5, label=label, **style)
        used.setdefault(label, handle)
        if text:
            ax.annotate(text, (at - t0, row), xytext=(4, 9), textcoords="offset points", fontsize=8)

    for row, attempt in enumerate(attempts):
        for kind, start, end in _phases(attempt, now):
            band(row, kind, start, end)
        ledger = attempt.ledger
        if attempt.after != AttemptCause.START:
            at = ledger.ready_at if ledger and ledger.ready_at else attempt.granted_at.timestamp()
            where = f"from step {ledger.resume_step}" if ledger else ""
            mark(row, at, _RECOVERY, f"recovered ({attempt.after}): training resumes", where)
        if ledger and ledger.kept:
            mark(row, ledger.kept.at, _CHECKPOINT, "checkpoint committed", f"{ledger.kept.step}")
    seen = {a.ledger.kept.step for a in attempts if a.ledger and a.ledger.kept}
    for checkpoint in checkpoints:
        if checkpoint.step not in seen:
            row = rows.get(checkpoint.generation, _row_at(checkpoint.at, attempts))
            at = checkpoint.at.timestamp()
            mark(row, at, _CHECKPOINT, "checkpoint committed", f"{checkpoint.step}")
    for failure in status.failures:
        row = rows.get(failure.generation, _row_at(failure.at, attempts))
        text = f"{failure.node_id or '?'}: {failure.kind}"
        mark(row, failure.at.timestamp(), _FAILURE, "failure", text)
    for preemption in status.preemptions:
        row = rows.get(preemption.generation, _row_at(preemption.at, attempts))
        mark(row, preemption.at.timestamp(), _PREEMPTION, "preemption")
    for event in status.health:
        if event.at is not None:
            row = rows.get(event.generation, _row_at(event.at, attempts))
            mark(row, event.at.timestamp(), _HEALTH, f"health: {event.kind}", event.node_id or "")
    ax.set_yticks(
        range(len(attempts)),
        [f"gen {a.generation} · {a.gpus} GPU · {a.outcome}" for a in attempts],
    )
    ax.invert_yaxis()
    start = datetime.fromtimestamp(t0, UTC)
    ax.set_xlabel(f"seconds since the first gang request ({start:%Y-%m-%d %H:%M:%S} UTC)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=list(used.values()), fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))


_FAILURE = {"marker": "X", "s": 110, "color": "red", "edgecolors": "black"}
_RECOVERY = {"marker": "P", "s": 110, "color": "limegreen", "edgecolors": "black"}
_CHECKPOINT = {"marker": "D", "s": 45, "color": "navy"}
_PREEMPTION = {"marker": "v", "s": 90, "color": "darkorange", "edgecolors": "black"}
_HEALTH = {"marker": "^", "s": 80, "color": "khaki", "edgecolors": "black"}


def _phases(attempt: AttemptRecord, now: float) -> list[tuple[str, float, float]]:
    """An attempt cut where goodput cuts it (workflows.goodput), in epoch seconds."""
    requested, granted = attempt.requested_at.timestamp(), attempt.granted_at.timestamp()
    ended = attempt.ended_at.timestamp() if attempt.ended_at else now
    phases = [("wait", requested, granted)]
    ledger = attempt.ledger
    if ledger is None or ledger.ready_at is None:
        return [*phases, ("start", granted, ended)]
    ready = min(max(ledger.ready_at, granted), ended)
    phases.append(("start", granted, ready))
    if attempt.ended_at is None:
        return [*phases, ("running", ready, ended)]
    secured = min(max(ledger.kept.at, ready), ended) if ledger.kept else ready
    phases.append(("kept", ready, secured))
    if attempt.outcome == AttemptOutcome.FAILED:
        heard = min(max(ledger.last.at, secured), ended) if ledger.last else secured
        return [*phases, ("lost", secured, heard), ("detect", heard, ended)]
    return [*phases, ("tail", secured, ended)]


def _draw_causes(ax: Axes, status: RunStatus) -> None:
    """One stacked bar: where the run's GPU-seconds went."""
    goodput = status.goodput
    ax.set_yticks([])
    if goodput is None or not goodput.gpu_s:
        ax.set_xticks([])
        _empty(ax, "GPU-seconds by cause: not accounted yet")
        return
    parts = [("productive", goodput.productive_gpu_s)]
    parts += sorted(goodput.lost_gpu_s.items(), key=lambda item: -item[1])
    left = 0.0
    for cause, gpu_s in parts:
        color = _CAUSE_COLORS.get(cause, "black")
        label = f"{cause}: {gpu_s:,.1f} GPU-s ({gpu_s / goodput.gpu_s:.1%})"
        ax.barh([0], [gpu_s], left=left, color=color, label=label)
        left += gpu_s
    ax.set_xlim(0, max(left, goodput.gpu_s))
    ax.set_xlabel("GPU-seconds")
    ax.set_title("GPU-seconds by cause", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))


# The causes of workflows.goodput, in the timeline's colours where the timeline shows them.
_CAUSE_COLORS = {
    "productive": "tab:green",
    "queue": "lightgrey",
    "startup": "gold",
    "restart": "orange",
    "checkpoint stall": "steelblue",
    "evaluation": "orchid",
    "straggler": "sandybrown",
    "pipeline bubble": "peru",
    "rework": "salmon",
    "failure detection": "firebrick",
    "teardown": "slategrey",
    "other": "khaki",
}


# --- small helpers -------------------------------------------------------------------------------


def _xy(points: list[Point]) -> tuple[list[int], list[float]]:
    return [p[0] for p in points], [p[1] for p in points]


def _row_at(at: datetime, attempts: list[AttemptRecord]) -> int:
    """The row of the attempt that had asked for its gang by `at` (the first one before any)."""
    row = 0
    for index, attempt in enumerate(attempts):
        if attempt.requested_at <= at:
            row = index
    return row


def _now(status: RunStatus, attempts: list[AttemptRecord]) -> float:
    """Where a running attempt's band ends: the status's own time, else the newest one known."""
    if status.updated_at is not None:
        return status.updated_at.timestamp()
    times = [a.ended_at or a.granted_at for a in attempts]
    return max(t.timestamp() for t in times)


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
