"""Finite corruption on real torchrun ranks: gradients scaled on one rank (`forgeline chaos
corrupt-grad --finite`) are reported as a suspect naming that rank, the next step is shadow
checked at once, and the run goes on; clean runs longer than the watch's window report
nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import FSDP
from trainer.manifest import commits, find_latest
from workflows.contracts.spec import RecoverySpec, TrainSpec

LONG = TrainSpec(
    steps=120, batch_size=8, learning_rate=3e-3, warmup_steps=5, log_every=20,
    checkpoint_every=60, keep_checkpoints=2, seed=5,
)  # fmt: skip
WATCH = RecoverySpec(suspect_window_steps=30).spike_settings()


def health(job) -> list[dict]:
    """The run's health events but a straggler's: that watch (tests/trainer/test_stragglers.py)
    compares the ranks' step times, and on two cores shared with another test's ranks (make test
    runs on two workers) a clean rank can be slower for a window: it named one at step 120."""
    lines = Path(job.progress_file).read_text().splitlines()
    return [
        e for e in map(json.loads, lines) if e["event"] == "health" and e["kind"] != "straggler"
    ]


# Each test's other layout with the slow tests (make test within 15 minutes): between them,
# make test still runs a clean gang of four and a corrupt rank under FSDP.
@pytest.mark.parametrize(
    ("layout", "ranks"),
    [(None, 4), pytest.param(FSDP, 2, marks=pytest.mark.slow)],
    ids=["ddp", "fsdp"],
)
def test_clean_runs_raise_no_suspect(trainer: Trainer, layout: dict | None, ranks: int) -> None:
    """The spec's own settings (a window of 50 steps), on runs more than twice that long."""
    job = trainer.job(f"clean-{ranks}", LONG, layout=layout)
    trainer.run(job, ranks=ranks)
    assert health(job) == []


@pytest.mark.parametrize(
    "layout", [pytest.param(None, marks=pytest.mark.slow), FSDP], ids=["ddp", "fsdp"]
)
def test_finitely_scaled_gradients_name_their_rank(trainer: Trainer, layout: dict | None) -> None:
    name = "scaled-" + ("fsdp" if layout else "ddp")
    often = LONG.model_copy(update={"checkpoint_every": 20})  # 6 commits, 2 kept
    # Shadow checks on, but never due in 120 steps: only the suspect brings one on.
    shadow = RecoverySpec(shadow_every=1000).shadow_settings()
    job = trainer.job(name, often, layout=layout, spikes=WATCH, shadow=shadow)
    job.chaos_file = str(Path(job.progress_file).parent / "CORRUPT_GRAD")
    Path(job.chaos_file).parent.mkdir(parents=True, exist_ok=True)
    # What `forgeline chaos corrupt-grad n0 --finite --scale 1000 --at-step 70` writes.
    Path(job.chaos_file).write_text("corrupt-grad 70 1000.0\n")
    trainer.run(job, ranks=2)

    (event,) = health(job)
    assert (event["kind"], event["rank"], event["action"], event["step"]) == (
        "suspect", 0, "report", 70,
    )  # fmt: skip
    assert event["node_index"] == 0 and event["mads"] > 10
    assert "rank 0's own gradient norm" in event["evidence"]
    # The suspect's next step was checked at once; rank 0 computes right again (the fault
    # struck once), so the check agreed and the suspect stands as a report.
    lines = Path(job.progress_file).read_text().splitlines()
    checks = [e for e in map(json.loads, lines) if e["event"] == "shadow_check"]
    assert [(e["step"], e["why"], e["agreed"]) for e in checks] == [(71, "suspect", True)]
    # A suspect is not a verdict: the run trained on to its end.
    found = find_latest(trainer.store, name, max_generation=1)
    assert found is not None and found.step == LONG.steps
    # What a later verdict would roll back to stays: the checkpoints from before step 70
    # (kept_checkpoints = 2 would have left only 100 and 120).
    assert sorted(c.step for c in commits(trainer.store, name)) == [40, 60, 100, 120]
