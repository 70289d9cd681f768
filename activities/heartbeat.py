"""Heartbeats for synchronous activities whose work blocks for long stretches.

A DuckDB query over a large band index or one `encode_batch` call can run for minutes without
returning to our code, and a heartbeat timeout would then declare a healthy worker dead. A
thread beats on the activity's behalf meanwhile; it runs in a copy of the activity's context,
which is where temporalio keeps the activity it belongs to.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from temporalio import activity


@contextmanager
def keep_alive(every_s: float = 10.0) -> Iterator[Callable[[str], None]]:
    """Beat every `every_s` meanwhile; yields `progress`, which beats a message now. The thread
    repeats the latest message, so the last heartbeat of a worker that dies says where it was
    (the workflow names it when it gives up: workflows.dataset)."""
    stop = threading.Event()
    context = contextvars.copy_context()
    latest = ["working"]

    def progress(message: str) -> None:
        latest[0] = message
        activity.heartbeat(message)

    def beat() -> None:
        while not stop.wait(every_s):
            activity.heartbeat(latest[0])

    thread = threading.Thread(target=context.run, args=(beat,), name="heartbeat", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
