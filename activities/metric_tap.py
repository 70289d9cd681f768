"""The ranks' metrics on their way to MLflow: every step and eval line of a rank's progress
file, spooled (`registry.metric_stream`) for the node's shipper to deliver while it trains."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio import activity

from registry.metric_stream import MetricSpool

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
    which MLflow stores once."""

    def __init__(self, progress_file: Path, spool: MetricSpool) -> None:
        self.path = progress_file
        self.spool = spool
        self.offset = 0

    def poll(self) -> None:
        try:
            self._poll()
        except Exception:  # a tracking fault never reaches the ranks or the heartbeat
            activity.logger.warning("could not spool training metrics", exc_info=True)

    def _poll(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        complete, newline, _ = chunk.rpartition(b"\n")
        if not newline:
            return
        self.offset += len(complete) + 1
        for line in complete.splitlines():
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
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # one odd line costs only itself
