"""How runs and nodes look in the terminal."""

from __future__ import annotations

import textwrap

from rich.table import Table

from infra.settings import Settings
from worker.runs import RunView
from workflows.approval import gate_passed
from workflows.contracts.models import (
    SELF_REPORTED,
    DatasetProgress,
    EvalResult,
    Goodput,
    Phase,
    RunStatus,
    Sample,
)


def of_total(step: int | None, total: int) -> str:
    """ "12/200"; "12" for a script that counts its own steps (no total is known)."""
    return f"{step}/{total}" if total else f"{step}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def eta_text(seconds: float | None) -> str:
    """`2h05m`, `4m07s`, `12s`: what is left at the gang's newest step rate."""
    if seconds is None:
        return "-"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def eta_of(view: RunView) -> float | None:
    """Only while the gang trains: a run between gangs has no rate to go by."""
    if view.progress is None or view.status.phase != Phase.TRAINING:
        return None
    return view.progress.eta_s


def step_of(view: RunView) -> int:
    return view.newest_step or 0


def loss_of(view: RunView) -> float | None:
    if view.progress is not None and view.progress.loss is not None:
        return view.progress.loss
    return view.status.final_loss


def stage_bars(progress: DatasetProgress, width: int = 10) -> str:
    """`scan ███████░░░ 7/10 · dedup ░░░░░░░░░░ 0/1 …`: one bar per data stage."""
    parts = []
    for stage in progress.stages:
        filled = round(width * stage.done / stage.total) if stage.total else 0
        bar = "█" * filled + "░" * (width - filled)
        parts.append(f"{stage.name} {bar} {stage.done}/{stage.total or '?'}")
    return " · ".join(parts)


def progress_line(view: RunView) -> str:
    status, beat = view.status, view.progress
    line = f"{status.phase.value:<17}"
    if view.dataset is not None:
        line += f" {stage_bars(view.dataset)}"
    if beat is not None:
        line += f" step {of_total(beat.step, status.total_steps)}"
        line += f"  loss {_num(beat.loss, '.4f')}"
        line += f"  tokens/s {_num(beat.tokens_per_s, ',.0f')}"
        if (eta := eta_of(view)) is not None:
            line += f"  {beat.steps_per_s:.2f} steps/s  ETA {eta_text(eta)}"
    if status.generation is not None and not status.phase.final:
        line += f"  gen {status.generation}"
    committed = beat.checkpoint_step if beat else None
    if committed is None and status.last_checkpoint:
        committed = status.last_checkpoint.step
    if committed is not None:
        line += f"  ckpt {committed}"
    if status.evaluation and status.evaluation.val_loss is not None:
        line += f"  val_loss {status.evaluation.val_loss:.4f}"
        if status.evaluation.self_reported:
            line += " (self-reported)"
    if status.model_version:
        mv = status.model_version
        line += f"  model {mv.model_name} v{mv.version}"
    for retry in view.retrying:
        line += f"\n    retrying {retry}"
    return line


def runs_table(views: list[RunView]) -> Table:
    table = Table(title="runs")
    for column in ("name", "phase", "step", "ETA", "loss", "attempts", "generation", "model"):
        table.add_column(column)
    for view in views:
        status = view.status
        model = status.model_version
        table.add_row(
            status.name,
            status.phase.value,
            of_total(step_of(view), status.total_steps),
            eta_text(eta_of(view)),
            _num(loss_of(view), ".4f"),
            str(status.attempts),
            str(status.generation or "-"),
            f"{model.model_name} v{model.version}" if model else "-",
        )
    return table


