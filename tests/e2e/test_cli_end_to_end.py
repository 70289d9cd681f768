"""The README's promises, end to end on the real stack: Temporal dev server, MLflow server,
a control worker and three node agents, each a real process; training in real torchrun ranks."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from infra.store import LocalStore
from tests.conftest import REPO
from tests.e2e.conftest import Stack, ranks_of
from trainer.manifest import Fences, committed_steps, find_latest, manifest_key

pytestmark = pytest.mark.e2e
TINY = REPO / "examples" / "tiny.toml"


def variant(tmp_path: Path, name: str, team: str | None = None, **train: int) -> Path:
    """examples/tiny.toml under another name, with other [train] values (and a team)."""
    text = TINY.read_text().replace('name = "tiny"', f'name = "{name}"')
    if team is not None:
        text = text.replace("[resources]\n", f'[resources]\nteam = "{team}"\n')
    text = text.replace(
        '"data/tinyshakespeare.txt"', f'"{REPO / "examples" / "data" / "tinyshakespeare.txt"}"'
    )
    for key, value in train.items():
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def wait_for(check, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_run_to_approval_and_the_registered_model(stack: Stack) -> None:
    submitted = stack.cli("run", str(TINY), "--detach")
    assert "submitted run tiny" in submitted.stdout

    # Approving before there is a model is refused with a reason, not a traceback.
    early = stack.cli("approve", "tiny", "--as", "bob", check=False)
    assert early.returncode == 2 and "only a run AWAITING_APPROVAL" in early.stdout

    # Submitting the same name again attaches to the run and follows it to the approval gate.
    followed = stack.cli("run", str(TINY))
    assert "run tiny exists: attaching to it" in followed.stdout
    assert "AWAITING_APPROVAL" in followed.stdout and "model tiny v1" in followed.stdout
    assert re.search(r"TRAINING +step \d+/60 +loss \d", followed.stdout)

    table = stack.cli("runs").stdout
    assert re.search(r"tiny .*AWAITING_APPROVAL .*60/60", table)
    status = stack.cli("status", "tiny").stdout
    assert "checkpoint     step 60 (generation" in status
    assert "runs/tiny/checkpoints/step-60/MANIFEST.json" in status
    val_loss = float(re.search(r"val_loss (\d+\.\d+)", status).group(1))
    assert val_loss < 3.5  # from ln(67) ≈ 4.2 at initialisation

    approved = stack.cli("approve", "tiny", "--as", "bob", "--note", "looks right")
    assert "run tiny: APPROVED" in approved.stdout

    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    production = client.get_model_version_by_alias("tiny", "production")
    candidate = client.get_model_version_by_alias("tiny", "candidate")
    assert production.version == candidate.version == "1"
    tags = production.tags
    assert (
        tags["forgeline.decided_by"] == "bob" and tags["forgeline.decision_reason"] == "looks right"
    )
    assert (
        tags["forgeline.checkpoint_manifest_key"] == "runs/tiny/checkpoints/step-60/MANIFEST.json"
    )
    assert tags["forgeline.temporal_workflow_id"] == "tiny"
    assert len(tags["forgeline.spec_sha256"]) == 64 and len(tags["forgeline.git_commit"]) >= 7
    store = LocalStore(Path(stack.settings.store))
    manifest = json.loads(store.get_bytes(tags["forgeline.dataset_manifest_key"]))
    assert manifest["snapshot_id"] == tags["forgeline.dataset_snapshot"]
    assert float(tags["forgeline.val_loss"]) == pytest.approx(val_loss, abs=1e-4)
    # keep_checkpoints = 2: older checkpoints are gone, files and all, once newer ones commit.
    assert committed_steps(store, "tiny") == [60, 40]
    assert store.list("runs/tiny/checkpoints/step-20/") == []
    assert ranks_of(stack.home, "tiny") == []


def test_sigkilled_node_agent_costs_one_checkpoint_interval(stack: Stack, tmp_path: Path) -> None:
    spec = variant(tmp_path, "tiny-kill", steps=200, checkpoint_every=20)
    stack.cli("run", str(spec), "--detach")
    store = LocalStore(Path(stack.settings.store))
    wait_for(
        lambda: committed_steps(store, "tiny-kill"),
        120,
        "the first committed checkpoint",
        poll=0.05,
    )

    status = stack.cli("status", "tiny-kill").stdout
    generation, nodes = re.search(r"allocation +generation (\d+) on (.+)", status).groups()
    victim = nodes.split(", ")[0]
    victim_ranks = [p for p in ranks_of(stack.home, "tiny-kill") if _node_of(p) == victim]
    assert victim_ranks, "the victim node runs no ranks"
    stack.cli("chaos", "kill-node", victim)
    killed_at = time.time()

    # A rank never outlives its node agent.
    wait_for(
        lambda: not any(Path(f"/proc/{p}").exists() and _not_zombie(p) for p in victim_ranks),
        30,
        "the victim's ranks to exit",
    )

    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
    after = stack.cli("status", "tiny-kill").stdout
    assert re.search(r"attempts +1 restart", after)
    assert re.search(rf"failure +gen {generation} .*{victim}: .*[Hh]eartbeat", after), after

    final = find_latest(store, "tiny-kill", max_generation=10**9)
    assert final is not None and final.step == 200 and final.generation > int(generation)
    assert [s for s, _ in final.manifest["loss_history"]] == list(range(5, 201, 5))

    rejected = stack.cli("reject", "tiny-kill", "--as", "carol", "--reason", "killed on purpose")
    assert "run tiny-kill: REJECTED" in rejected.stdout
    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    version = client.get_model_version_by_alias("tiny-kill", "candidate")
    assert version.tags["forgeline.decision"] == "rejected"
    assert version.tags["forgeline.decision_reason"] == "killed on purpose"
    assert "production" not in version.aliases

    # Recovery time: SIGKILL to the first training step of the new generation.
    restarted = sorted(
        (stack.home / "nodes").glob(f"*/runs/tiny-kill/gen-{final.generation}/progress.jsonl")
    )
    first_step = min(
        json.loads(line)["time"]
        for path in restarted
        for line in path.read_text().splitlines()
        if json.loads(line)["event"] == "step"
    )
    seconds = first_step - killed_at
    print(f"\nrecovery: SIGKILL of {victim} to the first step of generation", end=" ")
    print(f"{final.generation}: {seconds:.1f} s")

    # `forgeline up` restarts the missing agent, and it comes back healthy.
    stack.cli("up", "--nodes", "3")
    nodes_table = stack.cli("nodes").stdout
    assert re.search(rf"{victim} +│ local +│ cpu +│ 0/1 +│ idle", nodes_table), nodes_table


def test_a_paused_node_that_comes_back_cannot_commit(stack: Stack, tmp_path: Path) -> None:
    """Pause a one-node run's node (SIGSTOP its agent, torchrun and ranks): the run moves to
    another node in a new generation. When the paused processes continue, the old ranks are
    fenced: they commit nothing more and stop; the run ends on the new generation's checkpoints."""
    spec = variant(tmp_path, "tiny-pause", steps=200, checkpoint_every=20, nodes=1)
    stack.cli("run", str(spec), "--detach")
    store = LocalStore(Path(stack.settings.store))
    wait_for(lambda: committed_steps(store, "tiny-pause"), 120, "the first checkpoint", 0.05)
    status = stack.cli("status", "tiny-pause").stdout
    generation, victim = re.search(r"allocation +generation (\d+) on (\S+)", status).groups()
    agent = int((stack.home / "run" / f"{victim}.pid").read_text().split()[0])
    paused = [agent, *(p for p in ranks_of(stack.home, "tiny-pause") if _node_of(p) == victim)]
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: re.search(
                rf"allocation +generation (?!{generation}\b)\d+",
                stack.cli("status", "tiny-pause").stdout,
            ),
            120,
            "a new generation on another node",
        )
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout

    old = stack.home / "nodes" / victim / "runs" / "tiny-pause" / f"gen-{generation}"
    last = json.loads((old / "progress.jsonl").read_text().splitlines()[-1])
    assert last["event"] == "stopped" and last["reason"] == "fenced", last
    fences = Fences.read(store, "tiny-pause")
    for step in committed_steps(store, "tiny-pause"):
        manifest = json.loads(store.get_bytes(manifest_key("tiny-pause", step)))
        assert fences.why_stale(manifest["generation"], step) is None, step
    final = find_latest(store, "tiny-pause", max_generation=10**9)
    assert final is not None and final.step == 200 and final.generation > int(generation)
    assert [s for s, _ in final.manifest["loss_history"]] == list(range(5, 201, 5))
    assert not ranks_of(stack.home, "tiny-pause")

    # The paused agent was reported; a new incarnation brings the node back.
    os.kill(agent, signal.SIGKILL)
    stack.cli("up", "--nodes", "3")


