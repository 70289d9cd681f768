"""A run's logs through the HTTP API: the ranks' and torchrun's output as the agents shipped it to
the store (trainer.rank_logs), so that people read logs with their token and need no store key.

A follower asks again with `after=NODE/FILE:OFFSET` for every file it has read: pieces are only
ever added, at growing offsets within their file, so what comes back is exactly what is new.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.store.protocol import ObjectStore
from trainer.rank_logs import LogPiece, pieces
from workflows.contracts.api_models import LogPieceView, RunLogs

MAX_ANSWER_BYTES = 4 * 2**20  # a long log comes in several answers (`more`), not one huge one


class BadCursor(ValueError):
    """An `after` value that is not NODE/FILE:OFFSET."""


@dataclass(frozen=True)
class LogQuery:
    attempt: int | None = None
    node: str | None = None
    rank: int | None = None
    after: tuple[str, ...] = ()  # NODE/FILE:OFFSET of each file's last piece already read


def _read_up_to(after: tuple[str, ...]) -> dict[tuple[str, str], int]:
    seen: dict[tuple[str, str], int] = {}
    for cursor in after:
        file, _, offset = cursor.rpartition(":")
        node, _, name = file.partition("/")
        if not (node and name and offset.isdigit()):
            raise BadCursor(f"after={cursor!r} is not NODE/FILE:OFFSET (e.g. node-0/rank-1:2048)")
        seen[(node, name)] = max(int(offset), seen.get((node, name), -1))
    return seen


def _wanted(piece: LogPiece, query: LogQuery, attempt: int, seen: dict) -> bool:
    return (
        piece.generation == attempt
        and (query.node is None or piece.node_id == query.node)
        and (query.rank is None or piece.rank == query.rank)
        and piece.offset > seen.get((piece.node_id, piece.name), -1)
    )


def read_logs(
    store: ObjectStore, run: str, query: LogQuery, found: list[LogPiece] | None = None
) -> RunLogs:
    """The pieces of `run`'s logs that `query` selects and has not read yet, up to about
    MAX_ANSWER_BYTES; `found`: every piece of them, when listed already. `--rank` leaves
    torchrun's output out, as it has no rank."""
    seen = _read_up_to(query.after)
    found = pieces(store, run) if found is None else found
    attempts = sorted({p.generation for p in found})
    attempt = query.attempt if query.attempt is not None else (attempts[-1] if attempts else None)
    shown: list[LogPieceView] = []
    size, more = 0, False
    for piece in found:
        if attempt is None or not _wanted(piece, query, attempt, seen):
            continue
        if shown and size >= MAX_ANSWER_BYTES:
            more = True
            break
        data = store.get_bytes(piece.key)
        size += len(data)
        shown.append(
            LogPieceView(
                node_id=piece.node_id,
                file=piece.name,
                rank=piece.rank,
                offset=piece.offset,
                text=data.decode(errors="replace"),
            )
        )
    return RunLogs(run=run, attempts=attempts, attempt=attempt, pieces=shown, more=more)
