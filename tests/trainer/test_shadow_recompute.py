"""Shadow recompute on real torchrun ranks (gloo, CPU: bitwise), under DDP, FSDP and FSDP with
tensor parallelism: a clean run with dropout and gradient accumulation passes every check;
gradients 2 % off on one rank, for one checked step, name that rank, fail the attempt before
anything is saved and mark its work suspect from the last passed check, and the run resumed
from before it ends where a clean run ends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer.conftest import MODEL, Trainer
from tests.trainer.test_distributed_training import resume_point
from trainer.attempt_clock import ledger_key
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import RanksFailed
from trainer.manifest import commits, find_latest, manifest_key, read_manifest
from workflows.contracts.spec import RecoverySpec, TrainSpec

TRAIN = TrainSpec(
    steps=40, batch_size=12, grad_accum_steps=2, learning_rate=3e-3, warmup_steps=5,
    log_every=10, checkpoint_every=10, keep_checkpoints=2, seed=7,
)  # fmt: skip
DROPOUT = MODEL.model_copy(update={"dropout": 0.1})  # the recompute must draw the owner's masks
SHADOW = RecoverySpec(shadow_every=10).shadow_settings()
NODES = 3  # a pair that disagrees has a third node to decide
LAYOUTS = {
    "ddp": {"replicate": 3, "shard": 1, "tensor": 1},
    "fsdp": {"replicate": 1, "shard": 3, "tensor": 1},
    # A tensor-parallel pair on each node: rank 0 is checked by rank 2, its position on the next.
    "fsdp-tp": {"replicate": 1, "shard": 3, "tensor": 2},
}


def ranks(layout: str) -> int:
    return math.prod(LAYOUTS[layout].values())


def events(job, kind: str) -> list[dict]:
    lines = Path(job.progress_file).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def weights(manifest: CheckpointManifest) -> dict[str, str]:
    """The checkpoint's tensor files by name (not by key: the run and generation differ), with
    their sha256 (DCP's `.metadata` names the run's own paths)."""
    named = {f.key.rsplit("/", 1)[1]: f.sha256 for f in manifest.files}
    return {name: digest for name, digest in named.items() if not name.startswith(".")}


# FSDP (~45 s) and FSDP + TP (six ranks, ~60 s) run with the slow tests, to keep `make test`
# within 15 minutes: the DDP case here covers the recompute and its roll-back, and
# tests/trainer/test_shadow_check.py which rank of another group checks which.
@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n != "ddp" else n for n in LAYOUTS],
)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def clean(trainer: Trainer, layout: str) -> CheckpointManifest:
    """A clean run's last manifest: what the rolled-back run must end at, bitwise."""
    name = f"shadow-clean-{layout}"
    job = trainer.job(name, TRAIN, model=DROPOUT, shadow=SHADOW, nodes=NODES,
                      layout=LAYOUTS[layout])  # fmt: skip
    trainer.run(job, ranks=ranks(layout))
    assert events(job, "health") == []  # four checks, no verdict, no suspect
    ledger = json.loads(trainer.store.get_bytes(ledger_key(name, 1)))
    assert ledger["last"]["totals"]["shadow_s"] > 0  # goodput puts it down to its own cause
    found = find_latest(trainer.store, name, max_generation=1)
    assert found is not None and found.step == TRAIN.steps
    assert found.manifest.layout["strategy"].replace("+", "-") == layout
    return found.manifest


def resumed_from_10(trainer: Trainer, name: str, layout: str) -> CheckpointManifest:
    """Generation 2 of the run, from its checkpoint at step 10 to the end: its last manifest."""
    key = manifest_key(name, 10, generation=1)
    resume = resume_point(trainer, read_manifest(trainer.store, key), name, key)
    again = trainer.job(name, TRAIN, model=DROPOUT, shadow=SHADOW, nodes=NODES,
                        resume=resume, generation=2, layout=LAYOUTS[layout])  # fmt: skip
    trainer.run(again, ranks=ranks(layout))
    found = find_latest(trainer.store, name, max_generation=2)
    assert found is not None and found.step == TRAIN.steps
    return found.manifest


def test_a_clean_run_passes_every_check(clean: CheckpointManifest) -> None:
    assert [step for step, _ in clean.loss_history] == [10, 20, 30, 40]


def test_the_checks_change_nothing_the_run_computes(
    trainer: Trainer, clean: CheckpointManifest, layout: str
) -> None:
    """The same run without checks ends bitwise where the checked one did: a recompute draws
    from a forked RNG and leaves the step's gradients (FSDP: its sharded ones) as they were."""
    name = f"shadow-off-{layout}"
    job = trainer.job(name, TRAIN, model=DROPOUT, nodes=NODES, layout=LAYOUTS[layout])
    trainer.run(job, ranks=ranks(layout))
    unchecked = find_latest(trainer.store, name, max_generation=1)
    assert unchecked is not None
    assert unchecked.manifest.loss_history == clean.loss_history
    assert weights(unchecked.manifest) == weights(clean)


