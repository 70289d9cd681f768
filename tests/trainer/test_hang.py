"""A hung gang (a stuck rank stalls every collective) is noticed and stopped."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest

from infra.processes import free_port
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import job_processes
from tests.trainer.test_layouts import TRAIN
from trainer.errors import RanksFailed
from trainer.hang import HangWatch
from trainer.launch import Rendezvous, printed_stacks, run_ranks


def test_the_limit_follows_the_gang_s_own_pace() -> None:
    watch = HangWatch(factor=10, floor_s=2)
    watch.observe(0, 0.0)
    assert watch.stuck_s(100.0) is None, "no verdict before any progress (start-up)"
    for i in range(1, 6):
        watch.observe(5 * i, 0.5 * i)  # a progress report every 0.5 s
    assert watch.limit_s() == 5.0  # 10 × 0.5 s, above the 2 s floor
    assert watch.stuck_s(2.5 + 4.9) is None and watch.stuck_s(2.5 + 5.1) == pytest.approx(5.1)
    watch.observe(0, 10.0)  # a restart from step 0 starts the clock again
    assert watch.stuck_s(14.0) is None


# With the slow tests, to keep `make test` within 15 minutes (20 s: a gang, a rank frozen
# past the limit, its stacks dumped); the limit itself is unit-tested above.
@pytest.mark.slow
def test_a_stopped_rank_is_called_a_hang_and_every_rank_is_stopped(trainer: Trainer) -> None:
    job = trainer.job("hung", TRAIN.model_copy(update={"steps": 100_000}))
    workdir = Path(job.progress_file).parent
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", "hung-1", 1, 2)
    seen: list[dict] = []

    async def run_and_freeze() -> tuple[float, str]:
        task = asyncio.create_task(
            run_ranks(job, workdir, rdzv, seen.append, hang=HangWatch(factor=3, floor_s=3))
        )
        deadline = time.monotonic() + 120
        while not seen or seen[-1].get("step", 0) < 20:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        os.kill(job_processes(workdir / "job.json")[0], signal.SIGSTOP)  # one rank stalls
        frozen = time.monotonic()
        with pytest.raises(RanksFailed, match=r"hung at step \d+: no progress for \d+ s") as err:
            await asyncio.wait_for(task, 120)
        return time.monotonic() - frozen, str(err.value)

    waited, message = asyncio.run(run_and_freeze())
    limit = float(re.search(r"limit (\d+) s", message).group(1))
    # Noticed one limit after the freeze, then stopped within the 10 s grace (+ polling slack).
    assert waited < limit + 15, f"{waited:.0f} s from the freeze to stopped ranks: {message}"
    assert not job_processes(workdir / "job.json"), "a stopped rank survived"
    assert "Thread" in printed_stacks(workdir), "no stacks were recorded"
