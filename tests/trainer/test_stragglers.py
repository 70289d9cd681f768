"""Stragglers: a rank persistently slower than its gang is named, with evidence, and (policy
`swap`) the gang checkpoints and stops so the run can continue without its node."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from infra.throttle import throttle
from tests.trainer.conftest import Trainer
from tests.trainer.test_layouts import TRAIN
from trainer.attempt_clock import read_ledger
from trainer.manifest import committed_steps
from trainer.stragglers import StragglerWatch


def feed(watch: StragglerWatch, rows: list[list[float]], start: int = 1):
    verdicts = [watch.add(start + i, row, step_s=0.1) for i, row in enumerate(rows)]
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
                argv = (proc / "cmdline").read_bytes()
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            is_rank = job_file in argv and b"torch.distributed.run" not in argv
            if is_rank and f"RANK={rank}".encode() in env:
                return int(proc.name)
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} for {workdir}")


def test_a_throttled_rank_is_swapped_out_after_a_checkpoint(trainer: Trainer) -> None:
    """Rank 1 runs at a quarter of its speed (SIGSTOP/SIGCONT, nothing in the trainer knows): the
    gang names it, checkpoints, and stops with the evidence as its reason."""
    long = TRAIN.model_copy(update={"steps": 100_000, "checkpoint_every": 50})
    # Twice as slow: a busy CPU makes one rank 1.5× slower for a few steps now and then.
    watch = {"window": 5, "factor": 2.0, "windows": 2}
    job = trainer.job("slow", long, stragglers={"policy": "swap", "watch": watch})
    workdir = Path(job.progress_file).parent

    async def run_with_a_slow_rank():
        task = await trainer.start_until_committed(job, ranks=2)
        slow = rank_pid(workdir, rank=1)
        stop = time.monotonic() + 120
        thread = threading.Thread(target=throttle, args=([slow], 4.0, stop), daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(task, 120)
        finally:
            thread.join()

    tail = asyncio.run(run_with_a_slow_rank())
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
