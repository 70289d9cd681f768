"""What a submitter's team may ask for, decided before a run starts: a priority within the
team's allowance from the cluster file, unless an admin submits."""

from __future__ import annotations

import pytest

from infra.identity import Identity
from worker.api_rules import ApiError
from worker.api_team_rights import refuse_priority_above_allowance
from workflows.contracts.cluster_models import ClusterConfig
from workflows.contracts.spec import RunSpec

ALICE = Identity(person="alice", roles=frozenset({"submit:research"}), token_id="t-alice")
ADMIN = Identity(person="root", roles=frozenset({"admin"}), token_id="t-root")
# As `forgeline cluster apply` reads it: research may go up to 5, nlp declares nothing.
CLUSTER = ClusterConfig.model_validate(
    {"queues": [{"name": "research", "max_priority": 5}, {"name": "nlp"}]}
)


def _spec(team: str, priority: int) -> RunSpec:
    return RunSpec.model_validate({
        "name": "r1",
        "data": {"sources": ["/corpus.txt"]},
        "resources": {"team": team, "priority": priority},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("team", "priority"), [("research", 5), ("research", -100), ("nlp", 0), ("vision", 0)]
)
def test_a_priority_within_the_team_s_allowance_is_accepted(team: str, priority: int) -> None:
    refuse_priority_above_allowance(_spec(team, priority), ALICE, CLUSTER)


@pytest.mark.parametrize(
    ("team", "priority", "allowance"), [("research", 6, 5), ("nlp", 1, 0), ("vision", 100, 0)]
)
def test_a_priority_above_the_allowance_is_refused_naming_field_allowance_and_role(
    team: str, priority: int, allowance: int
) -> None:
    """Declared or not (an undeclared team's allowance is 0), the run would jump every queue."""
    with pytest.raises(ApiError) as refused:
        refuse_priority_above_allowance(_spec(team, priority), ALICE, CLUSTER)
    assert refused.value.status == 403
    detail = refused.value.detail
    assert (detail.code, detail.field) == ("forbidden", "resources.priority")
    assert f"resources.priority = {priority}" in detail.message
    assert f"allowance of {allowance}" in detail.message and "max_priority" in detail.message
    assert "the role admin" in detail.message
    assert detail.fix is not None and f"to {allowance} or less" in detail.fix


def test_an_admin_may_submit_above_the_allowance() -> None:
    refuse_priority_above_allowance(_spec("nlp", 100), ADMIN, CLUSTER)


def test_the_allowance_defaults_to_zero_and_is_bounded() -> None:
    assert ClusterConfig.model_validate({"queues": [{"name": "a"}]}).queue("a").max_priority == 0
    with pytest.raises(ValueError, match="max_priority"):
        ClusterConfig.model_validate({"queues": [{"name": "a", "max_priority": 101}]})
