"""When to checkpoint: steps, minutes, epochs, and the Young/Daly optimum."""

import pytest

from trainer.checkpoint_policy import FIRST_AUTO_SAVE_S, CheckpointPolicy, young_daly_interval_s
from workflows.contracts.spec import RecoverySpec, TrainSpec


def test_young_daly_matches_the_planning_arithmetic() -> None:
    # A 30 s save at an 8 h MTBF: √(2·30·28,800) − 30 ≈ 21.4 min (Young alone: 21.9 min).
    assert young_daly_interval_s(30, 8 * 3600) / 60 == pytest.approx(21.4, abs=0.05)
    assert young_daly_interval_s(0, 3600) == 0.0
    assert young_daly_interval_s(2000, 3600) == 3600  # cost ≥ MTBF / 2: once per MTBF


def test_500_nodes_at_six_months_fail_every_nine_hours() -> None:
    assert RecoverySpec().gang_mtbf_s(500) / 3600 == pytest.approx(8.76, abs=0.01)


def policy(**train: object) -> CheckpointPolicy:
    cfg = TrainSpec(**train).model_dump()
    return CheckpointPolicy.from_train_config(cfg, mtbf_s=8 * 3600)


def test_every_n_steps() -> None:
    every = policy(checkpoint_every=20)
    assert [s for s in range(1, 61) if every.due(s, 0.0, False)] == [20, 40, 60]


def test_every_m_minutes_and_each_epoch() -> None:
    timed = policy(checkpoint_every=10**6, checkpoint_every_minutes=5)
    assert not timed.due(7, 299.0, False) and timed.due(7, 300.0, False)
    epochs = policy(checkpoint_every=10**6, checkpoint_each_epoch=True)
    assert epochs.due(7, 0.0, epoch_ended=True) and not epochs.due(8, 0.0, epoch_ended=False)


def test_auto_measures_first_then_follows_the_cost() -> None:
    auto = policy(checkpoint_every="auto")
    assert auto.interval_s(None, None) == FIRST_AUTO_SAVE_S == 0.0
    assert auto.due(1, 0.0, False)  # the first step saves, to measure the cost
    # 0.1 s stall at an 8 h MTBF: every ~76 s; never sooner than the last save took to commit.
    assert auto.interval_s(0.1, 5.0) == pytest.approx(75.8, abs=0.1)
    assert auto.interval_s(0.1, 120.0) == 120.0
    # Minutes and auto together: the shorter wins.
    both = policy(checkpoint_every="auto", checkpoint_every_minutes=0.5)
    assert both.interval_s(0.1, 5.0) == 30.0


def test_auto_is_spelled_out_in_the_spec() -> None:
    with pytest.raises(ValueError, match="auto"):
        TrainSpec(checkpoint_every="sometimes")


def test_the_fleet_record_moves_the_mtbf_from_the_prior() -> None:
    recovery = RecoverySpec(node_mtbf_hours=100)
    assert recovery.gang_mtbf_s(2) == pytest.approx(50 * 3600)  # no record: the prior
    # Young fleet, two deaths in an hour of node time: not "every half hour".
    young = recovery.gang_mtbf_s(1, node_seconds=3600, failures=2)
    assert young == pytest.approx(101 * 3600 / 3)
    # A long record outweighs the guess: 10,000 node-hours, 400 deaths → about 25 hours.
    seasoned = recovery.gang_mtbf_s(1, node_seconds=10_000 * 3600, failures=400)
    assert seasoned / 3600 == pytest.approx(25.2, abs=0.1)
