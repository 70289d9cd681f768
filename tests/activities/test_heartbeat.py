import time

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.heartbeat import keep_alive


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