def test_corrupt_gradients_are_caught_and_rolled_back(stack: Stack, tmp_path: Path) -> None:
    spec = variant(tmp_path, "tiny-nan", steps=200, checkpoint_every=20)
    stack.cli("run", str(spec), "--detach")
    store = LocalStore(Path(stack.settings.store))
    wait_for(lambda: committed_steps(store, "tiny-nan"), 120, "the first checkpoint", 0.05)
    status = stack.cli("status", "tiny-nan").stdout
    node = re.search(r"allocation +generation \d+ on (\S+?),", status).group(1)
    stack.cli("chaos", "corrupt-grad", node)
    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
    after = stack.cli("status", "tiny-nan").stdout
    assert re.search(r"failure +gen \d+ .*non-finite loss or gradients at step \d+", after), after
    final = find_latest(store, "tiny-nan", max_generation=10**9)
    assert final is not None and final.step == 200
    assert [s for s, _ in final.manifest["loss_history"]] == list(range(5, 201, 5))
    assert all(math.isfinite(loss) for _, loss in final.manifest["loss_history"])


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
    assert again.returncode == 2 and "is not running" in again.stdout


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
    assert result.returncode == 2
    assert "name: 'Bad Name' is not a valid name" in result.stdout
    assert "train.steps: Input should be greater than or equal to 1" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    missing = stack.cli("status", "no-such-run", check=False)
    assert missing.returncode == 2 and "no run named 'no-such-run'" in missing.stdout


def test_a_team_reclaims_its_guarantee_and_the_victim_resumes_exactly(
    stack: Stack, tmp_path: Path
) -> None:
    """vision borrows two of the three nodes; nlp (guaranteed 2) needs two: the borrower
    checkpoints, gives them back, waits, and later finishes with the losses it would have had."""
    stack.cli("cluster", "apply", str(REPO / "examples" / "cluster.toml"))
    try:
        store = LocalStore(Path(stack.settings.store))
        reference = variant(tmp_path, "reference", steps=300, checkpoint_every=100)
        stack.cli("run", str(reference))

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
        expected = find_latest(store, "reference", max_generation=10**9)
        assert final is not None and expected is not None
        assert final.manifest["loss_history"] == expected.manifest["loss_history"]
        assert re.search(r"attempts +0 restart", stack.cli("status", "borrower").stdout)
    finally:
        default = tmp_path / "default.toml"
        default.write_text("")
        stack.cli("cluster", "apply", str(default))


def _node_of(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    match = re.search(r"/nodes/([^/]+)/runs/", argv)
    return match.group(1) if match else None


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
