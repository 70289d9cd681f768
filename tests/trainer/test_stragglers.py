"""Stragglers: a rank persistently slower than its gang is named, with evidence, and (policy
`swap`) the gang checkpoints and stops so the run can continue without its node."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from infra.throttle import throttle
from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN
from trainer.attempt_clock import read_ledger
from trainer.job import TrainJob
from trainer.manifest import committed_steps
from trainer.progress_tail import ProgressTail
from trainer.stragglers import DeviceForwardTimer, ForwardTimer, StragglerWatch, forward_timer


def test_a_cpu_forward_is_timed_by_the_host_s_clock_and_a_gpu_s_by_the_device_s() -> None:
    """The timer is chosen by the device type; on CPU it sums the host clock's spans around
    each forward (a clock of the test's, so nothing here depends on how fast it runs)."""
    assert type(forward_timer(torch.device("cpu"))) is ForwardTimer
    assert isinstance(forward_timer(torch.device("cuda")), DeviceForwardTimer)  # no event yet
    ticks = iter([1.0, 1.5, 4.0, 4.25])
    timer = ForwardTimer(clock=lambda: next(ticks))
    assert timer.seconds() == 0.0
    for _ in range(2):  # two micro-batches' forwards
        timer.start()
        timer.stop()
    assert timer.seconds() == 0.75


def feed(watch: StragglerWatch, rows: list[list[float]], start: int = 1):
    verdicts = [
        watch.add(start + i, row, step_s=0.1, gang_step_s=0.1) for i, row in enumerate(rows)
    ]
    return [v for v in verdicts if v is not None]


def test_noise_and_one_slow_window_are_not_a_straggler() -> None:
    watch = StragglerWatch(window=4, factor=1.5, windows=2)
    jitter = [[0.010, 0.011], [0.012, 0.010], [0.010, 0.030], [0.011, 0.010]]  # one slow step
    assert feed(watch, jitter * 5) == []
    assert feed(watch, [[0.010, 0.030]] * 4) == []  # one slow window
    assert feed(watch, [[0.010, 0.010]] * 4) == []  # and back to normal: the streak resets
    assert feed(watch, [[0.010, 0.030]] * 4) == []


def test_a_persistently_slow_rank_is_named_once_with_its_evidence() -> None:
    watch = StragglerWatch(window=4, factor=1.5, windows=3)
    verdicts = feed(watch, [[0.010, 0.010, 0.031, 0.011]] * 12)
    assert len(verdicts) == 1
    found = verdicts[0]
    assert (found.rank, found.step, round(found.ratio, 1)) == (2, 12, 3.1)
    assert len(found.evidence) == 3 and all(row[2] == 0.031 for row in found.evidence)
    assert "rank 2 (node index 1) is 3.1× slower" in found.describe(ranks_per_node=2)
    # Had it kept the others' pace (0.010 s), each window (0.4 s of steps) would have been 3.1×
    # shorter: the rest was waiting for it.
    assert watch.lost_s == pytest.approx(3 * 0.4 * (1 - 1 / 3.1))


def test_under_a_pipeline_a_rank_is_compared_with_its_own_stage() -> None:
    """Stage 1 (ranks 2 and 3) computes the loss and is slower than stage 0 by nature: no
    straggler. Rank 3 slower than its stage's other rank is one, named with its stage."""
    watch = StragglerWatch(window=4, factor=1.5, windows=2, peers=[0, 0, 1, 1])
    assert feed(watch, [[0.010, 0.011, 0.030, 0.031]] * 16) == []
    verdicts = feed(watch, [[0.010, 0.011, 0.030, 0.070]] * 8, start=17)
    assert [(v.rank, v.stage, round(v.ratio, 1)) for v in verdicts] == [(3, 1, 2.3)]
    assert "than the other ranks of pipeline stage 1" in verdicts[0].describe(ranks_per_node=1)
    alone = StragglerWatch(window=4, factor=1.5, windows=1, peers=[0, 1])
    assert feed(alone, [[0.010, 0.090]] * 8) == []  # a stage of one rank has no yardstick


def test_a_window_of_short_steps_spans_its_seconds() -> None:
    """Twenty 25 ms steps are half a second: a healthy rank starved for a second (a process
    starting beside it) would fill two such windows. A window of 2 s needs most of it slow."""
    watch = StragglerWatch(window=4, factor=1.5, windows=2, min_window_s=2.0)
    starved = [[0.050, 0.025]] * 40  # rank 0 twice as slow for 40 steps of 25 ms = 1 s
    healthy = [[0.025, 0.025]] * 120
    verdicts = [
        watch.add(i, row, step_s=0.025, gang_step_s=0.025)
        for i, row in enumerate(healthy + starved + healthy)
    ]
    assert [v for v in verdicts if v is not None] == []
    # Without the seconds, the same second names rank 0.
    steps_only = StragglerWatch(window=4, factor=1.5, windows=2)
    verdicts = [
        steps_only.add(i, row, step_s=0.025, gang_step_s=0.025)
        for i, row in enumerate(healthy + starved)
    ]
    assert {v.rank for v in verdicts if v is not None} == {0}
    # A slow-down that lasts is still found, once two windows of 2 s have closed on it.
    watch = StragglerWatch(window=4, factor=1.5, windows=2, min_window_s=2.0)
    verdicts = [
        watch.add(i, row, step_s=0.125, gang_step_s=0.125)
        for i, row in enumerate([[0.025, 0.125]] * 40)
    ]
    found = [(i, v.rank) for i, v in enumerate(verdicts) if v is not None]
    assert found[0] == (31, 1)  # 16 steps of 0.125 s a window: 2 windows end at the 32nd step


def test_every_rank_closes_its_windows_at_the_same_step() -> None:
    """Two ranks whose own clocks differ (one waited in the collective, one did not) still
    reach their verdict at the same step: the span is the gang's, not the rank's. (Found in the
    straggler e2e: a rank that checkpointed one step before the other hung the gang.)"""
    rows = [[0.025, 0.125]] * 60
    verdicts = []
    for own_s in (0.13, 0.03):  # rank 0 waits for the slow rank, rank 1 does not
        watch = StragglerWatch(window=4, factor=1.5, windows=2, min_window_s=2.0)
        found = [watch.add(i, r, step_s=own_s, gang_step_s=0.13) for i, r in enumerate(rows)]
        verdicts.append([(v.step, v.rank) for v in found if v is not None])
    assert verdicts[0] == verdicts[1] and verdicts[0]


def test_one_rank_has_no_one_to_be_slower_than() -> None:
    watch = StragglerWatch(window=2, factor=1.5, windows=1)
    assert feed(watch, [[0.5]] * 10) == [] and watch.lost_s == 0


def rank_pid(workdir: Path, rank: int, timeout: float = 60) -> int:
    """The pid of one rank of the job whose files are in `workdir` (not its torchrun)."""
    job_file = str(workdir / "job.json").encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            # A rank names itself with its job and rank (trainer.entry.as_a_fresh_rank).
            if job_file in cmdline and f"(rank {rank})".encode() in cmdline:
                return int(proc.name)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} for {workdir}")


