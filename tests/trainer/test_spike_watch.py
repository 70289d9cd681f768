"""The suspect watch on gradient norms as the ranks gather them: a rank whose own norm jumps
is named, a spike of the whole run is not blamed on a rank, and noisy clean runs raise
nothing."""

from __future__ import annotations

import math
import random

from trainer.spike_watch import SpikeSettings, SpikeWatch

ON = SpikeSettings(mads=10.0, window=50)


def noisy_run(ranks: int, steps: int, seed: int, scales: list[float] | None = None):
    """Per step, each rank's norm: a curve falling from 5 to 1 as training goes, times each
    rank's own scale (its shards under TP), times batch-to-batch noise (~25 %)."""
    draw = random.Random(seed)
    scales = scales or [1.0] * ranks
    for step in range(1, steps + 1):
        curve = 1.0 + 4.0 * math.exp(-step / 150)
        yield step, [curve * s * math.exp(draw.gauss(0.0, 0.25)) for s in scales]


def watched(watch: SpikeWatch, series, corrupt=lambda step, norms: norms):
    found = []
    for step, norms in series:
        found += watch.add(step, corrupt(step, norms))
    return found


def test_clean_noisy_runs_raise_nothing() -> None:
    for seed in range(5):
        assert watched(SpikeWatch(ON, 4), noisy_run(4, 2_000, seed)) == []
        assert watched(SpikeWatch(ON, 2), noisy_run(2, 2_000, seed)) == []
        assert watched(SpikeWatch(ON, 1), noisy_run(1, 2_000, seed)) == []


def times(rank: int, at: int, factor: float):
    def corrupt(step: int, norms: list[float]) -> list[float]:
        return [n * factor if step == at and r == rank else n for r, n in enumerate(norms)]

    return corrupt


def test_a_rank_whose_own_norm_jumps_is_named() -> None:
    (spike,) = watched(SpikeWatch(ON, 4), noisy_run(4, 600, 1), times(2, 300, 40.0))
    assert (spike.step, spike.rank) == (300, 2)
    assert spike.mads > 10
    assert "rank 2's own gradient norm" in spike.describe(ranks_per_node=2)
    assert "(node index 1)" in spike.describe(ranks_per_node=2)
    # Two replicas: the ratio between them moves for both; only the one whose own history
    # moved too is named.
    (spike,) = watched(SpikeWatch(ON, 2), noisy_run(2, 600, 1), times(0, 300, 100.0))
    assert (spike.step, spike.rank) == (300, 0)
    # A norm that collapses is as suspect as one that jumps.
    (spike,) = watched(SpikeWatch(ON, 4), noisy_run(4, 600, 2), times(3, 300, 1 / 40))
    assert (spike.step, spike.rank) == (300, 3)


def test_shards_of_different_sizes_are_each_compared_with_themselves() -> None:
    """Under TP a rank's norm is of its own shards: steadily larger or smaller than
    the others', which is no finding; a change of its ratio to them is."""
    scales = [1.0, 6.0, 0.2, 2.5]
    assert watched(SpikeWatch(ON, 4), noisy_run(4, 1_000, 3, scales)) == []
    (spike,) = watched(SpikeWatch(ON, 4), noisy_run(4, 600, 3, scales), times(1, 400, 30.0))
    assert (spike.step, spike.rank) == (400, 1)


def test_a_spike_of_the_whole_run_names_no_rank() -> None:
    def everyone(step: int, norms: list[float]) -> list[float]:
        return [n * 50.0 if step == 250 else n for n in norms]

    (spike,) = watched(SpikeWatch(ON, 4), noisy_run(4, 500, 4), everyone)
    assert (spike.step, spike.rank) == (250, None)
    assert spike.describe(ranks_per_node=1).startswith("the gradient norm of every rank")
    # One rank alone cannot tell its device from its data: its spike is the run's.
    (spike,) = watched(SpikeWatch(ON, 1), noisy_run(1, 500, 4), everyone)
    assert (spike.step, spike.rank) == (250, None)


def test_nothing_is_judged_off_early_or_non_finite() -> None:
    off = SpikeWatch(SpikeSettings(), 4)
    assert watched(off, noisy_run(4, 400, 5), times(0, 300, 1_000.0)) == []
    # Before a full window of steps there is no median to stand out from.
    early = SpikeWatch(ON, 4)
    assert watched(early, noisy_run(4, 5, 5), times(0, 3, 1_000.0)) == []
    # A NaN step is the NaN check's (trainer.grad_watch.suspects), not this watch's.
    watch = SpikeWatch(ON, 4)
    watched(watch, noisy_run(4, 100, 5))
    assert watch.add(101, [1.0, math.nan, 1.0, 1.0]) == []


def losses_of(ranks: int, steps: int, seed: int, offset: float = 0.0):
    """Per step, each rank's loss on its own micro-batch: falling from 4 to 1.5, ±0.1 from batch
    to batch; `offset` moves it (a script's own objective may be negative)."""
    draw = random.Random(seed)
    for step in range(1, steps + 1):
        curve = 1.5 + 2.5 * math.exp(-step / 200) + offset
        yield step, [curve + draw.gauss(0.0, 0.1) for _ in range(ranks)]


def with_losses(watch: SpikeWatch, series, corrupt=lambda step, losses: losses):
    """Steady norms, so only the losses can raise anything."""
    found = []
    for step, losses in series:
        found += watch.add(step, [1.0] * len(losses), corrupt(step, losses))
    return found


def test_a_rank_whose_own_loss_jumps_is_named() -> None:
    assert with_losses(SpikeWatch(ON, 4), losses_of(4, 1_500, 6)) == []
    assert with_losses(SpikeWatch(ON, 4), losses_of(4, 1_500, 6, offset=-10.0)) == []

    def wrong_forward(step: int, losses: list[float]) -> list[float]:
        return [
            loss + 3.0 if (step, rank) == (400, 1) else loss for rank, loss in enumerate(losses)
        ]

    (spike,) = with_losses(SpikeWatch(ON, 4), losses_of(4, 600, 6, offset=-10.0), wrong_forward)
    assert (spike.step, spike.rank, spike.signal) == (400, 1, "loss")
    assert spike.describe(ranks_per_node=1).startswith("rank 1's own loss ")
    # A rank that reports no loss (NaN in the gathered table) leaves the norms watched alone.
    watch = SpikeWatch(ON, 2)
    assert with_losses(watch, ((s, [math.nan, math.nan]) for s in range(1, 200))) == []
