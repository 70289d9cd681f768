"""The approval gate's rules: who may decide what, and when. Pure: the TrainingRun workflow's
update validator calls it, and a refusal reaches the person as one line.

The rules come from two places: the operators' approvals file (who may approve, whether the
submitter may approve their own model, a quality bar), read once when the model is registered,
and the run's spec, which may only make the bar stricter.
"""

from __future__ import annotations

from workflows.contracts.models import (
    SELF_REPORTED,
    ApprovalPolicy,
    Decision,
    EvalResult,
    Phase,
    RunStatus,
)
from workflows.contracts.spec import RunSpec


def with_spec(policy: ApprovalPolicy, spec: RunSpec) -> ApprovalPolicy:
    """The operators' rules, with the spec's own eval gate where it is stricter."""
    bars = [b for b in (policy.max_val_loss, spec.registry.max_val_loss) if b is not None]
    source = policy.source
    if spec.registry.max_val_loss is not None:
        source = f"{source}; spec registry.max_val_loss" if source else "spec"
    return policy.model_copy(update={"max_val_loss": min(bars, default=None), "source": source})


def gate_passed(policy: ApprovalPolicy, evaluation: EvalResult | None) -> bool:
    if policy.max_val_loss is None:
        return True
    loss = evaluation.val_loss if evaluation is not None else None
    return loss is not None and loss <= policy.max_val_loss


def gate_tags(policy: ApprovalPolicy, evaluation: EvalResult | None, decision: Decision) -> dict:
    """What the version records of the gate beside the decision."""
    if policy.max_val_loss is None:
        return {"forgeline.gate": "none"}
    passed = gate_passed(policy, evaluation)
    verdict = "passed" if passed else ("overridden" if decision.override_gate else "failed")
    return {"forgeline.gate": verdict, "forgeline.gate_max_val_loss": f"{policy.max_val_loss:g}"}


def refusal(status: RunStatus, decided: bool, decision: Decision, rules: bool = True) -> str | None:
    """Why this decision cannot be taken now, or None when it can. `rules=False` checks only
    what does not depend on the operators' rules (the update's validator: the rules are read
    afresh in the handler, so an approver added while the model waited counts)."""
    if status.phase != Phase.AWAITING_APPROVAL:
        return (
            f"run {status.name} is {status.phase.value}, not AWAITING_APPROVAL: "
            "only a run AWAITING_APPROVAL can be approved or rejected"
        )
    if decided:
        return f"run {status.name} already has a decision"
    if not decision.approve and not decision.reason.strip():
        return "a rejection needs a reason: pass --reason"
    if decision.override_gate and not decision.reason.strip():
        return "overriding the eval gate needs a reason: pass --note"
    policy = status.approval
    if policy is None or not rules:  # None: a run registered before approval rules existed
        return None
    return _not_authorised(status, policy, decision) or _gate_refusal(status, policy, decision)


def _not_authorised(status: RunStatus, policy: ApprovalPolicy, decision: Decision) -> str | None:
    who = decision.approver
    if who == status.owner:
        # Withdrawing your own model is always allowed; approving it needs a second person.
        if decision.approve and not policy.allow_self_approval:
            return (
                f"{who} submitted run {status.name} and may not approve it: a second person "
                f"must ({_listed(policy)}; self-approval is off in {policy.source})"
            )
        return None
    if policy.approvers and who not in policy.approvers:
        verb = "approve" if decision.approve else "reject"
        return (
            f"{who} may not {verb} run {status.name}: {_listed(policy)} ({policy.source}); "
            "an operator adds approvers with `forgeline approvals apply FILE`"
        )
    return None


def _gate_refusal(status: RunStatus, policy: ApprovalPolicy, decision: Decision) -> str | None:
    if not decision.approve or gate_passed(policy, status.evaluation):
        return None
    measured = measured_loss(status.evaluation)
    if not decision.override_gate:
        return (
            f"run {status.name} fails its eval gate: {measured}, the gate is at most "
            f"{policy.max_val_loss:g} ({policy.source}); to approve anyway pass --override-gate "
            "with --note saying why"
        )
    return None


def measured_loss(evaluation: EvalResult | None) -> str:
    """The eval loss as the gate judged it, saying so when the run's script reported it: the
    approver should know that no measurement of Forgeline's backs it."""
    if evaluation is None:
        return "no evaluation"
    if evaluation.val_loss is None:
        return "no loss: the run's script reported none (it may call forgeline.report)"
    loss = f"val loss {evaluation.val_loss:.4f}"
    return f"{loss} ({SELF_REPORTED})" if evaluation.self_reported else loss


def _listed(policy: ApprovalPolicy) -> str:
    if not policy.approvers:
        return "anyone else may approve"
    return "approvers are " + ", ".join(policy.approvers)
