"""Who checks whom and who is named, from the gathered fingerprints (trainer.shadow_check); the
spec refuses shadow checks where there are no replicas to compare."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from trainer.shadow_check import (
    Ring,
    ShadowSettings,
    agree,
    disagreements,
    recompute,
    settle,
    ties_needed,
)
from workflows.contracts.spec import RunSpec

EXAMPLES = Path(__file__).parents[2] / "examples"
# (sum, sum of magnitudes, sum of squares)
GOOD, BAD, OTHER = (1.0, 3.0, 2.0), (1.02, 3.06, 2.0808), (7.0, 8.0, 9.0)


def test_the_ring_checks_across_nodes_and_finds_a_third_node() -> None:
    ring = Ring(world=8, ranks_per_node=2)  # 4 nodes
    assert [ring.checker_of(r) for r in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert all(ring.target_of(ring.checker_of(r)) == r for r in range(8))
    assert ring.node_of(ring.third(owner=0, checker=2)) not in (0, 1)
    one_node = Ring(world=3, ranks_per_node=3)
    assert [one_node.checker_of(r) for r in range(3)] == [1, 2, 0]
    assert one_node.third(owner=0, checker=1) == 2
    two_nodes = Ring(world=4, ranks_per_node=2)  # no third node: another rank decides
    assert two_nodes.third(owner=0, checker=2) in (1, 3)


def test_under_tensor_parallelism_a_rank_is_checked_by_its_position_in_another_group() -> None:
    ring = Ring(world=6, ranks_per_node=2, tensor=2)  # 3 nodes, a tensor group on each
    assert [ring.checker_of(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert ring.third(0, 2) == 4 and ring.third(1, 3) == 5
    one_node = Ring(world=6, ranks_per_node=6, tensor=2)
    assert [one_node.checker_of(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert one_node.third(1, 3) == 5
    # Tensor groups spanning nodes: the next node pair over.
    wide = Ring(world=8, ranks_per_node=1, tensor=2)
    assert wide.checker_of(0) == 2 and wide.checker_of(3) == 5 and wide.third(0, 2) == 4


def test_a_rank_wrong_in_its_own_work_and_in_its_check_is_named_without_a_tie() -> None:
    ring = Ring(world=3, ranks_per_node=1)
    own = [BAD, GOOD, GOOD]
    checked = [OTHER, GOOD, GOOD]  # rank 0 checks rank 2 (wrong), rank 1 checks rank 0
    found = disagreements(ring, own, checked, rtol=0)
    assert [(d.owner, d.checker) for d in found] == [(0, 1), (2, 0)]
    assert ties_needed(found, ring) == []
    verdict = settle(30, found, ring, {}, rtol=0)
    assert verdict is not None and verdict.ranks == [0]


@pytest.mark.parametrize(("tie", "named"), [(GOOD, [0]), (BAD, [1]), (OTHER, [])])
def test_one_disagreeing_pair_is_decided_by_a_third_rank(tie, named) -> None:
    ring = Ring(world=3, ranks_per_node=1)
    found = disagreements(ring, [BAD, GOOD, GOOD], [GOOD, GOOD, GOOD], rtol=0)
    assert ties_needed(found, ring) == [(0, 1)]
    verdict = settle(30, found, ring, {(0, 1): tie}, rtol=0)
    assert verdict is not None and verdict.ranks == named


def test_two_ranks_report_a_mismatch_but_name_no_one() -> None:
    ring = Ring(world=2, ranks_per_node=1)
    found = disagreements(ring, [BAD, GOOD], [GOOD, GOOD], rtol=0)
    assert ties_needed(found, ring) == []
    verdict = settle(30, found, ring, {}, rtol=0)
    assert verdict is not None and verdict.ranks == []
    assert "no third" in verdict.evidence


def test_agreement_is_bitwise_unless_a_tolerance_is_set() -> None:
    assert agree(GOOD, GOOD, 0) and not agree(GOOD, (1.0 + 1e-15, 3.0, 2.0), 0)
    assert agree(GOOD, (1.0 + 1e-7, 3.0, 2.0), 1e-6) and not agree(GOOD, BAD, 1e-3)


def test_a_tolerance_is_relative_to_what_does_not_cancel() -> None:
    """Gradients whose signed sum nearly cancels: a healthy recompute's last-bit drift is
    tiny beside their magnitudes (it agrees, though it is large beside the sum), while a
    gradient of flipped sign, which leaves the magnitudes and the squares as they were,
    moves the sum by twice its own size (it disagrees)."""
    own = (1e-9, 40.0, 3.0)
    drifted = (1e-9 + 4e-6, 40.0 * (1 + 1e-7), 3.0 * (1 - 1e-7))
    assert agree(own, drifted, 1e-6)
    flipped = (1e-9 - 2 * 0.1, 40.0, 3.0)  # one gradient of 0.1 with its sign flipped
    assert not agree(own, flipped, 1e-3)
    assert not agree(own, (1e-9, 40.0 * 1.01, 3.0), 1e-3)  # scaled magnitudes
    assert settle(5, [], Ring(3, 1), {}, 0) is None
    assert ShadowSettings(every=50).due(100) and not ShadowSettings().due(100)


def test_a_recompute_leaves_the_models_gradients_alone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loss_of(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(x), y)

    loss_of(model, x, y).backward()
    kept = [p.grad.clone() for p in model.parameters()]
    first = recompute(model, lambda: loss_of(model, x, y))
    assert first == recompute(model, lambda: loss_of(model, x, y))
    assert all(torch.equal(p.grad, k) for p, k in zip(model.parameters(), kept, strict=True))
    expected = sum(float(g.double().pow(2).sum()) for g in kept)
    assert first[2] == pytest.approx(expected, rel=1e-12)
    magnitudes = sum(float(g.double().abs().sum()) for g in kept)
    assert first[1] == pytest.approx(magnitudes, rel=1e-12)


def test_the_spec_refuses_shadow_checks_without_two_data_parallel_groups() -> None:
    spec = tomllib.loads((EXAMPLES / "tiny.toml").read_text())
    spec["recovery"] = {"shadow_every": 50}
    spec["resources"] = {**spec.get("resources", {}), "nodes": 2, "gpus_per_node": 2}
    for fine in ({}, {"shard": 4}, {"shard": 2, "tensor": 2}):  # DDP, FSDP, FSDP + TP
        RunSpec.model_validate({**spec, "parallel": fine})
    spec["resources"]["nodes"] = 1
    spec["parallel"] = {"tensor": 2}  # tensor parallelism alone: no other group to check with
    with pytest.raises(ValidationError, match=r"shadow_every \(50\) compares data-parallel"):
        RunSpec.model_validate(spec)
