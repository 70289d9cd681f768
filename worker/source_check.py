"""The API's check that a submitted spec's data.sources name something, made so that no spec
can stall the API or learn what its host holds.

A spec comes from anyone with a submit token, and its sources are patterns the check expands:
a glob over a large tree, or an s3:// listing at an `endpoint=` of the submitter's choosing,
took seconds, and ran in the event loop every other request waits on; and the answer named
files wherever the pattern pointed (`/etc/ssh/*` answered "... e.g. /etc/ssh/ssh_config").

Now a local source must start inside the data roots (Settings.data_root_folders: the same
folders the data workers read from), as written, before anything is looked at, and again once
its links are resolved; a refusal names the roots and nothing outside them. The expansion runs
in a few threads of its own, lists at most `MAX_ENTRIES` directory entries and is waited for at
most `TIMEOUT_S`. The check is advice, not the guard (the data workers expand the sources again,
inside their roots, and refuse what lies outside): a check that runs out of entries or time, or
finds every thread busy, lets the spec through unchecked and says so in the API's log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from dataprep.sources import WalkTooLong
from infra.settings import Settings
from worker.specfile import SourceBounds, check_sources, refuse_outside_roots
from workflows.contracts.spec import RunSpec

THREADS = 4
TIMEOUT_S = 10.0
MAX_ENTRIES = 100_000

_log = logging.getLogger("forgeline.api")


class SourceCheck:
    def __init__(
        self,
        settings: Settings,
        threads: int = THREADS,
        timeout_s: float = TIMEOUT_S,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.bounds = SourceBounds(tuple(settings.data_root_folders()), settings.store, max_entries)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="forgeline-source-check")
        # Taken here and given back when the thread is done, not when the wait gives up: a
        # listing that hangs keeps its thread, and no more than `threads` ever hang.
        self._free = threading.BoundedSemaphore(threads)

    def within_roots(self, spec: RunSpec) -> None:
        """SpecError when a local source, as written, starts outside the data roots: nothing is
        looked at, so it needs no thread."""
        refuse_outside_roots(spec, self.bounds.roots)

    async def __call__(self, spec: RunSpec) -> None:
        """SpecError when a source lies outside the data roots, or names nothing there."""
        self.within_roots(spec)
        if not self._free.acquire(blocking=False):
            _log.warning("run %s: data.sources not checked, every check thread is busy", spec.name)
            return
        future = self._pool.submit(check_sources, spec, self.bounds)
        future.add_done_callback(lambda _: self._free.release())
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            _log.warning("run %s: data.sources not checked within %g s", spec.name, self.timeout_s)
        except WalkTooLong:
            _log.warning("run %s: data.sources name more than %d entries, not all checked",
                         spec.name, self.bounds.max_entries)  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
