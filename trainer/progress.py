"""The ranks' side of the progress file: one JSON object a line, which the node agent tails
(trainer.progress_tail.ProgressTail), heartbeats to Temporal and copies to MLflow."""

from __future__ import annotations

import json
import time


class ProgressFile:
    """Appends one JSON object a line; only each node's local rank 0 writes."""

    def __init__(self, path: str, enabled: bool) -> None:
        self._handle = open(path, "a", buffering=1) if enabled and path else None  # noqa: SIM115

    def write(self, **event: object) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({"time": time.time(), **event}) + "\n")
