"""The approval gate's rules: who may decide what, and when. Pure: the TrainingRun workflow's
update validator calls it, and a refusal reaches the person as one line."""

from __future__ import annotations

from workflows.models import Decision, Phase, RunStatus


def refusal(status: RunStatus, decided: bool, decision: Decision) -> str | None:
    """Why this decision cannot be taken now, or None when it can."""
    if status.phase != Phase.AWAITING_APPROVAL:
        return (
            f"run {status.name} is {status.phase.value}, not AWAITING_APPROVAL: "
            "only a registered model waiting for approval can be approved or rejected"
        )
    if decided:
        return f"run {status.name} already has a decision"
    if not decision.approve and not decision.reason.strip():
        return "a rejection needs a reason: pass --reason"
    return None
