"""Faults on purpose, end to end on the real stack: node agents SIGKILLed, a node paused and
continued, gradients poisoned, a node slowed down. Each run must complete with the losses and
weights of a run that never failed, and say what each fault cost (goodput)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from infra.store.protocol import ObjectStore
from tests.e2e.conftest import (
    Stack,
    final_weights,
    flip_a_byte,
    node_of,
    progress_events,
    ranks_of,
    variant,
    wait_for,
)
from tests.e2e.faults import commits_of, gang_of, kill_a_node_of, latest_step
from trainer.manifest import Fences, commits, committed_steps, find_latest
from worker.cli_common import ExitCode

pytestmark = pytest.mark.e2e


def tear_the_newest_checkpoint(store: ObjectStore, run: str) -> tuple[int, int]:
    """Leave the newest checkpoint as a kill during its upload would: files, no manifest.
    Returns its step and the step of the checkpoint before it."""
    newest, previous = commits(store, run)[:2]
    store.delete(newest.key)
    return newest.step, previous.step


def first_step_of_generation_after(stack: Stack, run: str, generation: int) -> int | None:
    """Where the first generation after `generation` started training (None: not yet)."""
    folders = (stack.home / "nodes").glob(f"*/runs/{run}/gen-*")
    later = min(
        (g for g in (int(f.name.split("-")[1]) for f in folders) if g > generation), default=None
    )
    if later is None:
        return None
    events = progress_events(stack, run, later)
    return min((e["step"] for e in events if e["event"] == "started"), default=None)


def flip_a_byte_of_the_newest_checkpoint(store: ObjectStore, run: str) -> str:
    """Corrupt one shard of the newest committed checkpoint in place; its manifest's key."""
    newest = commits(store, run)[0]
    manifest = json.loads(store.get_bytes(newest.key))
    flip_a_byte(store, manifest["files"][0]["key"])
    return newest.key


