"""`forgeline report`: plots and summary from a run's status and metrics, and the MLflow side."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from infra.settings import Settings
from infra.store.local import LocalStore
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.manifest import manifest_key
from worker.report import (
    ARTIFACT_PATH,
    CheckpointMark,
    build_report,
    fetch_checkpoints,
    fetch_metrics,
    mlflow_run_of,
    report_run,
)
from workflows.contracts.models import (
    AttemptLedger,
    AttemptRecord,
    CheckpointRef,
    EvalResult,
    Failure,
    Goodput,
    LedgerMark,
    ModelVersionRef,
    Phase,
    RunStatus,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
FAILURE_REASON = "node-1 stopped heartbeating: no heartbeat for 10 s (fail-stop)"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ms(seconds: float) -> int:
    return int(at(seconds).timestamp() * 1000)


def mark(step: int, seconds: float, resumed_from: int = 0) -> LedgerMark:
    trained = (step - resumed_from) * 0.5
    return LedgerMark(
        step=step,
        at=at(seconds).timestamp(),
        steps=step - resumed_from,
        train_s=trained,
        stall_s=0.4,
        eval_s=0.2,
        straggler_s=0.1,
    )


def two_attempt_status() -> RunStatus:
    """Generation 1 trains to step 30, commits 20, dies; generation 2 resumes at 20 and ends."""
    first = AttemptRecord(
        generation=1,
        gpus=2,
        requested_at=at(0),
        granted_at=at(2),
        ended_at=at(30),
        outcome="failed",
        after="start",
        ledger=AttemptLedger(
            resume_step=0, ready_at=at(5).timestamp(), kept=mark(20, 16), last=mark(30, 21)
        ),
    )
    second = AttemptRecord(
        generation=2,
        gpus=2,
        requested_at=at(30),
        granted_at=at(33),
        ended_at=at(60),
        outcome="completed",
        after="failure",
        ledger=AttemptLedger(
            resume_step=20,
            ready_at=at(36).timestamp(),
            kept=mark(50, 57, resumed_from=20),
            last=mark(50, 57, resumed_from=20),
            ended="completed",
        ),
    )
    return RunStatus(
        name="tiny",
        phase=Phase.AWAITING_APPROVAL,
        owner="ada",
        total_steps=50,
        attempts=1,
        generation=2,
        last_checkpoint=CheckpointRef(
            manifest_key="runs/tiny/checkpoints/step-50/MANIFEST.json",
            step=50,
            generation=2,
            tokens_seen=50 * 4096,
        ),
        evaluation=EvalResult(
            step=50, val_loss=1.8765, perplexity=math.exp(1.8765), val_tokens=20_000, sample="To"
        ),
        mlflow_run_id="abc",
        model_version=ModelVersionRef(model_name="tiny-lm", version="3", mlflow_run_id="abc"),
        failures=[Failure(generation=1, node_id="node-1", reason=FAILURE_REASON, at=at(28))],
        gang_attempts=[first, second],
        goodput=Goodput(
            gpu_s=120.0,
            allocated_gpu_s=104.0,
            productive_gpu_s=80.0,
            lost_gpu_s={"queue": 4.0, "rework": 18.0, "failure detection": 18.0},
            attempts=2,
        ),
        final_loss=1.7012,
        tokens_per_s=41_000.0,
        mfu=0.312,
    )


def streamed(key: str, value_at) -> list[tuple[int, float, int]]:
    """Generation 1 streams steps 1-30; generation 2 streams 21-50 again from its checkpoint."""
    first = [(s, value_at(s), ms(5 + (s * 16 / 30))) for s in range(1, 31)]
    second = [(s, value_at(s) * 1.01, ms(36 + (s - 20) * 0.7)) for s in range(21, 51)]
    return first + second


def two_generation_metrics() -> dict[str, list[tuple[int, float, int]]]:
    loss = lambda s: 4.0 * math.exp(-s / 25) + 1.6  # noqa: E731
    registered = ms(61)
    return {
        "train/loss": streamed("train/loss", loss),
        "train/tokens_per_s": streamed("train/tokens_per_s", lambda s: 40_000 + 30 * s),
        "train/mfu": streamed("train/mfu", lambda s: 0.30 + s / 5000),
        "train/val_loss": [(25, 2.4, ms(18)), (50, 1.9, ms(56))],
        "train_loss": [(s, loss(s), registered) for s in range(1, 51)],
        "val_loss": [(0, 1.8765, registered)],
    }


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes: nothing drawn?"


def test_report_of_a_failed_then_recovered_run(tmp_path: Path) -> None:
    checkpoints = [CheckpointMark(step=40, generation=2, at=at(50))]
    report = build_report(
        two_attempt_status(), two_generation_metrics(), tmp_path / "out", checkpoints=checkpoints
    )

    names = sorted(p.name for p in report.files)
    assert names == ["goodput.png", "loss.png", "report.md", "throughput.png"]
    for path in report.files:
        assert path.is_file() and path.parent == tmp_path / "out"
        if path.suffix == ".png":
            assert_png(path)
    text = report.markdown.read_text()
    for figure in ("1.8765", "66.7%", "1.7012", "41,000", "31.20%", "tiny-lm v3"):
        assert figure in text, figure
    assert FAILURE_REASON in text
    assert "rework 18.0" in text and "failure detection 18.0" in text
    assert "| 2 | 2 | failure |" in text  # generation 2 came after the failure
    assert "![loss](loss.png)" in text and "![goodput](goodput.png)" in text
    assert report.missing == []


def test_report_with_no_metrics_and_no_evaluation_says_what_is_missing(tmp_path: Path) -> None:
    status = two_attempt_status().model_copy(
        update={
            "phase": Phase.TRAINING,
            "evaluation": None,
            "goodput": None,
            "model_version": None,
            "final_loss": None,
            "tokens_per_s": None,
            "mfu": None,
            "gang_attempts": [
                AttemptRecord(generation=1, gpus=2, requested_at=at(0), granted_at=at(2))
            ],
            "updated_at": at(9),
        }
    )
    report = build_report(status, {}, tmp_path)

    for path in report.files:
        if path.suffix == ".png":
            assert_png(path)
    text = report.markdown.read_text()
    assert "## Missing" in text
    assert "no final evaluation yet (phase TRAINING)" in text
    assert "no goodput yet" in text
    assert "no loss in MLflow yet" in text and "no train/mfu in MLflow yet" in text


def test_report_of_a_run_that_never_got_a_gang(tmp_path: Path) -> None:
    status = RunStatus(name="queued", phase=Phase.QUEUED, owner="ada", total_steps=10)
    report = build_report(status, {}, tmp_path)

    assert len(report.files) == 4
    assert "no gang attempts yet" in report.markdown.read_text()


def test_fetch_log_and_report_against_a_real_tracking_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("forgeline", artifact_location=str(tmp_path / "art"))
    run_id = client.create_run(experiment).info.run_id
    metrics = two_generation_metrics()
    batch = [Metric(k, v, t, s) for k, series in metrics.items() for s, v, t in series]
    for start in range(0, len(batch), 1000):
        client.log_batch(run_id, metrics=batch[start : start + 1000])

    fetched = fetch_metrics(uri, run_id)
    assert set(fetched) == set(metrics)
    # Both generations' step 25 survive, in the order they were logged.
    assert [p for p in fetched["train/loss"] if p[0] == 25] == [
        p for p in metrics["train/loss"] if p[0] == 25
    ]
    assert len(fetched["train/loss"]) == 60

    status = two_attempt_status().model_copy(update={"mlflow_run_id": run_id})
    store = LocalStore(tmp_path / "store")
    manifest = CheckpointManifest(step=50, generation=2, committed_at=at(57).isoformat(), files=[])
    store.put_bytes(manifest_key("tiny", 50, 2), manifest.dump_bytes())
    assert fetch_checkpoints(store, "tiny") == [CheckpointMark(50, 2, at(57))]

    settings = Settings(home=tmp_path, mlflow_uri=uri, store_url=str(tmp_path / "store"))
    out = tmp_path / "reports" / "tiny"
    out.mkdir(parents=True)
    (out / "id_rsa").write_text("a key that was there before")  # `--out ~`, say
    (out / "notes").mkdir()
    report = report_run(settings, status, out)
    assert report.logged_to == f"MLflow run {run_id}, artifacts report/"
    logged = {a.path for a in client.list_artifacts(run_id, ARTIFACT_PATH)}
    # Only what the report wrote goes to MLflow (the whole folder went before).
    assert logged == {f"{ARTIFACT_PATH}/{p.name}" for p in report.files}
    assert f"{ARTIFACT_PATH}/id_rsa" not in logged and len(report.files) == 4
    local = Path(client.download_artifacts(run_id, f"{ARTIFACT_PATH}/goodput.png", str(tmp_path)))
    assert_png(local)

    # A run MLflow does not know: the report is still written, says so, and is not logged.
    unknown = status.model_copy(update={"mlflow_run_id": "0" * 32})
    report = report_run(settings, unknown, tmp_path / "unknown")
    assert report.logged_to is None
    assert "unreadable" in report.markdown.read_text()

    # An old run has no mlflow_run_id: its model version's run is the one to read and log to.
    old = status.model_copy(update={"mlflow_run_id": None})
    assert mlflow_run_of(old) == "abc"
