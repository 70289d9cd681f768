import ast
import time
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities import heartbeat
from activities.control import ControlActivities
from activities.heartbeat import beats_while_running, keep_alive
from workflows.training_run import CONTROL_HEARTBEAT


@activity.defn
def blocking_work() -> str:
    with keep_alive(every_s=0.05):
        time.sleep(0.5)  # stands for one long DuckDB query: no chance to heartbeat ourselves
    return "done"


def test_keep_alive_heartbeats_while_the_activity_blocks() -> None:
    env = ActivityEnvironment()
    beats: list[tuple] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    assert env.run(blocking_work) == "done"
    assert len(beats) >= 5
    count = len(beats)
    time.sleep(0.2)
    assert len(beats) == count  # the beating thread stopped with the block


def test_a_control_activity_beats_and_the_run_gives_it_a_heartbeat_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A control worker killed mid-activity: beating, the activity is retried within the run's
    heartbeat timeout, not at its start-to-close timeout (a run sat REGISTERING for 30 min in
    the soak). Every control activity the run calls with a heartbeat timeout beats."""
    monkeypatch.setattr(heartbeat, "CONTROL_BEAT_S", 0.05)

    @activity.defn(name="slow_control_work")
    @beats_while_running
    def slow_control_work(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    env = ActivityEnvironment()
    beats: list[tuple] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    assert env.run(slow_control_work, 0.5) == "done"
    assert len(beats) >= 5

    beating = _called_with_a_heartbeat()
    assert {"register_model", "latest_checkpoint", "fence_generation"} <= beating, beating
    for name in beating - {"evaluate"}:  # evaluate beats at each checkpoint it reads
        method = getattr(ControlActivities, name)
        assert getattr(method, "__wrapped__", None) is not None, f"{name} does not beat"
    assert CONTROL_HEARTBEAT.total_seconds() > 3 * heartbeat.CONTROL_BEAT_S * 20


def _called_with_a_heartbeat() -> set[str]:
    """The activities TrainingRun runs through `_control` without `heartbeat=None`."""
    names = set()
    folder = Path(__file__).resolve().parents[2] / "workflows"
    for module in ("training_run.py", "run_end.py"):
        for call in ast.walk(ast.parse((folder / module).read_text())):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            if call.func.attr != "_control" or not isinstance(call.args[0], ast.Constant):
                continue
            given = [k.value for k in call.keywords if k.arg == "heartbeat"] + call.args[4:5]
            if not (given and isinstance(given[0], ast.Constant) and given[0].value is None):
                names.add(call.args[0].value)
    return names
