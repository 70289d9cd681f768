"""Level 2 end to end: a Hugging Face `Trainer` script and a Lightning script, each with
Forgeline's one callback (examples/byo/hf, examples/byo/lightning), their libraries installed
by the node agents from their requirements.txt, each losing a node agent to SIGKILL after a
commit: the library resumes from its last committed checkpoint, its global step continues, its
loss does not start again from scratch, and the version registered holds the files the spec
names."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.e2e.conftest import Stack, progress_events, wait_for
from tests.e2e.faults import commits_of, gang_of, kill_after_a_commit
from tests.e2e.test_user_code import BYO, byo_spec
from trainer.folder_checkpoint import restore_folder
from trainer.manifest import find_latest

pytestmark = pytest.mark.e2e


def hf_step(folder: Path) -> int:
    (newest,) = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1:]
    return json.loads((newest / "trainer_state.json").read_text())["global_step"]


def lightning_step(folder: Path) -> int:
    # The test's own file, written by Lightning on the stack: not a stranger's pickle.
    return torch.load(folder / "last.ckpt", weights_only=False)["global_step"]


# (example, its steps (the spec's --steps), the library's own record of its last step, the
# files the version holds). Each saves every 3 s or so here: the folder is quiet long enough
# between saves for commits during the run, so the kill lands mid-run.
EXAMPLES: list[tuple[str, int, Callable[[Path], int], set[str]]] = [
    ("hf", 600, hf_step, {"model.safetensors", "config.json", "vocab.json"}),
    ("lightning", 900, lightning_step, {"last.ckpt", "vocab.json"}),
]


def reported(stack: Stack, run: str, generation: int) -> list[tuple[int, float]]:
    """The (step, loss) lines the script reported in `generation`, in order."""
    events = progress_events(stack, run, generation)
    return [(e["step"], e["loss"]) for e in events if e["event"] == "step" and e.get("loss")]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("example", "steps", "library_step", "registered"), EXAMPLES, ids=[e[0] for e in EXAMPLES]
)
def test_a_library_s_trainer_survives_a_dead_node_and_a_drain_and_is_registered(
    stack: Stack, tmp_path: Path, example: str, steps: int,
    library_step: Callable[[Path], int], registered: set[str],
) -> None:  # fmt: skip
    run = f"byo-{example}"
    spec = byo_spec(tmp_path, run, BYO / example, f"{example}.toml", heartbeat_timeout_s=5)
    assert f"submitted run {run}" in stack.cli("run", str(spec), "--detach").stdout
    killed = kill_after_a_commit(stack, run, random.Random(46))
    before = reported(stack, run, killed)
    stack.cli("up", "--nodes", "3")  # the node comes back

    # The next gang, after its first commit, loses a node to a drain: its ranks get SIGTERM,
    # save at a step they all agree on and return; the gang after it goes on from that save.
    resumed, nodes = wait_for(lambda: (g := gang_of(stack, run))[0] > killed and g, 120, "a gang")
    wait_for(lambda: commits_of(stack, run, resumed), 120, "its first commit", poll=0.05)
    try:
        drained_at = max(step for step, _ in reported(stack, run, resumed))
        stack.cli("node", "drain", nodes[1])
        followed = stack.cli("run", str(spec), timeout=600).stdout
    finally:
        stack.cli("node", "undrain", nodes[1], check=False)
    assert "AWAITING_APPROVAL" in followed, followed
    status = stack.cli("status", run).stdout
    assert re.search(r"attempts +1 restart", status), status  # the drain is no failure
    assert re.search(rf"preempted +gen {resumed} at [0-9:]+ at step \d+", status), status
    assert re.search(r"evaluation +val_loss \d+\.\d+ .*self-reported", status), status
    # Each node says it stopped; the first node's line names the step its agent committed.
    ends = [e["step"] for e in progress_events(stack, run, resumed) if e["event"] == "stopped"]
    stopped = max(ends, default=-1)
    assert len(ends) == 2 and stopped >= drained_at, (ends, drained_at)
    assert stopped == max(commits_of(stack, run, resumed))  # the stop's save

    final = find_latest(stack.store(), run, max_generation=10**9)
    assert final is not None and final.generation > resumed and final.step == steps
    folder = restore_folder(stack.store(), final.manifest, tmp_path / "final").path
    assert library_step(folder) == steps
    # Each gang went on from a commit: its first report is past the one before's first, at a
    # loss below where the killed gang began, and the last gang's past the stop's save.
    after, last = reported(stack, run, resumed), reported(stack, run, final.generation)
    assert before and after and last, (before, after, last)
    assert after[0][0] > before[0][0] and after[0][1] < before[0][1], (before, after)
    assert last[0][0] > stopped, (stopped, last)

    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    version = client.get_model_version_by_alias(run, "candidate")
    assert version.tags["forgeline.eval_source"] == "script"
    files = {f.path for f in client.list_artifacts(version.run_id, "model")}
    assert files == {f"model/{name}" for name in registered}, files
    assert client.get_metric_history(version.run_id, "train/loss")
