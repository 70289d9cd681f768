"""Approval rules reach the gate: the API writes them where the control worker reads them.

In the shipped deployments the API and the control worker each have a state folder of their own
(Kubernetes: the control worker's is an emptyDir). Rules were written to the API's and read from
the control worker's, so the gate never saw them. Both now share the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from activities.control import ControlActivities
from forgeline import Client
from infra.settings import Settings
from infra.store.local import LocalStore
from infra.tokens import TokenStore
from registry.approvals import APPROVALS_FILE, APPROVALS_KEY, ApprovalsFile, load_approvals
from registry.errors import ApprovalsInvalid
from tests.api_server import serving_api
from worker.api_cli import _approvals_into_the_store
from workflows.contracts.models import ApprovalPolicyInput

RULES = {
    "defaults": {"allow_self_approval": False},
    "teams": {"research": {"approvers": ["bob", "carol"], "max_val_loss": 3.0}},
    "models": {"shakespeare": {"approvers": ["dave"]}},
}


def sites(tmp_path: Path) -> tuple[Settings, ControlActivities]:
    """The API's settings and the control worker's activities: two state folders, one store."""
    store = str(tmp_path / "store")
    api = Settings(home=tmp_path / "api-home", store_url=store)
    control = ControlActivities(Settings(home=tmp_path / "control-home", store_url=store))
    return api, control


def gate(control: ControlActivities) -> tuple[list[str], float | None, str]:
    policy = control.approval_policy(ApprovalPolicyInput(model_name="shakespeare", team="research"))
    return policy.approvers, policy.max_val_loss, policy.source


def test_rules_put_through_the_api_are_the_rules_the_gate_reads(tmp_path: Path) -> None:
    api, control = sites(tmp_path)
    assert gate(control) == ([], None, "no rules installed: defaults")
    admin, _ = TokenStore(api.home).create("root", ["admin"], created_by="test")
    with serving_api(api) as url:
        Client(url, admin).apply_approvals(ApprovalsFile.model_validate(RULES))
        assert Client(url, admin).approvals() == ApprovalsFile.model_validate(RULES)
    assert gate(control) == (
        ["bob", "carol", "dave"], 3.0, "approval rules: model shakespeare, team research"
    )  # fmt: skip
    assert not (control.settings.home / APPROVALS_FILE).exists()
    stored = json.loads(LocalStore(tmp_path / "store").get_bytes(APPROVALS_KEY))
    assert stored["installed_by"] == "root" and stored["format"] == "forgeline.approvals/1"


def test_rules_installed_before_in_the_api_s_folder_reach_the_gate(tmp_path: Path) -> None:
    """`forgeline api` copies the state folder's approvals.toml into the store as it starts;
    rules installed through the API since win over that copy."""
    api, control = sites(tmp_path)
    api.home.mkdir()
    (api.home / APPROVALS_FILE).write_text('[teams.research]\napprovers = ["erin"]\n')
    _approvals_into_the_store(api)
    assert gate(control)[0] == ["erin"]
    store = LocalStore(tmp_path / "store")
    (api.home / APPROVALS_FILE).write_text('[teams.research]\napprovers = ["mallory"]\n')
    assert load_approvals(store, api.home).teams["research"].approvers == ["erin"]


def test_the_api_starts_beside_rules_it_cannot_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    api, control = sites(tmp_path)
    api.home.mkdir()
    (api.home / APPROVALS_FILE).write_bytes(b"[defaults]\napprovers = ['\xff']\n")
    _approvals_into_the_store(api)  # says why, and does not raise
    assert "are not in the store yet" in capsys.readouterr().out
    assert gate(control)[2] == "no rules installed: defaults"


def test_a_rules_record_this_build_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_bytes(APPROVALS_KEY, b'{"format": "forgeline.approvals/9", "rules": {}}')
    with pytest.raises(ApprovalsInvalid, match=r"settings/approvals\.json.*approvals/9"):
        load_approvals(store)
