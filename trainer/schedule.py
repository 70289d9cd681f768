"""Learning rate: linear warmup, then cosine decay to min_lr; a function of the step only."""

from __future__ import annotations

import math


def learning_rate(step: int, peak: float, minimum: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    if step >= total:
        return minimum
    progress = (step - warmup) / max(1, total - warmup)
    return minimum + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - minimum)