# With the slow tests, to keep `make test` within 15 minutes (77 s of it): single kills and
# resume from the last checkpoint stay in `make test` (test_cli_end_to_end's cancel and resume,
# tests/trainer/test_distributed_training.py's exact resume).
@pytest.mark.slow
def test_three_sigkills_and_a_flipped_byte_change_no_weight(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    """Three node agents SIGKILLed at random steps of one run; after the second the newest
    checkpoint is left torn (files, no manifest), after the third one of its files has a byte
    flipped. The run completes: resume passes over both to the checkpoint before, the final
    weights are bitwise those of the fault-free reference, and goodput says what it all cost."""
    # A dead node's activity is given up on at its heartbeat timeout: 5 s keeps the test short.
    spec = variant(
        tmp_path, "tiny-kill", steps=300, checkpoint_every=50, max_restarts=5,
        heartbeat_timeout_s=5,
    )  # fmt: skip
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    chance = random.Random(6)
    generation = 0
    # The node is repaired and comes back while the next gang trains (one repair at a time):
    # `up` can take longer than a new gang takes to train the tiny model to its end, and the
    # next kill must find that gang training. A repair that a kill overtakes says so and exits
    # non-zero (an agent died during its start-up); the last `up` repairs what is left.
    with ThreadPoolExecutor(max_workers=1) as repairs:
        for kill in range(3):
            generation = kill_a_node_of(stack, "tiny-kill", generation, chance)
            if kill == 1:
                torn_at, torn = generation, tear_the_newest_checkpoint(store, "tiny-kill")
            if kill == 2:
                corrupted = flip_a_byte_of_the_newest_checkpoint(store, "tiny-kill")
            repairs.submit(stack.cli, "up", "--nodes", "3", check=False)
    stack.cli("up", "--nodes", "3")

    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
    status = stack.cli("status", "tiny-kill").stdout
    assert re.search(r"attempts +3 restart", status), status
    # One line per node that failed: the dead one, and the survivor whose collectives broke.
    assert len(set(re.findall(r"failure +gen (\d+) ", status))) == 3, status
    assert re.search(rf"skipped +{re.escape(corrupted)}: checkpoint file .* is corrupt", status)
    # No manifest, no checkpoint: the generation after the tear resumed from the one before.
    assert first_step_of_generation_after(stack, "tiny-kill", torn_at) == torn[1], torn
    # The survivors loaded their own shards of the checkpoint they had committed last
    # (trainer.local_copies); the store served the dead node's.
    served = [
        int(found.group(1).replace(",", ""))
        for log in (stack.home / "logs").glob("*.log")
        for found in re.finditer(r"checkpoint step \d+: ([\d,]+) of [\d,]+ bytes from this "
                                 r"node's own copies", log.read_text(errors="replace"))
    ]  # fmt: skip
    assert any(served), served

    final = find_latest(store, "tiny-kill", max_generation=10**9)
    expected = find_latest(store, reference, max_generation=10**9)
    assert final is not None and expected is not None and final.generation >= 4
    assert final.manifest.loss_history == expected.manifest.loss_history
    weights, theirs = (
        final_weights(stack, "tiny-kill", tmp_path),
        final_weights(stack, reference, tmp_path),
    )
    assert weights.keys() == theirs.keys()
    assert all(torch.equal(weights[k], theirs[k]) for k in theirs)

    # Goodput: every fault shows as rework (steps since the last checkpoint), detection and
    # restart; the productive share is what is left.
    assert re.search(r"goodput +\d+\.\d% of [\d,]+ GPU-s .* over 4 attempt", status), status
    for cause in ("productive", "restart", "rework", "failure detection", "startup"):
        assert re.search(rf"^  {cause} +[\d,.]+ GPU-s", status, re.M), (cause, status)
    print("\n" + "\n".join(line for line in status.splitlines() if "GPU-s" in line))
    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    version = client.get_model_version_by_alias("tiny-kill", "candidate")
    metrics = client.get_run(version.run_id).data.metrics
    assert 0 < metrics["goodput"] < metrics["goodput_of_allocated"] < 1
    assert metrics["gpu_seconds_lost.rework"] > 0 and metrics["gpu_seconds_productive"] > 0


# Covered faster by tests/trainer/test_fencing.py (real ranks of a superseded generation commit
# nothing and stop) and the store's fencing unit tests.
@pytest.mark.slow
def test_a_paused_node_that_comes_back_cannot_commit(stack: Stack, tmp_path: Path) -> None:
    """Pause a one-node run's node (SIGSTOP its agent, torchrun and ranks): the run moves to
    another node in a new generation. When the paused processes continue, the old ranks are
    fenced: they commit nothing more and stop; the run ends on the new generation's checkpoints."""
    spec = variant(
        tmp_path, "tiny-pause", steps=200, checkpoint_every=20, nodes=1, heartbeat_timeout_s=5
    )
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    wait_for(lambda: committed_steps(store, "tiny-pause"), 120, "the first checkpoint", 0.25)
    status = stack.cli("status", "tiny-pause").stdout
    generation, victim = re.search(r"allocation +generation (\d+) on (\S+)", status).groups()
    agent = int((stack.home / "run" / f"{victim}.pid").read_text().split()[0])
    paused = [agent, *(p for p in ranks_of(stack.home, "tiny-pause") if node_of(p) == victim)]
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        _fenced_when_it_comes_back(stack, spec, generation, victim, paused)
    finally:
        # The paused agent was reported: a new incarnation brings the node back (also when the
        # test failed, or the node would stay down for every test after this one).
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent, signal.SIGKILL)
        stack.cli("up", "--nodes", "3")


