"""Level 1 end to end: a plain torchrun script that never imports Forgeline
(examples/byo/plain) trains on the real stack, loses a node agent to SIGKILL after a commit,
resumes on the next gang from the folder Forgeline committed, finishes its step count, and is
registered with the file the spec names, its lineage saying that it reported no loss."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.e2e.conftest import Stack
from tests.e2e.faults import survives_a_dead_agent
from tests.e2e.test_user_code import BYO, byo_spec
from trainer.folder_checkpoint import restore_folder
from trainer.manifest import find_latest

pytestmark = pytest.mark.e2e

STEPS = 600


def saved_step(stack: Stack, run: str, generation: int, scratch: Path) -> int:
    """The step the script saved in `generation`'s newest commit (what a resume starts from)."""
    found = find_latest(stack.store(), run, max_generation=generation)
    assert found is not None and found.generation == generation
    folder = restore_folder(stack.store(), found.manifest, scratch / f"{run}-{found.step}").path
    return torch.load(io.BytesIO((folder / "last.pt").read_bytes()))["step"]


@pytest.mark.slow
def test_a_plain_torchrun_script_survives_a_dead_node_and_is_registered(
    stack: Stack, tmp_path: Path
) -> None:
    spec = byo_spec(tmp_path, "byo-plain", BYO / "plain", "plain.toml", heartbeat_timeout_s=5)
    # Every commit kept, so the killed gang's last one can be read once the run is over.
    spec.write_text(spec.read_text().replace("[registry]", "keep_checkpoints = 100\n\n[registry]"))
    assert "submitted run byo-plain" in stack.cli("run", str(spec), "--detach").stdout
    killed, status = survives_a_dead_agent(stack, "byo-plain", spec, seed=46)
    assert "the script reports no loss" in status, status
    # It counts its own steps, and keeps no ledger of its time: no total, no goodput to show.
    assert re.search(r"^progress +step \d+  loss -", status, re.M), status
    assert "goodput" not in status, status

    # The next gang was given the killed gang's last commit and --resume, and went on from it.
    resumed_from = saved_step(stack, "byo-plain", killed, tmp_path)
    assert 0 < resumed_from < STEPS
    final = find_latest(stack.store(), "byo-plain", max_generation=10**9)
    assert final is not None and final.generation > killed
    nodes = stack.home / "nodes"
    logs = [
        p.read_text() for p in nodes.glob(f"*/runs/byo-plain/gen-{final.generation}/rank-0.log")
    ]
    assert any(f"resumed at step {resumed_from}" in log for log in logs), logs
    assert saved_step(stack, "byo-plain", final.generation, tmp_path) == STEPS

    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    version = client.get_model_version_by_alias("byo-plain", "candidate")
    tags = version.tags
    assert tags["forgeline.checkpoint_manifest_key"] == final.key
    assert tags["forgeline.eval_measured_on"] == "nothing" and "forgeline.val_loss" not in tags
    assert tags["forgeline.servable"] == "false" and tags["forgeline.entrypoint"] == "train.py"
    files = {f.path for f in client.list_artifacts(version.run_id, "model")}
    assert files == {"model/last.pt"}, files
    traced = stack.cli("lineage", "byo-plain", "@candidate").stdout
    assert re.search(r"^user code +snapshot [0-9a-f]{32}", traced, re.M), traced
