"""Naming the replica whose gradients went bad, from every replica's norm before the all-reduce."""

from __future__ import annotations

import math
from pathlib import Path

from trainer.grad_watch import ChaosPoison, suspects

NAN = math.nan


def test_a_non_finite_replica_among_finite_ones_is_named() -> None:
    assert suspects([1.2, NAN, 0.9]) == [1]
    assert suspects([NAN, 0.8]) == [0]
    assert suspects([math.inf, 1.0, NAN, 1.1]) == [0, 2]


def test_every_replica_alike_is_divergence_not_a_machine() -> None:
    assert suspects([NAN, NAN]) == []
    assert suspects([1e9, 1.1e9, 0.9e9]) == []  # all huge together: the run diverges


def test_a_huge_norm_needs_a_majority_to_call_it_an_outlier() -> None:
    assert suspects([1.0, 500.0, 1.2, 0.9]) == [1]
    assert suspects([1.0, 50.0, 1.2]) == []  # different batches differ; not 100× apart
    assert suspects([1.0, 500.0]) == []  # two replicas: which one is normal?


def test_a_chaos_order_scales_every_buffer_of_its_steps_first_micro_batch(tmp_path: Path) -> None:
    """`corrupt-grad --finite --scale 1.02 --at-step 5`: each bucket (DDP) or block (FSDP)
    reduced in step 5's first micro-batch, and nothing else, ever again."""
    order = tmp_path / "CHAOS"
    order.write_text("corrupt-grad 5 1.02\n")
    now = {"step": 4, "micro": 1}
    poison = ChaosPoison(order, lambda: now["step"], lambda: now["micro"])
    assert poison() is None and order.exists()  # not due yet
    now["step"] = 5
    assert [poison(), poison()] == [1.02, 1.02] and not order.exists()  # two buffers
    now["micro"] = 2
    assert poison() is None  # the step's second micro-batch is computed right
    now.update(step=6, micro=1)
    assert poison() is None
