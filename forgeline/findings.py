"""What the ranks find about their nodes, written for the node agent to pass to the run: a
straggler, or the ranks whose own gradients went non-finite (trainer.grad_watch)."""

from __future__ import annotations

import math

from trainer.grad_watch import suspects
from trainer.progress import ProgressFile
from trainer.shadow_check import Verdict
from trainer.spike_watch import Spike


class Findings:
    def __init__(self, progress: ProgressFile, ranks_per_node: int) -> None:
        self.progress = progress
        self.ranks_per_node = ranks_per_node

    def health(
        self, kind: str, step: int, rank: int | None, action: str, evidence: str, **more: object
    ) -> None:
        """A finding about one rank's node (the agent maps its index to the node's id), or,
        with no rank, about the whole gang."""
        node_index = None if rank is None else rank // self.ranks_per_node
        self.progress.write(
            event="health", kind=kind, step=step, rank=rank, node_index=node_index,
            action=action, evidence=evidence, **more,
        )  # fmt: skip

    def suspect(self, spike: Spike) -> None:
        """A finite outlier (trainer.spike_watch): recorded and shown, not yet a verdict."""
        kind = "suspect" if spike.rank is not None else "spike"
        evidence = spike.describe(self.ranks_per_node)
        self.health(kind, spike.step, spike.rank, "report", evidence, mads=round(spike.mads, 1))

    def shadow_verdict(self, verdict: Verdict, since: int) -> str:
        """A shadow check named ranks: each is quarantined, and marked suspect from the first
        step no check verified (the rollback goes back past it, workflows.suspect_rollback).
        Returns why this attempt fails."""
        for rank in verdict.ranks:
            self.health(
                "suspect", since, rank, "report",
                f"rank {rank}'s work is unverified from step {since}, after the last shadow "
                f"check it passed; at step {verdict.step} it failed one",
            )  # fmt: skip
            self.health("corruption", verdict.step, rank, "quarantine",
                        f"shadow recompute at step {verdict.step}: {verdict.evidence}")  # fmt: skip
        return (
            f"a shadow recompute at step {verdict.step} named ranks {verdict.ranks}: rolling "
            f"back to a checkpoint from before step {since}"
        )

    def shadow_unattributed(self, verdict: Verdict) -> str:
        """A shadow check disagreed and named no rank: reported, and returns why this attempt
        fails (the step is wrong; which device made it so is not known, so none is blamed)."""
        self.health("shadow-mismatch", verdict.step, None, "rollback", verdict.evidence)
        return (
            f"a shadow recompute at step {verdict.step} disagreed and no rank could be named "
            f"({verdict.evidence}): rolling back to the last committed checkpoint, no node "
            "blamed. Again at the same step after the rollback, it is the kernels, not a "
            "device: raise recovery.shadow_rtol; three nodes or more name the rank"
        )

    def non_finite(self, step: int, grad_norms: list[float]) -> str:
        """The gang saw NaN or inf at `step`: name the ranks whose own gradients made it (to
        be quarantined), and return why this attempt fails."""
        bad = suspects(grad_norms)
        for rank in bad:
            norm = grad_norms[rank]
            what = "non-finite" if not math.isfinite(norm) else f"far larger ({norm:.3g})"
            self.health(
                "corruption", step, rank, "quarantine",
                f"rank {rank}'s own gradients were {what} before the all-reduce at step "
                f"{step} (norms by rank: {grad_norms})",
            )  # fmt: skip
        culprits = f"suspect ranks {bad}" if bad else "on every rank: divergence?"
        return (
            f"non-finite loss or gradients at step {step} ({culprits}): "
            "rolling back to the last committed checkpoint"
        )