def _fenced_when_it_comes_back(
    stack: Stack, spec: Path, generation: str, victim: str, paused: list[int]
) -> None:
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

    store = stack.store()
    old = stack.home / "nodes" / victim / "runs" / "tiny-pause" / f"gen-{generation}"
    last = json.loads((old / "progress.jsonl").read_text().splitlines()[-1])
    # Fenced at its next commit, or stopped first by its agent, which finds its attempt
    # cancelled when it continues: either way it stops, and commits nothing (below).
    assert last["event"] == "stopped" and last["reason"] in ("fenced", "preempted"), last
    fences = Fences.read(store, "tiny-pause")
    for commit in commits(store, "tiny-pause"):
        manifest = json.loads(store.get_bytes(commit.key))
        assert fences.why_stale(manifest["generation"], commit.step) is None, commit
    final = find_latest(store, "tiny-pause", max_generation=10**9)
    assert final is not None and final.step == 200 and final.generation > int(generation)
    assert [s for s, _ in final.manifest.loss_history] == list(range(5, 201, 5))
    # Its processes are on their way out, not necessarily gone: the new generation can finish
    # first. Having said "stopped", the ranks exit, and their agent stops torchrun after its
    # exit grace (5 s) and kills what is left 10 s after that (trainer.launch).
    wait_for(lambda: not ranks_of(stack.home, "tiny-pause"), 30, "the paused ranks to exit")


