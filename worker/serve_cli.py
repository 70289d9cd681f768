"""`forgeline serve MODEL` and `forgeline generate MODEL "prompt"`: a registered model
answering prompts (worker.serve does the work)."""

from __future__ import annotations

import functools
import signal
from typing import Annotated

import typer

from worker.cli_common import CliError, console, get_settings
from worker.serve import (
    ServeError,
    curl_example,
    generate_local,
    generate_remote,
    parse_ref,
    start_server,
    wait_in_foreground,
)

commands = typer.Typer()

_MODEL_HELP = "NAME (alias production), NAME@ALIAS or NAME/VERSION"
_UNCONFINED_HELP = (
    "where no box can be made (bwrap missing): load a version without an approval anyway, "
    "unboxed, as your user (its environment still holds none of your secrets)"
)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (systemd, docker stop, kill) stops it like Ctrl-C does


def _serve_failed(err: ServeError) -> CliError:
    if err.log_tail:
        console.print(err.log_tail, markup=False, emoji=False)
    return CliError(str(err))


@commands.command()
def serve(
    model: Annotated[str, typer.Argument(help=_MODEL_HELP)],
    port: Annotated[int | None, typer.Option(min=1, max=65535, help="default: a free one")] = None,
    host: Annotated[str, typer.Option(help="0.0.0.0 to accept other machines")] = "127.0.0.1",
    workers: Annotated[int, typer.Option(min=1, max=64, help="each loads the model")] = 1,
    unconfined: Annotated[bool, typer.Option(help=_UNCONFINED_HELP)] = False,
) -> None:
    """Serve a registered model over HTTP (MLflow's scoring server, its code in a box) until
    Ctrl-C."""
    settings = get_settings()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ref = parse_ref(model)
        server = start_server(
            settings.mlflow_uri, settings.home, ref, host, port, workers,
            say=functools.partial(console.print, markup=False), unconfined=unconfined,
        )  # fmt: skip
    except ServeError as err:
        raise _serve_failed(err) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    try:
        console.print(f"{ref} (version {server.version}) is ready at {server.url}", markup=False)
        console.print(f"  {curl_example(server.url)}", markup=False)
        console.print(f'  forgeline generate {ref} "ROMEO:" --url {server.url}', markup=False)
        console.print(f"log {server.process.log_file}; Ctrl-C stops it", markup=False)
        wait_in_foreground(server)
    except ServeError as err:
        raise _serve_failed(err) from None
    except KeyboardInterrupt:
        console.print(f"stopping the model server for {ref}")
    finally:
        # A second Ctrl-C must not cut the stop short and leave the server's group running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()


@commands.command()
def generate(
    model: Annotated[str, typer.Argument(help=_MODEL_HELP)],
    prompt: Annotated[str, typer.Argument(help="text to continue")],
    max_new_tokens: Annotated[int, typer.Option(min=1, max=100_000)] = 200,
    seed: Annotated[int, typer.Option(help="same seed, same text")] = 0,
    url: Annotated[
        str | None,
        typer.Option(help="a `forgeline serve` server; default: load the model here"),
    ] = None,
    unconfined: Annotated[bool, typer.Option(help=_UNCONFINED_HELP)] = False,
) -> None:
    """Continue a prompt with a registered model, here or on a model server."""
    try:
        ref = parse_ref(model)
        if url:
            text = generate_remote(url, prompt, max_new_tokens, seed)
        else:
            uri = get_settings().mlflow_uri
            # Notes go to stderr: stdout is the model's text and nothing else.
            say = functools.partial(typer.echo, err=True)
            text = generate_local(
                uri, ref, prompt, max_new_tokens, seed, say=say, unconfined=unconfined
            )
    except ServeError as err:
        raise _serve_failed(err) from None
    typer.echo(text)  # exactly the model's text: no markup, emoji codes or wrapping
