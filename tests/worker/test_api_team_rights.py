"""What a submitter's team may ask for and learn, decided before a run starts: a priority within
the team's allowance from the cluster file, unless an admin submits; a checkpoint to start from
of its own team's runs only; and, for a name another spec holds, the keys that differ, never
the other spec's values."""

from __future__ import annotations

import pytest

from infra.identity import Identity
from worker.api_rules import ApiError
from worker.api_team_rights import (
    conflicting_spec,
    refuse_another_team_s_run,
    refuse_priority_above_allowance,
)
from workflows.contracts.cluster_models import ClusterConfig
from workflows.contracts.spec import RunSpec

ALICE = Identity(person="alice", roles=frozenset({"submit:research"}), token_id="t-alice")
ADMIN = Identity(person="root", roles=frozenset({"admin"}), token_id="t-root")
# As `forgeline cluster apply` reads it: research may go up to 5, nlp declares nothing.
CLUSTER = ClusterConfig.model_validate(
    {"queues": [{"name": "research", "max_priority": 5}, {"name": "nlp"}]}
)


def _spec(team: str, priority: int = 0, **sections: dict) -> RunSpec:
    return RunSpec.model_validate({
        "name": "r1",
        "data": {"sources": ["/corpus.txt"]},
        "resources": {"team": team, "priority": priority},
        **sections,
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


B_CHECKPOINT = "runs/b-run/checkpoints/step-100/gen-2/MANIFEST.json"
FROM_B = {"init_from": B_CHECKPOINT}


def test_a_run_starts_from_a_checkpoint_of_its_own_team_s_runs() -> None:
    refuse_another_team_s_run(_spec("b", model=FROM_B), "b-run", "b")


@pytest.mark.parametrize(
    ("team_of_run", "whose"),
    [("b", "run 'b-run' belongs to team 'b'"), (None, "no run 'b-run' is known")],
)
def test_another_team_s_checkpoint_is_refused_at_submission(
    team_of_run: str | None, whose: str
) -> None:
    """A key was all it took to train on another team's weights; a run nobody knows is no
    run of the team's either."""
    with pytest.raises(ApiError) as refused:
        refuse_another_team_s_run(_spec("a", model=FROM_B), "b-run", team_of_run)
    detail = refused.value.detail
    assert (refused.value.status, detail.code) == (403, "forbidden")
    assert detail.field == "model.init_from"
    assert detail.message.startswith(f"model.init_from {B_CHECKPOINT!r}: {whose}; ")
    assert "a run of team 'a' may start from its own team's runs' checkpoints" in detail.message


def test_a_taken_name_is_answered_with_the_keys_that_differ_and_none_of_their_values() -> None:
    theirs = _spec("b", data={"sources": ["/secret/b-corpus.txt"]}, model={"n_layer": 24})
    mine = _spec("b", data={"sources": ["/mine.txt"]}, model={"n_layer": 2})
    conflict = conflicting_spec("r1", theirs, mine)
    detail = conflict.detail
    assert (conflict.status, detail.code, detail.field) == (409, "conflict", "data.sources")
    differs = "it differs in data.sources, model.n_layer"
    assert detail.message == f"run r1 exists with another spec: {differs}"
    assert conflicting_spec("r1", None, mine).detail.message.endswith("another spec: it differs")
