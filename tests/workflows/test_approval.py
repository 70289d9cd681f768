"""The approval gate's rules: who may decide, self-approval, the eval gate and its override,
and how the operators' approvals file and the run's spec combine."""

from __future__ import annotations

import pytest

from registry.approvals import parse_approvals, rules_for
from registry.errors import ApprovalsInvalid
from tests.conftest import REPO
from workflows.approval import gate_tags, refusal, with_spec
from workflows.contracts.models import (
    SELF_REPORTED,
    ApprovalPolicy,
    Decision,
    EvalResult,
    EvalSource,
    Phase,
    RunStatus,
)
from workflows.contracts.spec import RunSpec

APPROVALS = """
[defaults]
allow_self_approval = false

[teams.research]
approvers = ["bob", "carol"]
max_val_loss = 3.0

[models.tiny]
approvers = ["dave"]
max_val_loss = 2.5
"""


def waiting(val_loss: float = 2.0, policy: ApprovalPolicy | None = None) -> RunStatus:
    return RunStatus(
        name="tiny",
        phase=Phase.AWAITING_APPROVAL,
        owner="alice",
        total_steps=60,
        evaluation=EvalResult(
            step=60, val_loss=val_loss, perplexity=7.4, val_tokens=1000, sample="ROMEO:"
        ),
        approval=policy,
    )


def policy_for(model: str, team: str) -> ApprovalPolicy:
    rules = rules_for(parse_approvals(APPROVALS, "approvals.toml"), model, team)
    return ApprovalPolicy(
        approvers=list(rules.approvers),
        allow_self_approval=rules.allow_self_approval,
        max_val_loss=rules.max_val_loss,
        source=rules.source,
    )


def test_a_model_s_and_its_team_s_approvers_may_both_decide_and_the_strictest_gate_wins() -> None:
    policy = policy_for("tiny", "research")
    assert policy.approvers == ["bob", "carol", "dave"]
    assert policy.max_val_loss == 2.5 and not policy.allow_self_approval
    assert policy.source == "approval rules: model tiny, team research"
    other = policy_for("other", "default")  # no entry: the defaults
    assert other.approvers == [] and other.max_val_loss is None


@pytest.mark.parametrize(
    ("decision", "why"),
    [
        (Decision(approver="alice", approve=True), "alice submitted run tiny and may not approve"),
        (Decision(approver="mallory", approve=True), "mallory may not approve run tiny"),
        (
            Decision(approver="mallory", approve=False, reason="no"),
            "mallory may not reject run tiny",
        ),
        (Decision(approver="bob", approve=False), "a rejection needs a reason"),
    ],
)
def test_who_may_not_decide_is_told_why(decision: Decision, why: str) -> None:
    refused = refusal(waiting(policy=policy_for("tiny", "research")), False, decision)
    assert refused is not None and why in refused


def test_listed_approvers_decide_and_the_submitter_may_withdraw() -> None:
    status = waiting(policy=policy_for("tiny", "research"))
    assert refusal(status, False, Decision(approver="dave", approve=True)) is None
    assert refusal(status, False, Decision(approver="carol", approve=False, reason="x")) is None
    assert refusal(status, False, Decision(approver="alice", approve=False, reason="x")) is None
    assert "already has a decision" in refusal(
        status, True, Decision(approver="dave", approve=True)
    )


def test_with_no_list_anyone_but_the_submitter_may_approve() -> None:
    status = waiting(policy=policy_for("other", "default"))
    assert refusal(status, False, Decision(approver="zoe", approve=True)) is None
    assert refusal(status, False, Decision(approver="alice", approve=True)) is not None
    selfish = ApprovalPolicy(allow_self_approval=True, source="approvals.toml: team x")
    assert refusal(waiting(policy=selfish), False, Decision(approver="alice", approve=True)) is None


