"""Logs that outlive their node: each rank's output, shipped to the store while it runs.

Every rank writes what it prints to `rank-<R>.log` beside its progress file (trainer.entry tees
its stdout and stderr there), and torchrun's own output goes to `torchrun.log`. The node agent
ships what is new in them every few seconds, and the rest when the attempt ends, as numbered
pieces:

    runs/<run>/logs/gen-<G>/<node>/<file>/<byte offset, 12 digits>.log

Pieces are only ever added (never rewritten), so shipping a long log costs only its new bytes,
a reader concatenates a file's pieces in key order, and a node that vanishes mid-run has left
everything up to its last shipment. While the ranks run, a piece ends at a line's end, so a
follower never sees half a line.

What is stored is redacted first (infra.secret_shapes): the values of the agent's own secrets and
anything shaped like a credential become ***, so a script that prints `os.environ` or a key file
does not publish it to whoever reads the run's logs. Shipping whole lines is what lets every
credential on one line be found whole; a private key's lines are followed from one piece to the
next. A piece's key names the byte offset in the rank's file; its bytes are the redacted text of
what starts there, so a piece may be shorter than the bytes it stands for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from infra.redact import known_secrets
from infra.secret_shapes import OpenKey, redact_log
from infra.store.protocol import ObjectStore

TORCHRUN_LOG = "torchrun.log"
_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
# The most one round reads of a log file, and so the longest line shipped.
MAX_SHIP_BYTES = 4 << 20
_PIECE = re.compile(r"^runs/[^/]+/logs/gen-(\d+)/([^/]+)/([^/]+)/(\d{12})\.log$")


def rank_log_name(rank: int) -> str:
    return f"rank-{rank}.log"


def logs_prefix(run_id: str) -> str:
    return f"runs/{run_id}/logs/"


def piece_key(run_id: str, generation: int, node_id: str, name: str, offset: int) -> str:
    file = name.removesuffix(".log")
    return f"{logs_prefix(run_id)}gen-{generation}/{node_id}/{file}/{offset:012d}.log"


@dataclass(frozen=True, order=True)
class LogPiece:
    generation: int
    node_id: str
    name: str  # "rank-3", "torchrun"
    offset: int
    key: str

    @property
    def rank(self) -> int | None:
        found = _RANK_LOG.match(f"{self.name}.log")
        return int(found.group(1)) if found else None


def pieces(store: ObjectStore, run_id: str) -> list[LogPiece]:
    """Every shipped piece of a run's logs, in order: attempt, node, file, offset."""
    found = []
    for key in store.list(logs_prefix(run_id)):
        match = _PIECE.match(key)
        if match:
            generation, node, name, offset = match.groups()
            found.append(LogPiece(int(generation), node, name, int(offset), key))
    return sorted(found)


class LogShipper:
    """Ships the new bytes of one attempt's log files on one node to the store."""

    def __init__(
        self, store: ObjectStore, run_id: str, generation: int, node_id: str, folder: Path
    ) -> None:
        self.store, self.run_id, self.generation, self.node_id = store, run_id, generation, node_id
        self.folder = folder
        self._shipped: dict[str, int] = {}  # file name -> bytes already in the store
        self._open_keys: dict[str, OpenKey | None] = {}  # file name -> a private key not ended
        self._skipping: dict[str, bool] = {}  # file name -> within a line too long to ship

    def _files(self) -> list[Path]:
        return sorted(
            p
            for p in self.folder.glob("*.log")
            if p.name == TORCHRUN_LOG or _RANK_LOG.match(p.name)
        )

    def ship(self, final: bool = False) -> int:
        """Ship what is new, redacted; before `final`, only up to each file's last complete
        line. At most MAX_SHIP_BYTES of a file a round (a rank runs the user's code: it may
        print gigabytes, or one line that never ends); a line longer than that is not shipped
        but named. Returns the bytes of the files read."""
        total = 0
        secrets = known_secrets()  # read now: a credential rotated while the agent runs counts
        for path in self._files():
            start = self._shipped.get(path.name, 0)
            with open(path, "rb") as handle:
                handle.seek(start)
                new = handle.read(MAX_SHIP_BYTES)
            text, read = self._shippable(path.name, new, final)
            if not read:
                continue
            if text:
                text, still_open = redact_log(text, secrets, self._open_keys.get(path.name))
            else:
                still_open = self._open_keys.get(path.name)
            if text:  # nothing but a key's body: nothing to store
                key = piece_key(self.run_id, self.generation, self.node_id, path.name, start)
                self.store.put_bytes(key, text.encode(errors="surrogateescape"))
            # Only once it landed: a put that fails is redacted again, from the same state.
            self._shipped[path.name] = start + read
            self._open_keys[path.name] = still_open
            total += read
        return total

    def _shippable(self, name: str, new: bytes, final: bool) -> tuple[str, int]:
        """The text to ship of `new` (bytes read from file `name`) and how many bytes of the
        file that accounts for: whole lines, a line too long for one read named instead, and
        the rest of such a line passed over up to its newline."""
        read = len(new)
        if self._skipping.get(name):  # the rest of a line too long to ship
            end = new.find(b"\n")
            if end < 0:
                return "", read
            self._skipping[name] = False
            text, rest = self._shippable(name, new[end + 1 :], final)
            return text, end + 1 + rest
        if not final and b"\n" not in new:
            if read < MAX_SHIP_BYTES:
                return "", 0  # a line being written: the next round takes it whole
            self._skipping[name] = True
            return f"[a line of more than {MAX_SHIP_BYTES} bytes, not shipped]\n", read
        if not final:
            read = new.rfind(b"\n") + 1
        # Bytes that are not UTF-8 go through unchanged (surrogateescape), never dropped.
        return new[:read].decode(errors="surrogateescape"), read


async def _ship(shipper: LogShipper, final: bool, timeout_s: float) -> None:
    # Logs never fail an attempt: a store that is away now gets the bytes on the next round
    # (the shipper only advances past what landed).
    try:
        await asyncio.wait_for(asyncio.to_thread(shipper.ship, final), timeout_s)
    except Exception:
        logging.warning("could not ship the logs of %s", shipper.folder, exc_info=True)


@contextlib.asynccontextmanager
async def shipped_while_running(
    shipper: LogShipper, every_s: float = 5.0, final_timeout_s: float = 30.0
) -> AsyncIterator[None]:
    """Ship the attempt's logs every `every_s` while the body runs, and all of them after it
    (within `final_timeout_s`: a node cut off from the store must still end its activity)."""

    async def every_few_seconds() -> None:
        while True:
            await asyncio.sleep(every_s)
            await _ship(shipper, False, every_s * 4)

    task = asyncio.create_task(every_few_seconds())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _ship(shipper, True, final_timeout_s)
