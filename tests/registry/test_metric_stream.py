"""Metrics spooled on local disk reach a real MLflow server, also across an outage of it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from infra.local_servers import MLFLOW_SERVER_ENV, mlflow_server_argv
from infra.processes import free_port, http_ok
from registry.metric_stream import MetricShipper, MetricSpool, seal_abandoned


class MlflowServer:
    """A real `mlflow server` that a test can stop and start again on the same port and store."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.state_dir / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            mlflow_server_argv(self.state_dir, self.port),
            env={**os.environ, **MLFLOW_SERVER_ENV},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its workers go down with it: we signal the group
        )
        log.close()
        deadline = time.monotonic() + 60
        while not http_ok(f"{self.uri}/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.state_dir / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mlflow server did not come up:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill the server and its workers at once, as a crash would (SQLite keeps the data);
        a graceful stop would cost two more seconds a time."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.uri}/api/2.0/mlflow/{path}",
            data=data,
            headers={"Content-Type": "application/json"},
            method=method,
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def new_run(self) -> str:
        return self.call("POST", "runs/create", {"experiment_id": "0"})["run"]["info"]["run_id"]

    def history(self, run_id: str, key: str) -> list[dict]:
        query = urllib.parse.urlencode({"run_id": run_id, "metric_key": key})
        return self.call("GET", f"metrics/get-history?{query}").get("metrics", [])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    mlflow = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    mlflow.start()
    try:
        yield mlflow
    finally:
        mlflow.stop()


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def steps_of(points: list[dict]) -> Counter:
    return Counter(int(p["step"]) for p in points)


def test_metrics_buffer_while_mlflow_is_down_and_arrive_after_it_restarts(
    server: MlflowServer, tmp_path: Path
) -> None:
    run_id = server.new_run()
    spool = MetricSpool(tmp_path, run_id, "g0a1")
    shipper = MetricShipper(tmp_path, server.uri, interval_s=0.2, max_backoff_s=0.5).start()
    try:
        for step in range(1, 6):
            spool.log_dict({"train/loss": 10.0 - step, "train/lr": 1e-3}, step, 1_000 + step)
        # The background thread ships without being asked.
        assert wait_for(lambda: len(server.history(run_id, "train/loss")) == 5, 10)

        server.stop()
        began = time.perf_counter()
        for step in range(6, 506):
            spool.log_dict({"train/loss": 10.0 - step / 100, "train/lr": 1e-3}, step, 1_000 + step)
        spool.log("train/loss", math.nan, 506, 1_506)  # a diverged step must not wedge the stream
        spool.close()
        # 500 steps spooled while MLflow is down: local appends only, nothing waits or raises.
        assert time.perf_counter() - began < 1.0
        assert wait_for(lambda: shipper.failures >= 2, 5), "the shipper kept trying"
        assert (tmp_path / f"{run_id}__g0a1.jsonl").exists()

        server.start()
        # Known down: delivering waits for nothing; the thread's next try ships the backlog.
        assert not shipper.deliver(15)
        assert shipper.flush(15), "everything spooled was acknowledged"
        # Back up: what the next attempt spools is delivered when asked, not on the back-off.
        with MetricSpool(tmp_path, run_id, "g0a2") as again:
            again.log("train/loss", 0.5, 507, 1_507)
        assert shipper.deliver(15)
        assert steps_of(server.history(run_id, "train/loss"))[507] == 1
    finally:
        shipper.stop(flush_timeout_s=1)

    loss = server.history(run_id, "train/loss")
    assert steps_of(loss) == Counter(range(1, 508)), "every step exactly once"
    by_step = {int(p["step"]): p["value"] for p in loss}
    assert by_step[3] == pytest.approx(7.0)
    assert by_step[400] == pytest.approx(6.0)
    assert by_step[506] == "NaN"  # MLflow's JSON spelling of a stored NaN
    assert steps_of(server.history(run_id, "train/lr")) == Counter(range(1, 506))
    # Closed and fully shipped: the spool folder is empty again.
    assert list(tmp_path.iterdir()) == []


def test_a_restarted_shipper_resends_only_what_was_not_acknowledged(
    server: MlflowServer, tmp_path: Path
) -> None:
    run_id = server.new_run()
    spool = MetricSpool(tmp_path, run_id, "g1a1")
    for step in range(1, 4):
        spool.log("train/loss", 1.5, step, 2_000 + step)
    assert MetricShipper(tmp_path, server.uri).flush(10)
    path = tmp_path / f"{run_id}__g1a1.jsonl"
    shipped = path.stat().st_size
    assert int(path.with_name(path.name + ".offset").read_text()) == shipped

    # Rewrite the acknowledged lines with other values of the same length: a shipper that
    # resent them would add three more points to the run.
    path.write_bytes(path.read_bytes().replace(b"1.5", b"9.5"))
    for step in range(4, 6):
        spool.log("train/loss", 2.5, step, 2_000 + step)
    spool.close()
    assert MetricShipper(tmp_path, server.uri).flush(10)
    loss = server.history(run_id, "train/loss")
    assert sorted((int(p["step"]), p["value"]) for p in loss) == [
        (1, 1.5), (2, 1.5), (3, 1.5), (4, 2.5), (5, 2.5),
    ]  # fmt: skip
    assert not path.exists()

    # A crash between the send and the offset write resends the batch: MLflow keeps one copy
    # of an identical point (its key is key, value, timestamp and step).
    spool = MetricSpool(tmp_path, run_id, "g1a2")
    spool.log_dict({"train/loss": 0.5, "train/mfu": 0.25}, 6, 2_006)
    spool.close()
    shipper = MetricShipper(tmp_path, server.uri)
    assert shipper.flush(10)
    again = MetricSpool(tmp_path, run_id, "g1a2")  # the same lines spooled and shipped twice
    again.log_dict({"train/loss": 0.5, "train/mfu": 0.25}, 6, 2_006)
    again.close()
    assert shipper.flush(10)
    assert steps_of(server.history(run_id, "train/loss"))[6] == 1
    assert steps_of(server.history(run_id, "train/mfu")) == Counter({6: 1})


def test_a_refused_metric_is_skipped_without_blocking_the_rest(
    server: MlflowServer, tmp_path: Path
) -> None:
    run_id = server.new_run()
    spool = MetricSpool(tmp_path, run_id, "g2a1")
    spool.log("train/loss", 3.0, 1, 3_001)
    # A line the writer would refuse today (a bad name), as an older version might have left it.
    with open(spool.path, "a") as handle:
        handle.write(json.dumps({"key": "bad?name", "value": 1.0, "timestamp": 3_002, "step": 2}))
        handle.write("\nnot json at all\n")
    spool.log("train/loss", 2.0, 3, 3_003)
    spool.close()
    shipper = MetricShipper(tmp_path, server.uri)
    assert shipper.flush(10)
    assert shipper.rejected == 1
    assert steps_of(server.history(run_id, "train/loss")) == Counter({1: 1, 3: 1})
    # A run MLflow does not know cannot hold the stream up either.
    with MetricSpool(tmp_path, "0" * 32, "g0a1") as lost:
        lost.log("train/loss", 1.0, 1)
    assert shipper.flush(10)
    assert list(tmp_path.iterdir()) == []


def test_spool_keeps_everything_while_mlflow_is_unreachable(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spool = MetricSpool(tmp_path, "a" * 32, "g3a1")
    began = time.perf_counter()
    for step in range(1000):
        spool.log_dict({"train/loss": 1.0, "train/tokens_per_s": 5e4}, step)
    assert time.perf_counter() - began < 1.0
    size = spool.path.stat().st_size

    shipper = MetricShipper(tmp_path, dead, request_timeout_s=0.5)
    assert not shipper.flush(0.3)
    assert shipper.failures >= 1
    # A finished attempt does not wait on an MLflow known to be down (a flush would take 30 s).
    began = time.perf_counter()
    assert not shipper.deliver(30)
    assert time.perf_counter() - began < 0.1
    assert not spool.path.with_name(spool.path.name + ".offset").exists()  # nothing acknowledged

    # A writer that dies mid-line leaves a torn line; the next writer of the stream ends it.
    with open(spool.path, "a") as handle:
        handle.write('{"key": "train/loss", "val')
    spool.close()
    reopened = MetricSpool(tmp_path, "a" * 32, "g3a1")
    assert not reopened.path.with_name(reopened.path.name + ".closed").exists()
    reopened.log("train/loss", 2.0, 1000)
    *_, torn, last = reopened.path.read_bytes().splitlines()
    assert torn == b'{"key": "train/loss", "val'
    assert json.loads(last)["step"] == 1000
    assert reopened.path.stat().st_size > size

    # The writer crashed (never closed): a starting agent seals what it left, once.
    assert seal_abandoned(tmp_path) == 1
    assert seal_abandoned(tmp_path) == 0

    with pytest.raises(ValueError, match="metric name"):
        reopened.log("bad?name", 1.0, 1)
    with pytest.raises(ValueError, match="run id"):
        MetricSpool(tmp_path, "a__b", "g0")

    # The background thread backs off, keeps trying, and stops promptly with nothing lost.
    shipper = MetricShipper(tmp_path, dead, interval_s=0.05, request_timeout_s=0.5).start()
    assert wait_for(lambda: shipper.failures >= 3, 5)
    assert not shipper.stop(flush_timeout_s=0.5)
    reopened.close()
    assert reopened.path.exists()


@pytest.mark.slow  # `import mlflow` and a new SQLite store cost ~6 s; the REST path is above
def test_a_local_store_goes_through_the_mlflow_client(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = MlflowClient(tracking_uri=uri).create_run("0").info.run_id
    with MetricSpool(tmp_path / "spool", run_id, "g0-a1") as spool:
        spool.log_dict({"train/loss": 2.0, "train/mfu": math.nan}, 1, 4_001)
        spool.log("train/loss", 1.0, 2, 4_002)
    shipper = MetricShipper(tmp_path / "spool", uri)
    assert shipper.flush(30)
    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [
        (1, 2.0),
        (2, 1.0),
    ]
    assert math.isnan(client.get_metric_history(run_id, "train/mfu")[0].value)
    assert list((tmp_path / "spool").iterdir()) == []