def status_text(view: RunView, settings: Settings) -> str:
    s, beat = view.status, view.progress
    lines = [
        f"run            {s.name}  (owner {s.owner})",
        f"phase          {s.phase.value}",
        f"allocation     generation {s.generation or '-'} on {', '.join(s.nodes)}"
        if s.nodes
        else f"allocation     none held (last generation {s.generation or '-'})",
        f"attempts       {s.attempts} restart(s), {s.swaps} straggler swap(s)"
        + (f"; history continued as new {s.continued} time(s)" if s.continued else ""),
        f"progress       step {of_total(step_of(view), s.total_steps)}"
        f"  loss {_num(loss_of(view), '.4f')}"
        f"  tokens/s {_num(beat.tokens_per_s if beat else s.tokens_per_s, ',.0f')}"
        f"  MFU {_num(beat.mfu if beat else s.mfu, '.2%')}",
    ]
    if s.suspect_nodes:
        lines.append(f"keeps off      {', '.join(s.suspect_nodes)}: its ranks reported them")
    if s.shrunk_from and s.nodes:
        lines.insert(3, f"elastic        on {len(s.nodes)} of {s.shrunk_from} nodes since a "
                        "failure; grows back when the cluster has nodes free")  # fmt: skip
    reported = beat.checkpoint_step if beat else None
    if s.last_checkpoint and (reported is None or reported <= s.last_checkpoint.step):
        c = s.last_checkpoint
        tier = "peer tier, " if c.tier == "peer" else ""  # its files are on the nodes
        lines.append(
            f"checkpoint     step {c.step} ({tier}generation {c.generation}, "
            f"{c.tokens_seen:,} tokens)  {c.manifest_key}"
        )
    elif reported is not None:
        # Newer than the workflow's record: the ranks committed it since the gang started.
        lines.append(
            f"checkpoint     step {reported} (generation {s.generation}, reported by the ranks)"
        )
    else:
        lines.append("checkpoint     none committed yet")
    for why in s.skipped_checkpoints:
        lines.append(f"skipped        {why}")
    if s.init_from:
        lines.append(f"init from      step {s.init_from.step} of {s.init_from.manifest_key}")
    if s.dataset:
        d = s.dataset
        lines.append(
            f"dataset        {d.snapshot_id}  {d.documents:,} documents read, "
            f"{d.filtered:,} filtered, {d.duplicates_removed:,} duplicates removed; "
            f"train {d.train_tokens:,} / val {d.val_tokens:,} tokens, vocab {d.vocab_size}"
            + ("  (reused)" if d.reused else "")
        )
    elif view.dataset is not None:
        lines.append(f"dataset        {stage_bars(view.dataset)}")
    if s.evaluation:
        e = s.evaluation
        lines.append(f"evaluation     {evaluation_line(e)}")
        if len(e.curve) > 1:
            points = ", ".join(f"{p.step}: {p.val_loss:.3f}" for p in e.curve)
            lines.append(f"val curve      {points}")
        for note in e.curve_left_out:
            lines.append(f"val curve      left out {note}")
        for sample in e.samples or [Sample(prompt="", text=e.sample)]:
            if not sample.text.strip():  # a user's run: samples are its own serving's business
                continue
            text = textwrap.indent(sample.text.strip(), " " * 15).lstrip()
            lines.append(f"sample         {text}")
    if s.model_version:
        mv = s.model_version
        lines.append(f"model          {mv.model_name} version {mv.version} (alias {mv.alias})")
        lines.append(
            f"               {settings.mlflow_uri}/#/models/{mv.model_name}/versions/{mv.version}"
        )
    lines += approval_lines(s)
    if (earlier := s.preemptions_total - len(s.preemptions)) > 0:
        lines.append(f"preempted      {s.preemptions_total} times, the {earlier} earliest unlisted")
    for preempted in s.preemptions:
        where = f" at step {preempted.step}" if preempted.step is not None else ""
        lines.append(
            f"preempted      gen {preempted.generation} at {preempted.at:%H:%M:%S}{where}: "
            f"{preempted.reason}"
        )
    if (earlier := s.failures_total - len(s.failures)) > 0:
        lines.append(f"failure        {s.failures_total} in all, the {earlier} earliest unlisted")
    for failure in s.failures:
        # The first line says what and where; log tails stay in the Temporal UI's history.
        reason = failure.reason.splitlines()[0] if failure.reason else ""
        lines.append(f"failure        gen {failure.generation} at {failure.at:%H:%M:%S}: {reason}")
    for event in s.health:
        lines.append(
            f"health         gen {event.generation} step {event.step}: {event.kind} on "
            f"{event.node_id or '?'} ({event.action}): {event.evidence}"
        )
    if s.goodput:
        lines += goodput_lines(s.goodput)
    if s.error:
        lines.append(f"error          {s.error}")
    for retry in view.retrying:
        lines.append(f"retrying       {retry}")
    lines.append(f"temporal       {run_link(settings, s.name)}")
    return "\n".join(lines)