def verdict_at_30(
    trainer: Trainer, name: str, order: str, layout: str, **fields: object
) -> list[dict]:
    """Run with a `forgeline chaos` order for rank 0 (the node's first rank) until the check at
    step 30 names it; the attempt's health events."""
    job = trainer.job(name, TRAIN, shadow=SHADOW, nodes=NODES, layout=LAYOUTS[layout], **fields)
    job.chaos_file = str(Path(job.progress_file).parent / "CORRUPT_GRAD")
    Path(job.chaos_file).parent.mkdir(parents=True, exist_ok=True)
    Path(job.chaos_file).write_text(order + "\n")
    with pytest.raises(RanksFailed, match=r"shadow recompute at step 30 named ranks \[0\]"):
        trainer.run(job, ranks=ranks(layout))
    return events(job, "health")


def test_gradients_two_percent_off_name_their_rank_and_roll_back(
    trainer: Trainer, clean: CheckpointManifest, layout: str
) -> None:
    # What `forgeline chaos corrupt-grad n0 --finite --scale 1.02 --at-step 30` writes: rank 0
    # computes its gradients 2 % too large at step 30, a checked step (the first buffer it
    # reduces: DDP's first bucket, FSDP's last block, before the reduction).
    name = f"shadow-bad-{layout}"
    suspect, corruption = verdict_at_30(trainer, name, "corrupt-grad 30 1.02", layout,
                                        model=DROPOUT)  # fmt: skip
    verdict = (corruption["kind"], corruption["rank"], corruption["node_index"])
    assert verdict == ("corruption", 0, 0)
    assert (corruption["action"], corruption["step"]) == ("quarantine", 30)
    # Rank 0's checker and the third are the same position on the next two nodes.
    checker, third = (2, 4) if LAYOUTS[layout]["tensor"] == 2 else (1, 2)
    assert f"rank {third}'s recompute agrees with rank {checker}'s" in corruption["evidence"]
    # The check at step 20 passed; the update it was followed by is the first unverified work.
    assert (suspect["kind"], suspect["rank"], suspect["step"]) == ("suspect", 0, 20)
    # Nothing was saved at or after the corrupt step; the rollback (to before step 20) finds 10
    # kept, though keep_checkpoints = 2 would have pruned it after 20 and a save at 30.
    assert sorted(c.step for c in commits(trainer.store, name)) == [10, 20]

    final = resumed_from_10(trainer, name, layout)
    # Bitwise the clean run: the same steps from the same (clean) checkpoint, resumed exactly;
    # nothing of the corrupt attempt.
    assert final.loss_history == clean.loss_history
    assert weights(final) == weights(clean)


def test_a_flipped_low_bit_in_one_weight_is_named_at_the_next_check(trainer: Trainer) -> None:
    """`forgeline chaos flip-bit n0 --at-step 23`: rank 0's copy of one weight is off in its last
    bit from step 23 on; the check at step 30 finds its own gradients differ from rank 1's
    recompute of them, and rank 2's recompute (a third node) says which of the two is wrong.
    (Its recompute of rank 2's micro-batch may well agree: one bit of one embedding weight
    changes only what that token touches, and rounding swallows the rest.)"""
    suspect, corruption = verdict_at_30(trainer, "shadow-flip", "flip-bit 23", "ddp")
    assert (suspect["kind"], suspect["rank"], suspect["step"]) == ("suspect", 0, 20)
    assert (corruption["kind"], corruption["rank"], corruption["step"]) == ("corruption", 0, 30)
    evidence = corruption["evidence"]
    assert "rank 0's own gradients" in evidence and "from rank 1's recompute" in evidence
    assert "rank 2's recompute agrees with rank 1's" in evidence


def test_two_ranks_that_disagree_roll_back_without_blaming_either(trainer: Trainer) -> None:
    """With two ranks nobody can say whose computation was wrong, but the step is known to be
    wrong: the attempt fails before anything of it is saved (the run resumes from its last
    committed checkpoint, as the soak's scaled-gradient runs showed it must: reported and
    trained on, their weights were not their fault-free twin's), and no node is named."""
    name = "shadow-two"
    job = trainer.job(name, TRAIN, shadow=SHADOW, nodes=2,
                      layout={"replicate": 2, "shard": 1, "tensor": 1})  # fmt: skip
    job.chaos_file = str(Path(job.progress_file).parent / "CORRUPT_GRAD")
    Path(job.chaos_file).parent.mkdir(parents=True, exist_ok=True)
    Path(job.chaos_file).write_text("corrupt-grad 30 1.5\n")
    with pytest.raises(RanksFailed, match=r"no rank could be named .* rolling back to the last"):
        trainer.run(job, ranks=2)
    (mismatch,) = events(job, "health")
    assert (mismatch["kind"], mismatch["action"], mismatch["step"]) == (
        "shadow-mismatch", "rollback", 30,
    )  # fmt: skip
    assert mismatch["rank"] is None and "no third" in mismatch["evidence"]
    assert sorted(c.step for c in commits(trainer.store, name)) == [10, 20]
