"""`forgeline logs RUN [--node N] [--rank R] [--attempt G] [--follow]`: the ranks' output, from
any machine, through the API under the caller's token (trainer.rank_logs ships it to the store
while the ranks run; the API reads it there, so people need no store key)."""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Annotated

import typer

from worker.api_access import api_client, call
from worker.cli_common import CliError, ExitCode, check_name, get_settings
from workflows.contracts.api_models import LogPieceView

commands = typer.Typer()

_FOLLOW_POLL_S = 1.0


def _header(attempt: int, piece: LogPieceView) -> str:
    return f"==> attempt (generation) {attempt}, {piece.node_id}, {piece.file} <==\n"


@commands.command()
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
    client = api_client(get_settings())
    read_up_to: dict[str, int] = {}  # NODE/FILE -> offset of its last piece printed
    current: str | None = None
    while True:
        after = tuple(f"{file}:{offset}" for file, offset in read_up_to.items())
        answer = call(partial(client.logs, run, attempt, node, rank, after))
        if not follow:
            if not answer.attempts:
                raise CliError(
                    f"no logs of run {run}: check the name (`forgeline runs`)", ExitCode.NOT_FOUND
                )
            if answer.attempt not in answer.attempts:
                raise CliError(
                    f"run {run} has no logs of attempt {answer.attempt}: it has {answer.attempts}",
                    ExitCode.NOT_FOUND,
                )
        if attempt is None and answer.attempt is not None:
            attempt = answer.attempt  # followed from here on, even when a later one starts
        for piece in answer.pieces:
            file = f"{piece.node_id}/{piece.file}"
            if file != current:
                sys.stdout.write(("\n" if current else "") + _header(answer.attempt or 0, piece))
                current = file
            sys.stdout.write(piece.text)
            read_up_to[file] = piece.offset
        sys.stdout.flush()
        if answer.more:
            continue
        if not follow:
            return
        time.sleep(_FOLLOW_POLL_S)
