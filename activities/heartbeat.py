"""Heartbeats for synchronous activities whose work blocks for long stretches.

A DuckDB query over a large band index or one `encode_batch` call can run for minutes without
returning to our code, and a heartbeat timeout would then declare a healthy worker dead. A
thread beats on the activity's behalf meanwhile; it runs in a copy of the activity's context,
which is where temporalio keeps the activity it belongs to.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from temporalio import activity

P = ParamSpec("P")
R = TypeVar("R")
# How often a control activity beats. The workflows give these activities a heartbeat timeout
# of CONTROL_HEARTBEAT_TIMEOUT_S (workflows/training_run.py), so an activity whose worker was
# killed is retried elsewhere within that, not at its start-to-close timeout (minutes).
CONTROL_BEAT_S = 5.0


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


def beats_while_running(fn: Callable[P, R]) -> Callable[P, R]:
    """A synchronous activity that beats every CONTROL_BEAT_S while it runs: put under
    `@activity.defn`. A control worker killed in the middle of registering a model left the run
    REGISTERING for the activity's 30-minute timeout (found by bench/soak.py); beating, it is
    retried on a live worker within the workflow's heartbeat timeout."""

    @functools.wraps(fn)
    def beating(*args: P.args, **kwargs: P.kwargs) -> R:
        with keep_alive(CONTROL_BEAT_S):
            return fn(*args, **kwargs)

    return beating
