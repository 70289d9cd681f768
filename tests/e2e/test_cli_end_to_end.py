"""The README's promises, end to end on the real stack: Temporal dev server, MLflow server,
a control worker and three node agents, each a real process; training in real torchrun ranks."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from mlflow.tracking import MlflowClient

from infra import mlflow_login
from infra.local_servers import temporal_binary
from registry.names import EXPERIMENT
from tests.conftest import REPO
from tests.e2e.conftest import (
    TINY,
    Stack,
    final_weights,
    flip_a_byte,
    ranks_of,
    variant,
    wait_for,
)
from trainer.attempt_clock import read_ledger
from trainer.manifest import committed_steps, find_latest
from worker.cli_common import ExitCode

BAD_INPUT, NOT_FOUND, REFUSED = ExitCode.BAD_INPUT, ExitCode.NOT_FOUND, ExitCode.REFUSED

pytestmark = pytest.mark.e2e


APPROVALS = """
[teams.default]
approvers = ["carol"]

[models.tiny]
approvers = ["bob"]
max_val_loss = 1.0   # tiny does not get there in 60 steps: approving it needs an override
"""


def test_run_to_approval_and_the_registered_model(stack: Stack, tmp_path: Path) -> None:
    rules = tmp_path / "approvals.toml"
    rules.write_text(APPROVALS)
    installed = stack.cli("approvals", "apply", str(rules)).stdout
    assert re.search(r"model tiny +approvers bob; gate val_loss <= 1", installed), installed
    submitted = stack.cli("run", str(TINY), "--detach")
    assert "submitted run tiny" in submitted.stdout

    # Submitting the same name again attaches to the run and follows it to the approval gate:
    # at once, while the approval below is tried, so that it sees the run train (attached a
    # CLI call later, it once found the 60 steps already done).
    with ThreadPoolExecutor(1) as follower:
        following = follower.submit(stack.cli, "run", str(TINY))
        # Approving before there is a model is refused with a reason, not a traceback.
        bob, dave = ("bob", "approve:default"), ("dave", "approve:model:tiny")
        early = stack.cli("approve", "tiny", check=False, as_person=bob)
        assert early.returncode == REFUSED and "only a run AWAITING_APPROVAL" in early.stdout
        followed = following.result()
    assert "run tiny exists with this spec: attaching to it" in followed.stdout
    assert "AWAITING_APPROVAL" in followed.stdout and "model tiny v1" in followed.stdout
    assert re.search(r"TRAINING +step \d+/60 +loss \d", followed.stdout)

    table = stack.cli("runs").stdout
    assert re.search(r"tiny .*AWAITING_APPROVAL .*60/60", table)
    status = stack.cli("status", "tiny").stdout
    assert "checkpoint     step 60 (generation" in status
    assert re.search(r"runs/tiny/checkpoints/step-60/gen-\d+/MANIFEST.json", status)
    val_loss = float(re.search(r"val_loss (\d+\.\d+)", status).group(1))
    assert val_loss < 3.5  # from ln(67) ≈ 4.2 at initialisation

    me = stack.me  # the local user, the stack's admin, submitted it
    assert re.search(rf"^approvers +bob, carol \(not {me}, who submitted it\)", status, re.M)
    assert re.search(r"^eval gate +val_loss <= 1: FAILS", status, re.M), status
    # The submitter (an admin, even), someone not listed, someone without the role and a
    # listed approver below the gate are all refused; who they are is their token's person.
    for who, extra, why in [
        (None, [], f"{me} submitted run tiny and may not approve it"),
        (("mallory", "approve:*"), [], "mallory may not approve run tiny: approvers are bob"),
        (("carol", "read"), [], "carol may not decide on the models of team 'default'"),
        (bob, ["--note", "looks right"], "fails its eval gate"),
    ]:
        refused = stack.cli("approve", "tiny", *extra, check=False, as_person=who)
        assert refused.returncode == REFUSED and why in refused.stdout, (who, refused.stdout)
    # The rules are read when someone decides: new rules count for a model already waiting.
    rules.write_text('[models.tiny]\napprovers = ["dave"]\nmax_val_loss = 1.0\n')
    stack.cli("approvals", "apply", str(rules))
    removed = stack.cli(
        "approve", "tiny", "--override-gate", "--note", "x", check=False, as_person=bob
    )
    assert "bob may not approve run tiny: approvers are dave" in removed.stdout, removed.stdout
    approved = stack.cli(
        "approve", "tiny", "--override-gate", "--note", "looks right", as_person=dave
    )
    assert "run tiny: APPROVED" in approved.stdout

    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    production = client.get_model_version_by_alias("tiny", "production")
    candidate = client.get_model_version_by_alias("tiny", "candidate")
    assert production.version == candidate.version == "1"
    mlflow_writes_only_from_forgeline(stack, "tiny")
    tags = production.tags
    assert (
        tags["forgeline.decided_by"] == "dave"
        and tags["forgeline.decision_reason"] == "looks right"
    )
    assert re.fullmatch(
        r"runs/tiny/checkpoints/step-60/gen-\d+/MANIFEST.json",
        tags["forgeline.checkpoint_manifest_key"],
    )
    assert tags["forgeline.temporal_workflow_id"] == "tiny"
    assert len(tags["forgeline.spec_sha256"]) == 64 and len(tags["forgeline.git_commit"]) >= 7
    store = stack.store()
    manifest = json.loads(store.get_bytes(tags["forgeline.dataset_manifest_key"]))
    assert manifest["snapshot_id"] == tags["forgeline.dataset_snapshot"]
    assert float(tags["forgeline.val_loss"]) == pytest.approx(val_loss, abs=1e-4)
    assert tags["forgeline.eval_source"] == "platform"  # measured by Forgeline, not the run
    assert tags["forgeline.gate"] == "overridden" and tags["forgeline.gate_max_val_loss"] == "1"
    assert len(tags["forgeline.packages_sha256"]) == 64
    # One MLflow run from start to registration: the ranks' metrics streamed in while they
    # trained, the dataset snapshot is its input, the val-loss curve covers the kept checkpoints.
    run = client.get_run(production.run_id)
    streamed = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step for m in streamed} >= {5, 30, 60}, streamed
    assert client.get_metric_history(run.info.run_id, "train/tokens_per_s")
    shares = client.get_metric_history(run.info.run_id, "train/sdk_share")
    assert shares and all(0 < m.value < 1 for m in shares), shares
    curve = client.get_metric_history(run.info.run_id, "val_loss_by_checkpoint")
    assert sorted(m.step for m in curve) == [40, 60]
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == f"snapshot-{tags['forgeline.dataset_snapshot']}"
    # Filterable in the Temporal UI by team, model and phase.
    query = 'ForgelineTeam="default" AND ForgelineModel="tiny" AND ForgelinePhase="APPROVED"'
    listed = subprocess.run(
        [temporal_binary(), "workflow", "list", "--address", stack.settings.temporal_address,
         "--query", query],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert re.search(r"^\s*\S+\s+tiny\s", listed.stdout, re.M), listed
    # keep_checkpoints = 2: older checkpoints are gone, files and all, once newer ones commit.
    assert committed_steps(store, "tiny") == [60, 40]
    assert store.list("runs/tiny/checkpoints/step-20/") == []
    assert ranks_of(stack.home, "tiny") == []

    # Lineage: the version back to its checkpoint, data, code and history, hashes checked now.
    lineage = stack.cli("lineage", "tiny", "@production").stdout
    expected_lines = [
        r"^version +tiny v1 \(aliases: .*production.*\); approved by dave",
        r"^checkpoint +runs/tiny/checkpoints/step-60/gen-\d+/MANIFEST.json: step 60, "
        r".*\[verified\]",
        rf"^dataset +snapshot {tags['forgeline.dataset_snapshot']} from .*tinyshakespeare.txt: "
        r"[\d,]+ documents read, .*\[verified\]",
    ]
    for line in expected_lines:
        assert re.search(line, lineage, re.M), (line, lineage)
    assert re.search(rf"^code +git {tags['forgeline.git_commit']}", lineage, re.M), lineage
    assert f"/workflows/tiny/{tags['forgeline.temporal_run_id']}" in lineage
    checkpoint = json.loads(store.get_bytes(tags["forgeline.checkpoint_manifest_key"]))
    shard = checkpoint["files"][0]["key"]
    original = flip_a_byte(store, shard)
    try:
        broken = stack.cli("lineage", "tiny", "1", check=False)
        assert broken.returncode == 1 and "[BROKEN: checkpoint file" in broken.stdout
    finally:
        store.put_bytes(shard, original)

    # Pictures of how it went, on disk and in the MLflow run; the approved model answers.
    out = tmp_path / "report"
    printed = stack.cli("report", "tiny", "--out", str(out)).stdout
    for name in ("loss.png", "throughput.png", "goodput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", printed
    summary = (out / "report.md").read_text()
    assert f"{val_loss:.4f}" in summary and "goodput" in summary.lower(), summary
    logged = {a.path for a in client.list_artifacts(production.run_id, "report")}
    assert "report/goodput.png" in logged and "report/report.md" in logged, logged
    generated = stack.cli("generate", "tiny@production", "ROMEO:", "--max-new-tokens", "20")
    assert generated.stdout.startswith("ROMEO:") and len(generated.stdout.strip()) > 6


def mlflow_writes_only_from_forgeline(stack: Stack, model: str) -> None:
    """The stack's MLflow: nobody who merely reaches its port moves an alias (401), and the UI's
    read-only viewer browses the model but cannot move it either (403)."""
    login = mlflow_login.read(stack.home)
    assert login is not None and login.uri == stack.settings.mlflow_uri
    api = f"{login.uri}/api/2.0/mlflow/registered-models"
    move = {"name": model, "alias": "production", "version": "1"}
    assert requests.post(f"{api}/alias", json=move, timeout=30).status_code == 401
    viewer = (mlflow_login.VIEWER, login.viewer_password)
    assert requests.post(f"{api}/alias", json=move, auth=viewer, timeout=30).status_code == 403
    browsed = requests.get(f"{api}/get", params={"name": model}, auth=viewer, timeout=30)
    assert browsed.ok and browsed.json()["registered_model"]["name"] == model, browsed.text


def test_cancel_stops_the_ranks_and_releases_the_gang(stack: Stack, tmp_path: Path) -> None:
    spec = variant(tmp_path, "tiny-cancel", steps=100000, checkpoint_every=1000)
    stack.cli("run", str(spec), "--detach")
    wait_for(lambda: ranks_of(stack.home, "tiny-cancel"), 120, "ranks to start")
    cancelled = stack.cli("cancel", "tiny-cancel")
    assert "run tiny-cancel: CANCELLED" in cancelled.stdout
    wait_for(lambda: not ranks_of(stack.home, "tiny-cancel"), 30, "ranks to stop")
    nodes_table = stack.cli("nodes").stdout
    assert "tiny-cancel" not in nodes_table and "allocated" not in nodes_table, nodes_table
    again = stack.cli("cancel", "tiny-cancel", check=False)
    assert again.returncode == REFUSED and "is not running" in again.stdout
    # Its MLflow run (opened while the data was prepared) ends with it, not RUNNING forever.
    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None

    def mlflow_status() -> str | None:
        found = client.search_runs(
            [experiment.experiment_id], "attributes.run_name = 'tiny-cancel'", max_results=1
        )
        return found[0].info.status if found and found[0].info.status != "RUNNING" else None

    assert wait_for(mlflow_status, 30, "the MLflow run to end") == "KILLED"


# With the slow tests, to keep `make test` within 15 minutes (a clean clone took 950 s): resume
# is covered faster by tests/workflows/test_training_run_history.py (a run resumed as
# submitted, on the dev server) and tests/trainer's exact-resume tests; who may resume is
# checked here alone, in CI's slow phase.
@pytest.mark.slow
def test_a_cancelled_run_resumes_from_its_last_checkpoint(stack: Stack, tmp_path: Path) -> None:
    spec = variant(tmp_path, "tiny-resume", steps=1200, checkpoint_every=100)
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    wait_for(lambda: committed_steps(store, "tiny-resume"), 120, "a checkpoint", 0.25)
    stack.cli("cancel", "tiny-resume")
    kept = committed_steps(store, "tiny-resume")[0]
    assert kept < 1200, kept
    someone = stack.cli("resume", "tiny-resume", check=False, as_person=("eve", "submit:*"))
    assert someone.returncode == REFUSED and "only they or an operator" in someone.stdout
    resumed = stack.cli("resume", "tiny-resume", timeout=300)
    assert "resumed run tiny-resume" in resumed.stdout, resumed.stdout
    assert re.search(rf"TRAINING +step {kept}/1200 .* ckpt {kept}", resumed.stdout), resumed.stdout
    assert "AWAITING_APPROVAL" in resumed.stdout, resumed.stdout
    again = stack.cli("resume", "tiny-resume", check=False)
    assert again.returncode == REFUSED and "reject (or approve) its model first" in again.stdout
    final = find_latest(store, "tiny-resume", max_generation=10**9)
    assert final is not None and final.step == 1200
    # One loss curve across both executions: the second began where the first's checkpoint was.
    steps = [s for s, _ in final.manifest.loss_history]
    assert steps == sorted(set(steps)) and steps[-1] == 1200 and steps[0] <= kept, steps[:3]

    # A finished run goes back to a step it keeps (keep_checkpoints = 2: 1100 and 1200) and
    # trains on from there, exactly: the same weights at step 1200 again.
    stack.cli("reject", "tiny-resume", "--reason", "to train it again from step 1100")
    finished = final_weights(stack, "tiny-resume", tmp_path / "finished")
    plain = stack.cli("resume", "tiny-resume", check=False)
    assert plain.returncode == REFUSED and "from a step it keeps (--from STEP)" in plain.stdout
    missing = stack.cli("resume", "tiny-resume", "--from", "1150", check=False)
    assert missing.returncode == BAD_INPUT, missing.stdout
    assert "keeps no checkpoint at step 1150: it keeps 1100, 1200" in missing.stdout
    again = stack.cli("resume", "tiny-resume", "--from", "1100", timeout=300)
    assert "trains on from step 1100" in again.stdout and "AWAITING_APPROVAL" in again.stdout
    retrained = final_weights(stack, "tiny-resume", tmp_path / "retrained")
    assert all(torch.equal(retrained[k], finished[k]) for k in finished)
    newest = find_latest(store, "tiny-resume", max_generation=10**9)
    assert newest is not None and newest.generation > final.generation  # trained again...
    ledger = read_ledger(store, "tiny-resume", newest.generation)
    assert ledger is not None and ledger.resume_step == 1100  # ...from step 1100
    # On fewer nodes: the checkpoint reshards from two ranks to one.
    stack.cli("reject", "tiny-resume", "--reason", "once more, on one node")
    smaller = stack.cli("resume", "tiny-resume", "--from", "1100", "--nodes", "1", timeout=300)
    assert "from step 1100 on 1 node" in smaller.stdout, smaller.stdout
    assert "AWAITING_APPROVAL" in smaller.stdout, smaller.stdout
    status = stack.cli("status", "tiny-resume").stdout
    assert re.search(r"checkpoint +step 1200 \(generation \d+,", status), status
    resized = find_latest(store, "tiny-resume", max_generation=10**9)
    assert resized is not None and resized.manifest.world_size == 1, resized
    # The same global batch (batch_size is all ranks together's): the curve goes on.
    loss = dict(resized.manifest.loss_history)
    before = dict(final.manifest.loss_history)
    assert abs(loss[1200] - before[1200]) < 0.05 * before[1200], (loss[1200], before[1200])


def test_cancel_while_queued_withdraws_the_request(stack: Stack, tmp_path: Path) -> None:
    spec = variant(tmp_path, "too-big", nodes=4)  # the stack has 3 nodes
    stack.cli("run", str(spec), "--detach")
    never = "more than the cluster's schedulable nodes can ever give"
    wait_for(lambda: never in stack.cli("jobs").stdout, 60, "the reason it waits")
    assert re.search(r"too-big +│ default +│ 4 +│ 0 +│ waiting +│ 1 ", stack.cli("jobs").stdout)
    assert "QUEUED" in stack.cli("status", "too-big").stdout
    stack.cli("cancel", "too-big")
    assert "too-big" not in stack.cli("jobs").stdout


def test_bad_input_gets_one_clear_line(stack: Stack, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "Bad Name"\n[data]\nsources = ["x.txt"]\n[train]\nsteps = -1\n')
    result = stack.cli("run", str(bad), check=False)
    assert result.returncode == BAD_INPUT
    assert "name: 'Bad Name' is not a valid name" in result.stdout
    assert "train.steps: Input should be greater than or equal to 1" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    missing = stack.cli("status", "no-such-run", check=False)
    assert missing.returncode == NOT_FOUND and "no run named 'no-such-run'" in missing.stdout


# Covered faster by tests/workflows/test_cluster_workflow.py (reclaim, grace, requeue) and
# tests/trainer/test_layouts.py (SIGTERM: the step finishes, commits, stops).
@pytest.mark.slow
def test_a_team_reclaims_its_guarantee_and_the_victim_resumes_exactly(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    """vision borrows two of the three nodes; nlp (guaranteed 2) needs two: the borrower
    checkpoints, gives them back, waits, and later finishes with the losses it would have had."""
    # The example's teams, without its preemption shield and reclaim patience: the borrower is
    # granted seconds before the owner asks, a shielded gang is no victim for its first hour,
    # and the owner would wait 15 min for nodes to free on their own.
    teams = tmp_path / "cluster.toml"
    example = (REPO / "examples" / "cluster.toml").read_text()
    for key in ("preemption_shield_s", "reclaim_after_s"):
        example = re.sub(rf"(?m)^{key} = \d+", f"{key} = 0", example)
        assert f"{key} = 0" in example
    teams.write_text(example)
    stack.cli("cluster", "apply", str(teams))
    try:
        store = stack.store()
        borrower = variant(tmp_path, "borrower", team="vision", steps=300, checkpoint_every=100)
        stack.cli("run", str(borrower), "--detach")
        wait_for(lambda: "TRAINING" in stack.cli("status", "borrower").stdout, 60, "borrower")
        wait_for(
            lambda: (stack.home / "nodes").glob("*/runs/borrower/gen-*/progress.jsonl"), 60, "ranks"
        )
        queues = stack.cli("queues").stdout
        assert re.search(r"vision +│ research +│ +0 │ +3 │ +2 │ +2 │", queues), queues

        owner = variant(tmp_path, "owner", team="nlp")
        stack.cli("run", str(owner), "--detach")
        wait_for(
            lambda: "preempted      gen" in stack.cli("status", "borrower").stdout,
            120,
            "preemption",
        )
        status = stack.cli("status", "borrower").stdout
        assert "owner (team nlp) reclaims its guarantee" in status
        step = int(re.search(r"preempted +gen \d+ at [\d:]+ at step (\d+)", status).group(1))
        assert step in committed_steps(store, "borrower")  # it checkpointed where it stopped

        assert "AWAITING_APPROVAL" in stack.cli("run", str(owner)).stdout
        assert "AWAITING_APPROVAL" in stack.cli("run", str(borrower), timeout=300).stdout
        final = find_latest(store, "borrower", max_generation=10**9)
        expected = find_latest(store, reference, max_generation=10**9)
        assert final is not None and expected is not None
        assert final.manifest.loss_history == expected.manifest.loss_history
        weights, theirs = (
            final_weights(stack, "borrower", tmp_path),
            final_weights(stack, reference, tmp_path),
        )
        assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
        assert re.search(r"attempts +0 restart", stack.cli("status", "borrower").stdout)
    finally:
        default = tmp_path / "default.toml"
        default.write_text("")
        stack.cli("cluster", "apply", str(default))
