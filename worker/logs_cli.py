"""`forgeline logs RUN [--node N] [--rank R] [--attempt G] [--follow]`: the ranks' output, read
from the store, from any machine (trainer.rank_logs ships it there while the ranks run)."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from trainer.rank_logs import LogPiece, pieces
from worker.cli_common import CliError, ExitCode, check_name, get_settings

_FOLLOW_POLL_S = 1.0


def _chosen(
    found: list[LogPiece], node: str | None, rank: int | None, attempt: int | None
) -> list[LogPiece]:
    return [
        p
        for p in found
        if p.generation == attempt
        and (node is None or p.node_id == node)
        and (rank is None or p.rank == rank)
    ]


def _header(piece: LogPiece) -> str:
    return f"==> attempt (generation) {piece.generation}, {piece.node_id}, {piece.name} <==\n"


def logs(
    run: Annotated[str, typer.Argument(help="the run's name")],
    node: Annotated[str | None, typer.Option(help="only this node's logs")] = None,
    rank: Annotated[int | None, typer.Option(min=0, help="only this rank's log")] = None,
    attempt: Annotated[
        int | None, typer.Option(min=1, help="the generation to show (default: the latest)")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new lines (Ctrl-C ends)")
    ] = False,
) -> None:
    """Print the ranks' logs of a run (and torchrun's, unless --rank is given)."""
    run = check_name(run)
    if node is not None:
        node = check_name(node, "node id")
    store = get_settings().open_store()
    found = pieces(store, run)
    if not found and not follow:
        raise CliError(
            f"no logs of run {run} in {store.url}: check the name (`forgeline runs`)",
            ExitCode.NOT_FOUND,
        )
    generations = sorted({p.generation for p in found})
    if attempt is None:
        attempt = generations[-1] if generations else 1
    elif attempt not in generations and not follow:
        raise CliError(
            f"run {run} has no logs of attempt {attempt}: it has {generations}",
            ExitCode.NOT_FOUND,
        )
    printed: set[str] = set()
    current: str | None = None
    while True:
        for piece in _chosen(found, node, rank, attempt):
            if piece.key in printed:
                continue
            file = f"{piece.node_id}/{piece.name}"
            if file != current:
                sys.stdout.write(("\n" if current else "") + _header(piece))
                current = file
            sys.stdout.write(store.get_bytes(piece.key).decode(errors="replace"))
            sys.stdout.flush()
            printed.add(piece.key)
        if not follow:
            return
        time.sleep(_FOLLOW_POLL_S)
        found = pieces(store, run)
