from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from infra.settings import Settings
from worker.render import eta_text, progress_line, runs_table, status_text
from worker.runs import RunView
from workflows.contracts.models import (
    ApprovalPolicy,
    CheckpointRef,
    EvalResult,
    EvalSource,
    Failure,
    Phase,
    RunStatus,
    TrainProgress,
)

SETTINGS = Settings(home=Path("/tmp/x"))


def training_view() -> RunView:
    status = RunStatus(
        name="r1",
        phase=Phase.TRAINING,
        owner="alice",
        total_steps=600,
        generation=4,
        nodes=["node-1", "node-2"],
        attempts=1,
        last_checkpoint=CheckpointRef(
            manifest_key="runs/r1/checkpoints/step-100/MANIFEST.json",
            step=100,
            generation=3,
            tokens_seen=409600,
        ),
        failures=[
            Failure(
                generation=3,
                node_id="node-0",
                reason="node-0: activity Heartbeat timeout",
                at=datetime(2026, 11, 29, 9, 0, tzinfo=UTC),
            )
        ],
    )
    beat = TrainProgress(
        node_id="node-1", generation=4, step=230, total_steps=600, loss=2.25,
        tokens_per_s=20500.0, mfu=0.5, checkpoint_step=200, state="training",
    )  # fmt: skip
    return RunView(status=status, progress=beat, execution=None)


def test_progress_line_shows_what_a_person_waits_for() -> None:
    line = progress_line(training_view())
    assert line.startswith("TRAINING")
    for part in ("step 230/600", "loss 2.2500", "tokens/s 20,500", "gen 4", "ckpt 200"):
        assert part in line


def test_a_training_run_shows_its_rate_and_eta_and_one_between_gangs_does_not() -> None:
    view = training_view()
    assert "ETA" not in progress_line(view)  # no rate yet
    view.progress.steps_per_s = 2.5  # type: ignore[union-attr]
    # 370 steps left at 2.5 a second: 148 s.
    assert "2.50 steps/s  ETA 2m28s" in progress_line(view)
    console = Console(width=200, file=None, record=True)
    console.print(runs_table([view]))
    assert "230/600 │ 2m28s" in console.export_text()
    view.status.phase = Phase.RECOVERING  # the heartbeat is the gang's that failed
    assert "ETA" not in progress_line(view)


def test_eta_text() -> None:
    assert [eta_text(s) for s in (None, 12.4, 247, 7_500)] == ["-", "12s", "4m07s", "2h05m"]


def test_status_prefers_the_newer_checkpoint_the_ranks_reported() -> None:
    text = status_text(training_view(), SETTINGS)
    assert "allocation     generation 4 on node-1, node-2" in text
    assert "checkpoint     step 200 (generation 4, reported by the ranks)" in text
    assert "failure        gen 3 at 09:00:00: node-0: activity Heartbeat timeout" in text
    assert "attempts       1 restart(s)" in text


def test_status_names_the_weights_a_fine_tuning_run_started_from() -> None:
    view = training_view()
    assert "init from" not in status_text(view, SETTINGS)
    view.status.init_from = CheckpointRef(
        manifest_key="runs/base/checkpoints/step-600/MANIFEST.json",
        step=600,
        generation=2,
        tokens_seen=1,
    )
    text = status_text(view, SETTINGS)
    assert "init from      step 600 of runs/base/checkpoints/step-600/MANIFEST.json" in text


def test_an_evaluation_says_what_it_was_measured_on() -> None:
    view = training_view()
    held_out = EvalResult(step=600, val_loss=1.5, perplexity=4.48, val_tokens=8192, sample="")
    view.status.evaluation = held_out
    assert "on 8,192 tokens at step 600" in status_text(view, SETTINGS)
    # A user's script that reports no held-out loss is judged on its last training loss.
    view.status.evaluation = held_out.model_copy(update={"val_tokens": 0, "measured_on": "train"})
    text = status_text(view, SETTINGS)
    assert "the last training loss, step 600: the script reports no held-out loss" in text
    assert "on 0 tokens" not in text and "sample " not in text  # no empty sample line


def test_a_loss_the_run_s_script_reported_is_shown_as_self_reported_to_the_approver() -> None:
    view = training_view()
    measured = EvalResult(
        step=600, val_loss=1.5, perplexity=4.48, val_tokens=8192, sample="",
        source=EvalSource.PLATFORM,
    )  # fmt: skip
    view.status.phase = Phase.AWAITING_APPROVAL
    view.status.approval = ApprovalPolicy(max_val_loss=2.0, source="approvals.toml: team x")
    view.status.evaluation = measured
    assert "self-reported" not in status_text(view, SETTINGS) + progress_line(view)
    view.status.evaluation = measured.model_copy(update={"source": EvalSource.SCRIPT})
    lines = status_text(view, SETTINGS).splitlines()
    assert any(
        line.startswith("evaluation     val_loss 1.5000")
        and line.endswith("on 8,192 tokens at step 600 (self-reported by the run's script)")
        for line in lines
    )
    assert "eval gate      val_loss <= 2: passes" in lines
    assert (
        "eval source    val_loss 1.5000 is self-reported by the run's script, not measured by "
        "Forgeline: check the run's code before you trust it"
    ) in lines
    assert "val_loss 1.5000 (self-reported)" in progress_line(view)


def test_status_says_when_an_elastic_run_trains_on_fewer_nodes() -> None:
    view = training_view()
    assert "elastic" not in status_text(view, SETTINGS)
    view.status.shrunk_from = 3
    lines = status_text(view, SETTINGS).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("allocation"))
    assert lines[at + 1] == (
        "elastic        on 2 of 3 nodes since a failure; grows back when the cluster has nodes free"
    )


def test_status_says_which_nodes_the_run_keeps_off() -> None:
    view = training_view()
    assert "keeps off" not in status_text(view, SETTINGS)
    view.status.suspect_nodes = ["node-0", "node-3"]
    assert "keeps off      node-0, node-3: its ranks reported them" in status_text(view, SETTINGS)


def test_status_says_when_the_gang_resumed_from_the_peer_tier() -> None:
    view = training_view()
    view.progress = None
    assert "peer tier" not in status_text(view, SETTINGS)
    view.status.last_checkpoint = CheckpointRef(
        manifest_key="runs/r1/peer/step-120/gen-3/MANIFEST.json", step=120, generation=3,
        tokens_seen=491520, tier="peer",
    )  # fmt: skip
    assert (
        "checkpoint     step 120 (peer tier, generation 3, 491,520 tokens)  "
        "runs/r1/peer/step-120/gen-3/MANIFEST.json"
    ) in status_text(view, SETTINGS).splitlines()
