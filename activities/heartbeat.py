"""Heartbeats for synchronous activities whose work blocks for long stretches.

A DuckDB query over a large band index or one `encode_batch` call can run for minutes without
returning to our code, and a heartbeat timeout would then declare a healthy worker dead. A
thread beats on the activity's behalf meanwhile; it runs in a copy of the activity's context,
which is where temporalio keeps the activity it belongs to.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from temporalio import activity


@contextmanager
def keep_alive(every_s: float = 10.0) -> Iterator[None]:
    stop = threading.Event()
    context = contextvars.copy_context()

    def beat() -> None:
        while not stop.wait(every_s):
            activity.heartbeat("working")

    thread = threading.Thread(target=context.run, args=(beat,), name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