def evaluation_line(e: EvalResult) -> str:
    """The final evaluation in one line: the loss, what it was measured on, and by whom."""
    if e.val_loss is None or e.perplexity is None:
        return (
            f"none at step {e.step}: the script reports no loss (forgeline.report(step, "
            "loss=...) would give one)"
        )
    # A script's own evaluation may not say how many tokens it read.
    on = f"on {e.val_tokens:,} tokens " if e.val_tokens else ""
    measured = (
        f"{on}at step {e.step}"
        if e.measured_on == "held-out"
        else f"the last training loss, step {e.step}: the script reports no held-out loss"
    )
    if e.self_reported:
        measured += f" ({SELF_REPORTED})"
    return f"val_loss {e.val_loss:.4f}  perplexity {e.perplexity:.2f}  {measured}"


def approval_lines(s: RunStatus) -> list[str]:
    """Who may decide and by when, the eval gate, and the decision once there is one."""
    lines = []
    policy = s.approval
    if policy is not None and s.phase == Phase.AWAITING_APPROVAL:
        who = ", ".join(policy.approvers) if policy.approvers else "anyone"
        if not policy.allow_self_approval:
            who += f" (not {s.owner}, who submitted it)"
        lines.append(f"approvers      {who}  (rules: {policy.source})")
        if policy.max_val_loss is not None:
            passed = gate_passed(policy, s.evaluation)
            verdict = "passes" if passed else "FAILS: approval needs --override-gate and a --note"
            lines.append(f"eval gate      val_loss <= {policy.max_val_loss:g}: {verdict}")
        reported = s.evaluation.val_loss if s.evaluation is not None else None
        if reported is not None and s.evaluation is not None and s.evaluation.self_reported:
            # What the approver decides on: a number nothing of Forgeline's measured.
            lines.append(
                f"eval source    val_loss {reported:.4f} is {SELF_REPORTED}, "
                "not measured by Forgeline: check the run's code before you trust it"
            )
        if s.approval_deadline is not None:
            lines.append(f"expires        {s.approval_deadline:%Y-%m-%d %H:%M:%S %Z}")
    if s.phase == Phase.EXPIRED:
        lines.append("decision       none: the approval window closed (version tagged expired)")
    if s.decision:
        verb = "approved" if s.decision.approve else "rejected"
        if s.decision.override_gate:
            verb += " overriding the eval gate"
        lines.append(f"decision       {verb} by {s.decision.approver} {s.decision.reason}".rstrip())
    return lines


def goodput_lines(goodput: Goodput) -> list[str]:
    """The goodput line, then the GPU-seconds by cause, largest first."""
    total = goodput.gpu_s or 1.0
    lines = [
        f"goodput        {goodput.goodput:.1%} of {goodput.gpu_s:,.0f} GPU-s "
        f"({goodput.allocated_goodput:.1%} of the {goodput.allocated_gpu_s:,.0f} allocated) "
        f"over {goodput.attempts} attempt(s)",
    ]
    lost = sorted(goodput.lost_gpu_s.items(), key=lambda item: -item[1])
    for cause, gpu_s in [("productive", goodput.productive_gpu_s), *lost]:
        lines.append(f"  {cause:<17}{gpu_s:>9,.1f} GPU-s {gpu_s / total:>6.1%}")
    return lines


def run_link(settings: Settings, name: str) -> str:
    return f"{settings.temporal_ui_url}/namespaces/{settings.temporal_namespace}/workflows/{name}"
