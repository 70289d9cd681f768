"""report.md: a run report's Markdown summary, the figures a person asks about first, then the
gang attempts and what failed, with what the report could not show.
"""

from __future__ import annotations

from worker.report_data import (
    KEPT_LOSS,
    LOSS,
    MFU,
    TOKENS_PER_S,
    VAL_LOSS,
    Metrics,
    Report,
    by_time,
    first_line,
    mlflow_run_of,
)
from workflows.contracts.models import SELF_REPORTED, AttemptRecord, RunStatus


def summary(status: RunStatus, metrics: Metrics, report: Report) -> str:
    """report.md: the figures a person asks about first, then the attempts and what failed."""
    s = status
    loss, loss_from = _latest(s.final_loss, metrics, (KEPT_LOSS, LOSS))
    speed, speed_from = _latest(s.tokens_per_s, metrics, (TOKENS_PER_S,))
    mfu, mfu_from = _latest(s.mfu, metrics, (MFU,))
    streamed_steps = [p[0] for p in metrics.get(LOSS, [])]
    checkpoint = s.last_checkpoint
    steps = f"{max(streamed_steps) if streamed_steps else 'none'} streamed of {s.total_steps}; "
    if checkpoint:
        steps += f"checkpoint at step {checkpoint.step} (generation {checkpoint.generation})"
    else:
        steps += "no checkpoint committed"
    rows = [
        ("phase", s.phase.value + (f" ({s.error})" if s.error else "")),
        ("owner", s.owner),
        ("steps", steps),
        ("final train loss", _fmt(loss, ".4f", loss_from)),
    ]
    if s.evaluation and s.evaluation.val_loss is None:
        rows.append(("val loss", f"none: the script reports no loss (step {s.evaluation.step})"))
    elif s.evaluation:
        e = s.evaluation
        rows += [
            (
                "val loss",
                f"{e.val_loss:.4f} (step {e.step}, {e.val_tokens:,} tokens)"
                + (f", {SELF_REPORTED}" if e.self_reported else ""),
            ),
            ("val perplexity", f"{e.perplexity:.2f}"),
        ]
    else:
        val, val_from = _latest(None, metrics, (VAL_LOSS,))
        rows.append(("val loss", _fmt(val, ".4f", val_from) + " (no final evaluation yet)"))
    rows += [
        ("tokens/s", _fmt(speed, ",.0f", speed_from)),
        ("MFU", _fmt(mfu, ".2%", mfu_from)),
    ]
    g = s.goodput
    if g is not None:
        rows.append(
            (
                "goodput",
                f"{g.goodput:.1%} of {g.gpu_s:,.0f} GPU-s "
                f"({g.allocated_goodput:.1%} of the {g.allocated_gpu_s:,.0f} allocated)",
            )
        )
        lost = sorted(g.lost_gpu_s.items(), key=lambda item: -item[1])
        rows.append(("GPU-s lost", ", ".join(f"{c} {v:,.1f}" for c, v in lost) or "none"))
    else:
        rows.append(("goodput", "- (no gang attempt has ended)"))
    attempts = (
        f"{s.goodput.attempts if s.goodput else len(s.gang_attempts)} gang attempt(s), "
        f"{max(s.failures_total, len(s.failures))} failure(s), "
        f"{max(s.preemptions_total, len(s.preemptions))} preemption(s)"
    )
    if len(s.gang_attempts) < (s.goodput.attempts if s.goodput else 0):
        attempts += f"; the newest {len(s.gang_attempts)} are listed"
    rows.append(("attempts", attempts))
    mv = s.model_version
    rows.append(
        ("model version", f"{mv.model_name} v{mv.version} (alias {mv.alias})" if mv else "-")
    )
    rows.append(("MLflow run", mlflow_run_of(s) or "-"))

    lines = [f"# Run {s.name}", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in rows]
    lines += _attempt_lines(s)
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in report.files if p.suffix == ".png"]
    if report.missing:
        lines += ["", "## Missing", ""]
        lines += [f"- {what}" for what in report.missing]
    return "\n".join(lines) + "\n"


def _attempt_lines(s: RunStatus) -> list[str]:
    lines = []
    if s.gang_attempts:
        lines += [
            "",
            "## Gang attempts",
            "",
            "| gen | GPUs | after | requested | granted | ended | outcome | steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for a in s.gang_attempts:
            ended = f"{a.ended_at:%H:%M:%S}" if a.ended_at else "-"
            lines.append(
                f"| {a.generation} | {a.gpus} | {a.after} | {a.requested_at:%H:%M:%S} | "
                f"{a.granted_at:%H:%M:%S} | {ended} | {a.outcome} | {_steps(a)} |"
            )
    events = [
        (
            f.at,
            f"failure, gen {f.generation} on {f.node_id or '?'} ({f.kind}): {first_line(f.reason)}",
        )
        for f in s.failures
    ]
    events += [
        (p.at, f"preemption, gen {p.generation}: {p.reason}" + _at_step(p.step))
        for p in s.preemptions
    ]
    events += [
        (
            h.at,
            f"health, gen {h.generation} on {h.node_id or '?'}: {h.kind} ({h.action})"
            + _at_step(h.step)
            + (f": {h.evidence}" if h.evidence else ""),
        )
        for h in s.health
        if h.at is not None
    ]
    if events:
        lines += ["", "## Failures and events", ""]
        lines += [f"- {at:%H:%M:%S} {text}" for at, text in sorted(events, key=lambda e: e[0])]
    return lines


def _steps(attempt: AttemptRecord) -> str:
    ledger = attempt.ledger
    if ledger is None:
        return "-"
    last = ledger.last.step if ledger.last else ledger.resume_step
    kept = f", kept to {ledger.kept.step}" if ledger.kept else ""
    return f"{ledger.resume_step}→{last}{kept}"


# --- small helpers -------------------------------------------------------------------------------


def _latest(
    recorded: float | None, metrics: Metrics, keys: tuple[str, ...]
) -> tuple[float | None, str]:
    """The workflow's figure if it has one, else the newest logged value (and where from)."""
    if recorded is not None:
        return recorded, ""
    for key in keys:
        if metrics.get(key):
            return max(metrics[key], key=by_time)[1], f"latest {key}"
    return None, ""


def _fmt(value: float | None, spec: str, source: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) + (f" ({source})" if source else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _at_step(step: int | None) -> str:
    return f" at step {step}" if step is not None else ""
