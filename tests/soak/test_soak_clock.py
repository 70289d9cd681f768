"""The soak's two clocks: its events count seconds from its start, and a fault's recovery is
read against the runs' own records (epoch seconds) as the record's epoch plus those seconds."""

from __future__ import annotations

import time
from pathlib import Path

from bench.local_stack import LocalStack
from bench.soak import Soak
from bench.soak_plan import SoakPlan, SoakRecord


def test_an_event_s_epoch_is_when_it_was_noted(tmp_path: Path) -> None:
    """The record was made before the soak's clock started (run_soak applies the cluster's
    queues in between, seconds of CLI): its epoch moved every fault that much earlier, and
    every recovery came out that much longer."""
    plan = SoakPlan(seed=1, duration_s=60, mean_interval_s=20, outage_s=10, steps=10,
                    checkpoint_every=5, nodes=2, faults=[])  # fmt: skip
    record = SoakRecord(plan=plan, started_epoch=time.time() - 3.0)
    soak = Soak(LocalStack(tmp_path, {}), plan, record)
    time.sleep(0.2)
    soak.note("kill-agent", "node-0")
    noted_at = record.started_epoch + record.events[-1].at_s
    assert abs(noted_at - time.time()) < 0.1, noted_at - time.time()
