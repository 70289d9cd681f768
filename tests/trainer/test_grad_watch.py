"""Naming the replica whose gradients went bad, from every replica's norm before the all-reduce."""

from __future__ import annotations

import math

from trainer.grad_watch import suspects

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