def with_a_slow_rank(
    trainer: Trainer, job: TrainJob, ranks: int, slow: int, limit_s: float
) -> ProgressTail:
    """Run the job on `ranks` ranks, rank `slow` at a quarter of its speed once the first
    checkpoint has committed (SIGSTOP/SIGCONT: nothing in the trainer knows)."""

    async def run() -> ProgressTail:
        task = await trainer.start_until_committed(job, ranks=ranks)
        pid = rank_pid(Path(job.progress_file).parent, rank=slow)
        stop = time.monotonic() + limit_s
        thread = threading.Thread(target=throttle, args=([pid], 4.0, stop), daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(task, limit_s)
        finally:
            thread.join()

    return asyncio.run(run())


@pytest.mark.slow
def test_a_throttled_rank_of_a_pipeline_stage_is_named(trainer: Trainer) -> None:
    """Two stages of two replicas each (4 ranks); rank 3, of stage 1, at a quarter of its
    speed: its stage's other rank outpaces it, and it is named against that stage."""
    long = TRAIN.model_copy(update={"steps": 100_000, "checkpoint_every": 50})
    watch = {"window": 5, "factor": 2.0, "windows": 2}
    layout = {"replicate": 2, "shard": 1, "tensor": 1, "pipeline": 2, "schedule": "1F1B",
              "stages_per_rank": 1, "microbatches": 2}  # fmt: skip
    job = trainer.job("slow-stage", long, layout=layout,
                      stragglers={"policy": "swap", "watch": watch})  # fmt: skip
    tail = with_a_slow_rank(trainer, job, ranks=4, slow=3, limit_s=150)
    reason = tail.latest["stop_reason"]
    assert tail.stopped and reason.startswith("straggler: rank 3 (node index 0) is"), reason
    assert "slower than the other ranks of pipeline stage 1" in reason


def test_a_throttled_rank_is_swapped_out_after_a_checkpoint(trainer: Trainer) -> None:
    """Rank 1 runs at a quarter of its speed (SIGSTOP/SIGCONT, nothing in the trainer knows): the
    gang names it, checkpoints, and stops with the evidence as its reason."""
    long = TRAIN.model_copy(update={"steps": 100_000, "checkpoint_every": 50})
    # Twice as slow: a busy CPU makes one rank 1.5× slower for a few steps now and then.
    watch = {"window": 5, "factor": 2.0, "windows": 2}
    job = trainer.job("slow", long, stragglers={"policy": "swap", "watch": watch})
    tail = with_a_slow_rank(trainer, job, ranks=2, slow=1, limit_s=120)
    reason = tail.latest["stop_reason"]
    assert tail.stopped and reason.startswith("straggler: rank 1 (node index 0)"), reason
    events = [json.loads(line) for line in Path(job.progress_file).read_text().splitlines()]
    health = [e for e in events if e["event"] == "health"]
    assert len(health) == 1 and health[0]["rank"] == 1 and health[0]["ratio"] > 2.0
    stopped_at = events[-1]["step"]
    assert stopped_at in committed_steps(trainer.store, "slow")  # nothing is lost by the swap
    ledger = read_ledger(trainer.store, "slow", 1)
    assert ledger is not None and ledger.ended.startswith("stopped: straggler")
    assert ledger.last.totals.straggler_s > 0  # the time the gang waited for it is accounted
