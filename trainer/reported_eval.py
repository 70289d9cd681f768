"""The evaluation of a run trained by a user's script: what the script itself measured.

The platform cannot score a model whose forward pass it does not know, so a user's script
reports its held-out loss through the SDK (`run.report_eval`) and every later checkpoint's
manifest carries the newest one. A script that reported none is judged on its last training
loss, and the result says so (`measured_on = "train"`): a trained model is never lost for want
of a curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.checkpoint_manifest import CheckpointManifest


@dataclass(frozen=True)
class ReportedEval:
    step: int
    val_loss: float
    val_tokens: int
    measured_on: str  # "held-out" (the script's report_eval) or "train" (its last train loss)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.val_loss, 700.0))


def reported_evaluation(manifest: CheckpointManifest) -> ReportedEval | None:
    """The script's newest held-out loss as of this checkpoint, else its last logged train
    loss; None when the manifest holds neither (or only non-finite values)."""
    found = manifest.evaluation
    if found is not None and math.isfinite(float(found.get("val_loss", math.nan))):
        return ReportedEval(
            int(found["step"]), float(found["val_loss"]), int(found.get("val_tokens", 0)),
            "held-out",
        )  # fmt: skip
    history = [(s, v) for s, v in manifest.loss_history if math.isfinite(v)]
    if history:
        step, loss = history[-1]
        return ReportedEval(step, loss, 0, "train")
    return None
