"""Reading files a rank writes (its progress lines, torchrun's log, its printed stacks) as the
node agent must: a rank runs the user's code, so such a file may hold a line of gigabytes with no
newline, or anything else. The agent reads at most a bounded amount at a time, passes over a line
longer than a cap (one warning naming the file and the line's size), and keeps only a bounded
tail of a log, so no rank can make it hold more than a few MiB."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# The most one poll reads: a poll every 0.1 s follows 10 MiB/s of lines, hundreds of times what
# honest ranks write (a step line every few steps).
MAX_READ = 1 << 20
# The longest line the agent takes: 64 KiB, and 64 bytes for each rank of the gang, since a step
# line carries each rank's step time and gradient norm (a float and a comma each, twice).
BASE_LINE = 64 << 10
PER_RANK_LINE = 64
# Odd lines (too long, not JSON, ...) warned about one by one in a file; past that, one line
# says the rest go unmentioned, so a script writing junk cannot flood the agent's log either.
ODD_WARNINGS = 5
# Reads of a file once its ranks are gone, to its end: 64 MiB at most (honest ranks leave a few
# lines since the last poll; a script's junk is not read on for ever).
DRAIN_READS = 64
# How much of a log the agent reads to quote its last lines in an error, and how much of a line.
TAIL_BYTES = 64 << 10
TAIL_LINE_CHARS = 2000


def line_cap(world: int) -> int:
    """The longest line the agent reads from the ranks of a gang of `world` ranks."""
    return BASE_LINE + PER_RANK_LINE * max(world, 1)


class BoundedLines:
    """The complete lines appended to a file since the last poll, reading at most `max_read`
    bytes a poll (at least four lines of the cap: a line found whole is never split), passing
    over any line longer than `max_line` to its newline, however long it grows."""

    def __init__(self, path: Path, max_line: int = BASE_LINE, warn: bool = True) -> None:
        self.path = path
        self.max_line = max_line
        self.max_read = max(MAX_READ, 4 * max_line)
        self.warn = warn  # a second reader of the same file leaves the warnings to the first
        self.offset = 0  # where the next read starts
        self.skipping = 0  # bytes of an overlong line passed over so far, its newline not yet seen
        self.last_read = 0  # bytes the newest poll read: at most max_read
        self.odd_lines = 0

    def poll(self) -> list[bytes]:
        """The new complete lines (without their newlines) within one read of `max_read`."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read(self.max_read)
        except FileNotFoundError:
            chunk = b""
        self.last_read = len(chunk)
        start = self._past_overlong(chunk)
        lines = []
        while (end := chunk.find(b"\n", start)) >= 0:
            if end - start > self.max_line:
                self._too_long(f"{end - start} bytes", self.offset + start)
            else:
                lines.append(chunk[start:end])
            start = end + 1
        if len(chunk) - start > self.max_line:  # already too long, and its end not in yet
            self.skipping = len(chunk) - start
            self._too_long(f"more than {self.skipping} bytes", self.offset + start)
            start = len(chunk)
        self.offset += start  # a short incomplete line is read again, whole, by a later poll
        return lines

    @property
    def caught_up(self) -> bool:
        """The newest poll read everything there was (it stopped short of `max_read`)."""
        return self.last_read < self.max_read

    def odd(self, what: str, why: str) -> None:
        """Warn that `what` of the file was passed over, and `why`: the first ODD_WARNINGS
        times, then once that the rest will not be."""
        self.odd_lines += 1
        if not self.warn or self.odd_lines > ODD_WARNINGS + 1:
            return
        if self.odd_lines > ODD_WARNINGS:
            log.warning("more odd lines in %s are skipped without a warning", self.path)
            return
        log.warning("skipped %s of %s: %s", what, self.path, why)

    def _too_long(self, size: str, at: int) -> None:
        why = f"longer than the {self.max_line} bytes a line of the ranks may have"
        self.odd(f"a line of {size} at byte {at}", why)

    def _past_overlong(self, chunk: bytes) -> int:
        """Where the chunk's lines start: past the rest of a line being passed over (all of
        the chunk while its newline is not in it)."""
        if not self.skipping:
            return 0
        end = chunk.find(b"\n")
        if end < 0:
            self.skipping += len(chunk)
            return len(chunk)
        self.skipping = 0
        return end + 1


def read_to_end(poll: Callable[[], None], lines: BoundedLines, most: int = DRAIN_READS) -> None:
    """Once the ranks are gone: `poll` until `lines` has read its file to the end, or `most`
    times."""
    for _ in range(most):
        poll()
        if lines.caught_up:
            return


def tail_lines(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a log, from at most its last TAIL_BYTES, each cut at
    TAIL_LINE_CHARS: what an error quotes of torchrun's log, never the whole file."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(size - TAIL_BYTES, 0))
            end = handle.read(TAIL_BYTES)
    except OSError:
        return ""
    kept = end.decode(errors="replace").splitlines()[-lines:]
    return "\n".join(_cut(line) for line in kept)


def _cut(line: str) -> str:
    if len(line) <= TAIL_LINE_CHARS:
        return line
    return f"{line[:TAIL_LINE_CHARS]}… ({len(line) - TAIL_LINE_CHARS} more characters)"
