"""What of a training library's logged values goes to `forgeline.report`, under which names."""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any

from forgeline.step import METRIC_NAME


def reportable(logged: Mapping[str, Any], renamed: Mapping[str, str]) -> dict[str, float]:
    """The finite numbers among `logged` (a 0-d tensor counts: `.item()` is taken), each under
    `renamed`'s name for it, else its own. The rest (strings, non-finite values, names MLflow
    would not take) is left out rather than refused: the library, not the user, logged them."""
    metrics = {}
    for name, value in logged.items():
        if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, Real):
            continue
        if not math.isfinite(float(value)):
            continue
        name = renamed.get(name, name)
        if METRIC_NAME.fullmatch(name):
            metrics[name] = float(value)
    return metrics