# Covered faster, part by part: tests/trainer/test_layouts.py (real ranks: the NaN stops the
# gang, its replica is named, resume from the last manifest reproduces the clean run),
# tests/workflows/test_cluster_calls.py (the named node is reported as corruption) and
# tests/workflows/test_cluster_workflow.py (the cluster records it, and cordons it on a second
# team's report).
@pytest.mark.slow
def test_corrupt_gradients_are_traced_to_their_node_and_rolled_back(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    """A NaN in one replica's gradients before the all-reduce: the whole gang sees it, stops
    before saving, names the replica (its own norm before the all-reduce), reports its node
    (the run keeps off it) and resumes from the last checkpoint, ending with the reference's
    weights."""
    spec = variant(tmp_path, "tiny-nan", steps=300, checkpoint_every=100)
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    generation, nodes = wait_for(lambda: (gang := gang_of(stack, "tiny-nan"))[0] and gang, 120,
                                 "a gang")  # fmt: skip
    culprit = nodes[0]  # its rank is rank 0
    wait_for(lambda: any(node_of(p) == culprit for p in ranks_of(stack.home, "tiny-nan")), 60,
             "the culprit's ranks", 0.05)  # fmt: skip
    # Aimed between the checkpoints at 100 and 200 from the start: 300 tiny steps take seconds,
    # and a command sent after the first checkpoint could find the run already done. (Should
    # step 150 pass before the command lands, the poison comes at the next step.)
    stack.cli("chaos", "corrupt-grad", culprit, "--at-step", "150")
    try:
        followed = stack.cli("run", str(spec), timeout=300)
        assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
        after = stack.cli("status", "tiny-nan").stdout
        assert re.search(
            rf"failure +gen {generation} .*non-finite loss or gradients at step 1[5-9]\d "
            r"\(suspect ranks \[0\]\)",
            after,
        ), after
        assert re.search(
            rf"health +gen {generation} step 1[5-9]\d: corruption on {culprit} \(quarantine\): "
            r"rank 0's own gradients were non-finite before the all-reduce",
            after,
        ), after
        # The ranks' word is the run's: the run keeps off the node, which one team's report
        # does not cordon (workflows/scheduling/node_reports.py).
        assert re.search(rf"keeps off +{culprit}: its ranks reported them", after), after
        nodes_table = stack.cli("nodes").stdout
        assert re.search(rf"{culprit} .*reported: suspected silent corruption", nodes_table), (
            nodes_table
        )
        final = find_latest(store, "tiny-nan", max_generation=10**9)
        expected = find_latest(store, reference, max_generation=10**9)
        assert final is not None and expected is not None and final.generation > generation
        assert final.manifest.loss_history == expected.manifest.loss_history
        weights, theirs = (
            final_weights(stack, "tiny-nan", tmp_path),
            final_weights(stack, reference, tmp_path),
        )
        assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
    finally:
        stack.cli("node", "undrain", culprit)
    # Nobody decided on the reference run within its window: it ends EXPIRED, and says so.
    wait_for(lambda: "EXPIRED" in stack.cli("status", reference).stdout, 60, "the expiry")
    late = stack.cli("approve", reference, check=False, as_person=("bob", "approve:*"))
    assert late.returncode == ExitCode.REFUSED and "is EXPIRED" in late.stdout, late.stdout
    version = MlflowClient(tracking_uri=stack.settings.mlflow_uri).get_model_version_by_alias(
        reference, "candidate"
    )
    assert version.tags["forgeline.decision"] == "expired"


# Covered faster, part by part: tests/trainer/test_stragglers.py (a throttled rank is named,
# the gang checkpoints and stops with the straggler reason) and the Cluster workflow's
# test_a_straggler_is_cordoned_not_counted_as_a_death; the run's re-queue is recovery's path.
@pytest.mark.slow
def test_a_straggler_is_swapped_for_another_node(stack: Stack, tmp_path: Path) -> None:
    """One node of the gang runs at a fifth of its speed: the gang names it with evidence,
    checkpoints, the run keeps off the node (reported, not cordoned: one team's word), and goes
    on on the others from that step."""
    # Two busy CPU cores shared by a whole stack are noisy: a rank often runs 1.5× slower for a
    # second (a CLI process starting, a checkpoint upload). Twice as slow over two windows of
    # 5 s (the default span) is not noise; 5× is the fault.
    settings = {"straggler_policy": "swap", "straggler_factor": 2.0, "straggler_windows": 2}
    # Long enough that the slow-down lands mid-training; the test cancels it once it moved on.
    spec = variant(tmp_path, "tiny-slow", recovery=settings, steps=100_000, checkpoint_every=200)
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    wait_for(lambda: committed_steps(store, "tiny-slow"), 120, "the first checkpoint", 0.25)
    generation, nodes = gang_of(stack, "tiny-slow")
    assert generation and len(nodes) == 2
    victim = nodes[1]
    try:
        stack.cli("chaos", "slow-node", victim, "--factor", "5")
        # Watched in the ranks' progress files: a CLI call every 0.2 s would keep a core busy
        # starting Python, and starve the healthy rank the test is about.
        wait_for(
            lambda: first_step_of_generation_after(stack, "tiny-slow", generation) is not None,
            120,
            "a swap",
            poll=1.0,
        )
        moved = gang_of(stack, "tiny-slow")
        status = stack.cli("status", "tiny-slow").stdout
        assert moved[0] > generation and victim not in moved[1], status
        found = re.search(
            rf"health +gen {generation} step (\d+): straggler on {victim} \(swap\): rank 1 "
            r"\(node index 1\) is \d+\.\d× slower",
            status,
        )
        assert found, status
        assert re.search(r"attempts +0 restart", status), status  # a swap is not a failure
        assert re.search(r"^  straggler +[\d,.]+ GPU-s", status, re.M), status
        # One team's report: the run keeps off the node, the cluster records it and cordons it
        # only when a second team's runs report it too (cordon_teams).
        nodes_table = stack.cli("nodes").stdout
        assert re.search(rf"{victim} .*reported: straggler: rank 1", nodes_table), nodes_table
        assert not re.search(rf"{victim} .*cordoned", nodes_table), nodes_table
        # The gang committed a checkpoint where it named the straggler (read in its own events:
        # by now the new gang's commits may have pruned it); the new one starts there.
        swapped_at = int(found.group(1))
        commits = commits_of(stack, "tiny-slow", generation)
        assert swapped_at in commits, commits
        resumed_at = wait_for(
            lambda: first_step_of_generation_after(stack, "tiny-slow", generation), 60, "ranks"
        )
        assert resumed_at == swapped_at
    finally:
        stack.cli("cancel", "tiny-slow")
        stack.cli("node", "undrain", victim)


# With the slow tests, to keep `make test` within 15 minutes (about 60 s of it, with the
# reference run it compares with, which no other test of make test needs): make test keeps
# metrics spooled through an MLflow outage (tests/registry/test_metric_stream.py); the death of
# the Temporal server and the control worker under running ranks is tested here only.
@pytest.mark.slow
def test_the_control_plane_can_die_under_a_training_run(
    stack: Stack, reference: str, tmp_path: Path
) -> None:
    """SIGKILL the control worker, the Temporal dev server and the MLflow server mid-training:
    the node agents own the ranks, which train on, and spool their metrics on disk; `forgeline
    up` brings back what is missing, and the run completes with no restart, the reference's
    weights, and every streamed metric in MLflow exactly once."""
    # The outage must stay inside the heartbeat timeout, whatever the machine's load: 30 s.
    spec = variant(tmp_path, "tiny-cp", steps=300, checkpoint_every=100, heartbeat_timeout_s=30)
    stack.cli("run", str(spec), "--detach")
    # Strike early in training, watching the progress files rather than the store: 300 steps of
    # the tiny model now take a few seconds, and waiting for the first commit (step 100) and a
    # CLI call after it left the ranks done before the control plane was gone.
    generation, _ = wait_for(lambda: (gang := gang_of(stack, "tiny-cp"))[0] and gang, 120, "a gang")
    wait_for(lambda: latest_step(stack, "tiny-cp", generation) >= 10, 120, "training", poll=0.02)
    for name in ("control-worker", "temporal", "mlflow"):
        # The whole group: MLflow's server runs in children that would otherwise serve on.
        pid = int((stack.home / "run" / f"{name}.pid").read_text().split()[0])
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    # Nobody is left to tell the ranks anything, and they train on.
    before = latest_step(stack, "tiny-cp", generation)
    wait_for(
        lambda: latest_step(stack, "tiny-cp", generation) >= before + 20,
        60,
        "training to go on without the control plane",
        poll=0.05,
    )
    stack.cli("up", "--nodes", "3")
    followed = stack.cli("run", str(spec), timeout=300)
    assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
    status = stack.cli("status", "tiny-cp").stdout
    assert re.search(r"attempts +0 restart", status), status
    assert re.search(rf"checkpoint +step 300 \(generation {generation},", status), status
    weights, theirs = (
        final_weights(stack, "tiny-cp", tmp_path),
        final_weights(stack, reference, tmp_path),
    )
    assert all(torch.equal(weights[k], theirs[k]) for k in theirs)
    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    run_id = client.get_model_version_by_alias("tiny-cp", "candidate").run_id
    # The agent spooled what the ranks logged during the outage and ships it on its own
    # back-off (at most 15 s between tries): it may land after the run is registered.
    expected = [1, *range(5, 301, 5)]  # log_every = 5, each once

    def streamed() -> list[int]:
        return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))

    wait_for(lambda: len(streamed()) >= len(expected), 60, "the spooled metrics", poll=1.0)
    assert streamed() == expected


