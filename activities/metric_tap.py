"""The ranks' metrics on their way to MLflow: every step and eval line of a rank's progress
file, spooled (`registry.metric_stream`) for the node's shipper to deliver while it trains."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio import activity

from registry.metric_stream import MetricSpool
from trainer.rank_lines import BoundedLines, line_cap, read_to_end

# Fields of the ranks' step lines and the MLflow metrics they become.
_STEP_METRICS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    # The share of the step the ranks spent in the SDK's own code: what the platform costs.
    "sdk_share": "train/sdk_share",
}


class MetricTap:
    """Reads every new complete line of the progress file (the ProgressTail keeps only the
    newest state) and spools its metrics for MLflow, stamped with the time the ranks wrote them.
    Re-reading the file of an earlier attempt of the generation spools the same points again,
    which MLflow stores once. The ranks write the file: it is read in bounded polls, a line too
    long passed over (trainer.rank_lines; the ProgressTail warns of it), an odd one skipped."""

    def __init__(self, progress_file: Path, spool: MetricSpool, world: int = 1) -> None:
        self.path = progress_file
        self.spool = spool
        self.lines = BoundedLines(progress_file, line_cap(world), warn=False)

    def poll(self) -> None:
        """Spool the lines of one bounded read."""
        try:
            self._poll()
        except Exception:  # a tracking fault never reaches the ranks or the heartbeat
            activity.logger.warning("could not spool training metrics", exc_info=True)

    def drain(self) -> None:
        """Once the ranks are gone: the lines they left, to the file's end (bounded)."""
        read_to_end(self.poll, self.lines)

    def _poll(self) -> None:
        for line in self.lines.poll():
            try:
                event = json.loads(line)
                kind = event.get("event")
                if kind == "step":
                    values = {key: event.get(field) for field, key in _STEP_METRICS.items()}
                    # A script's own metrics (forgeline's step.report), beside the platform's.
                    values |= {f"train/{k}": v for k, v in event.get("metrics", {}).items()}
                elif kind == "eval":
                    values = {"train/val_loss": event.get("val_loss")}
                else:
                    continue
                self.spool.log_dict(values, int(event["step"]), int(event["time"] * 1000))
            # One odd line costs only itself (RecursionError: JSON nested too deep; Overflow:
            # an infinite time).
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError):
                continue