def test_the_gate_says_when_the_loss_it_judges_was_reported_by_the_run_s_script() -> None:
    """A user's script reports its own eval loss: the gate still judges it, and says whose
    number it is, so nobody takes it for one Forgeline measured."""
    policy = policy_for("tiny", "research")
    plain = Decision(approver="dave", approve=True)
    measured = waiting(val_loss=2.71, policy=policy)
    assert measured.evaluation is not None
    measured.evaluation.source = EvalSource.PLATFORM
    refused = refusal(measured, False, plain)
    assert refused is not None and "val loss 2.7100, the gate" in refused
    assert SELF_REPORTED not in refused
    scripted = waiting(val_loss=2.71, policy=policy)
    assert scripted.evaluation is not None
    scripted.evaluation.source = EvalSource.SCRIPT
    refused = refusal(scripted, False, plain)
    assert refused is not None
    assert "val loss 2.7100 (self-reported by the run's script), the gate is at most 2.5" in refused
    # An evaluation from before the source was recorded: a training loss was always a script's.
    scripted.evaluation.source = None
    scripted.evaluation.measured_on = "train"
    assert SELF_REPORTED in (refusal(scripted, False, plain) or "")


def test_the_eval_gate_refuses_approval_unless_overridden_with_a_reason() -> None:
    status = waiting(val_loss=2.71, policy=policy_for("tiny", "research"))
    plain = Decision(approver="dave", approve=True)
    refused = refusal(status, False, plain)
    assert refused is not None
    assert "val loss 2.7100, the gate is at most 2.5" in refused and "--override-gate" in refused
    bare = Decision(approver="dave", approve=True, override_gate=True)
    assert "needs a reason" in refusal(status, False, bare)
    reasoned = bare.model_copy(update={"reason": "the gate predates the new tokenizer"})
    assert refusal(status, False, reasoned) is None
    # Rejecting is never held up by the gate.
    assert refusal(status, False, Decision(approver="dave", approve=False, reason="bad")) is None
    policy = status.approval
    assert gate_tags(policy, status.evaluation, reasoned)["forgeline.gate"] == "overridden"
    assert gate_tags(policy, waiting(2.0).evaluation, plain)["forgeline.gate"] == "passed"


def test_a_spec_may_tighten_the_gate_but_not_loosen_it() -> None:
    base = policy_for("tiny", "research")  # gate 2.5
    spec = RunSpec.model_validate(
        {"name": "tiny", "data": {"sources": ["x"]}, "registry": {"max_val_loss": 2.0}}
    )
    assert with_spec(base, spec).max_val_loss == 2.0
    loose = spec.model_copy(
        update={"registry": spec.registry.model_copy(update={"max_val_loss": 9})}
    )
    assert with_spec(base, loose).max_val_loss == 2.5


def test_a_decision_before_the_model_waits_is_refused() -> None:
    status = waiting().model_copy(update={"phase": Phase.TRAINING})
    refused = refusal(status, False, Decision(approver="bob", approve=True))
    assert "only a run AWAITING_APPROVAL" in refused


def test_a_broken_approvals_file_names_the_problem() -> None:
    with pytest.raises(ApprovalsInvalid, match=r"teams.research.approvers.0: .*pattern"):
        parse_approvals('[teams.research]\napprovers = ["Bob Smith"]', "approvals.toml")
    with pytest.raises(ApprovalsInvalid, match=r"approver.*Extra inputs"):
        parse_approvals("[models.tiny]\napprover = ['bob']", "approvals.toml")
    with pytest.raises(ApprovalsInvalid, match="not valid TOML"):
        parse_approvals("[models.tiny", "approvals.toml")


def test_the_shipped_example_rules_parse() -> None:
    text = (REPO / "examples" / "approvals.toml").read_text()
    rules = rules_for(
        parse_approvals(text, "examples/approvals.toml"), "shakespeare-char", "default"
    )
    assert rules.approvers == ("bob", "carol", "dave") and rules.max_val_loss == 2.5


def test_the_validator_leaves_the_rules_to_the_handler() -> None:
    """Rules change while a model waits: the update's validator checks only what they cannot
    change; the handler reads them afresh and applies all of them."""
    status = waiting(val_loss=2.71, policy=policy_for("tiny", "research"))
    newcomer = Decision(approver="zoe", approve=True)
    assert refusal(status, False, newcomer, rules=False) is None
    assert refusal(status, False, newcomer) is not None
    bare = Decision(approver="dave", approve=True, override_gate=True)
    assert "needs a reason" in refusal(status, False, bare, rules=False)