# Covered faster by tests/activities/test_node_health_check.py and the Cluster workflow's tests.
@pytest.mark.slow
def test_a_node_failing_its_health_check_is_left_behind(stack: Stack, tmp_path: Path) -> None:
    """The node's own checker reports ECC errors mid-training: its agent stops the attempt at
    once (no heartbeat timeout to wait for), the run reports the node and continues on another;
    when the check passes again the node is back in service."""
    # Long enough that the check fails mid-training: 300 tiny steps can end before the two CLI
    # calls below have started; 1,500 leave half a minute (3,000 cost CI a minute more).
    spec = variant(tmp_path, "tiny-sick", steps=1500, checkpoint_every=100)
    stack.cli("run", str(spec), "--detach")
    store = stack.store()
    wait_for(lambda: committed_steps(store, "tiny-sick"), 120, "the first checkpoint", 0.25)
    generation, nodes = gang_of(stack, "tiny-sick")
    sick = nodes[1]
    stack.cli("chaos", "fail-health", sick, "--reason", "uncorrectable ECC errors")
    try:
        followed = stack.cli("run", str(spec), timeout=300)
        assert "AWAITING_APPROVAL" in followed.stdout, followed.stdout
        status = stack.cli("status", "tiny-sick").stdout
        assert re.search(
            rf"failure +gen {generation} .*{sick}: .*health check failed: uncorrectable ECC",
            status,
        ), status
        assert re.search(rf"{sick} .*down .*health check failed", stack.cli("nodes").stdout)
    finally:
        stack.cli("chaos", "fail-health", sick, "--clear")
    wait_for(
        lambda: re.search(rf"{sick} .*idle", stack.cli("nodes").stdout), 30, "the node to return"
    )
