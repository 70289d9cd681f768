"""The commands of a run's life: submit and follow it, list and inspect runs, decide on its
model, resume or cancel it. Each goes through the HTTP API as the person of your token."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from forgeline.client import Client
from infra.code_snapshot import CodeSnapshotError
from infra.settings import Settings
from worker import run_actions
from worker.api_access import api_client, call
from worker.cli_common import CliError, ExitCode, check_name, console, get_settings
from worker.live_progress import LiveProgress
from worker.render import progress_line, run_link, runs_table, status_text
from worker.specfile import SpecError, load_spec
from worker.stack_cli import print_links
from workflows.approval import measured_loss
from workflows.contracts.api_models import RunList, RunView
from workflows.contracts.models import Phase, RunStatus

commands = typer.Typer()

JsonOption = Annotated[
    bool, typer.Option("--json", help="the state as JSON (the HTTP API's models), not a table")
]


@commands.command()
def run(
    spec_file: Annotated[Path, typer.Argument(help="run spec (TOML)")],
    detach: Annotated[bool, typer.Option(help="submit and return at once")] = False,
) -> None:
    """Submit a run (or attach to the run of that name) and follow it to approval. The run is
    yours: its owner is the person of your token."""
    try:
        load_spec(spec_file)  # refused here with the file's name, before the API is called
    except SpecError as err:
        raise CliError(f"{spec_file}: {err}") from None
    settings = get_settings()
    client = api_client(settings)
    try:
        answer = call(lambda: client.start(spec_file))
    except CodeSnapshotError as err:  # packing train.code, on this machine
        raise CliError(f"{spec_file}: train.code: {err}") from None
    name = answer.run.status.name
    if answer.created:
        console.print(f"submitted run {name}")
    else:
        console.print(f"run {name} exists with this spec: attaching to it")
    console.print(f"Temporal     {run_link(settings, name)}")
    if detach:
        return
    _follow_to_a_decision(client, settings, name)


def _follow_to_a_decision(client: Client, settings: Settings, name: str) -> None:
    """Follow the run; exits RUN_FAILED unless its model awaits approval or is approved."""
    status = _follow(client, name)
    print_links(settings)
    if status.phase not in (Phase.AWAITING_APPROVAL, Phase.APPROVED):
        raise typer.Exit(ExitCode.RUN_FAILED)


def _follow(client: Client, name: str, poll_s: float = 1.0) -> RunStatus:
    """Until the run waits for a person or ends: at a terminal, bars for its data stages and
    steps (rate, ETA) under a line per change of phase; elsewhere, a line per change."""
    if not console.is_terminal:
        return _follow_lines(client, name, poll_s, None)
    with LiveProgress(console) as live:
        return _follow_lines(client, name, poll_s, live)


def _follow_lines(client: Client, name: str, poll_s: float, live: LiveProgress | None) -> RunStatus:
    last: tuple = ()
    while True:
        current = call(lambda: client.status(name))
        beat = current.progress
        # Throughput jitters every second; print when something a person waits for changes.
        stages = current.dataset.model_dump_json() if current.dataset else None
        step = beat.step if beat else None
        key = (current.status.model_dump_json(), step, stages, current.retrying)
        if live is not None:  # the steps and stages are on the bars
            live.run(current)
            key = (current.status.model_dump_json(), current.retrying)
        if key != last:
            # Plain text: a retry's reason quotes errors (gloo's "[/__w/.../pair.cc:537]").
            console.print(f"{time.strftime('%H:%M:%S')}  {progress_line(current)}", markup=False)
            last = key
        phase = current.status.phase
        if phase == Phase.AWAITING_APPROVAL:
            console.print(
                f"model waiting for approval by someone else: forgeline approve {name}"
                f"  |  forgeline reject {name} --reason '…'  (their FORGELINE_TOKEN)"
            )
            return current.status
        if phase.final:
            if current.status.error:
                console.print(f"[red]{escape(current.status.error)}[/red]")
            return current.status
        if current.execution not in (None, "RUNNING"):
            return current.status
        time.sleep(poll_s)


@commands.command()
def whoami() -> None:
    """The person and roles of your token (FORGELINE_TOKEN, else the local stack's)."""
    who = call(api_client(get_settings()).whoami)
    console.print(f"{who.person}  {', '.join(who.roles)}  (token {who.token_id})", markup=False)


@commands.command()
def runs(as_json: JsonOption = False) -> None:
    """Table of runs: name, phase, step, loss, attempts."""
    views = call(api_client(get_settings()).runs)
    if as_json:
        typer.echo(RunList(runs=views).model_dump_json(indent=2))
        return
    if not views:
        console.print("no runs yet: `forgeline run examples/tiny.toml`")
        return
    console.print(runs_table(views))


@commands.command()
def status(
    name: Annotated[str, typer.Argument(help="run name")], as_json: JsonOption = False
) -> None:
    """Phase, allocation and generation, last committed checkpoint, metrics."""
    settings = get_settings()
    found = call(lambda: api_client(settings).status(check_name(name)))
    if as_json:
        typer.echo(found.model_dump_json(indent=2))
        return
    console.print(status_text(found, settings), markup=False)  # failures quote errors


@commands.command()
def report(
    name: Annotated[str, typer.Argument(help="run name")],
    out: Annotated[Path | None, typer.Option(help="folder to write; default reports/RUN/")] = None,
) -> None:
    """PNG plots (loss, throughput and MFU, goodput timeline) and a Markdown summary of a run,
    also logged to its MLflow run under report/."""
    # matplotlib and the plotting code load only for this command, not for every `forgeline`.
    from worker.report import report_run

    settings = get_settings()
    found = call(lambda: api_client(settings).status(check_name(name)))
    written = report_run(settings, found.status, out or Path("reports") / name)
    for path in written.files:
        console.print(f"wrote {path}")
    for what in written.missing:
        console.print(f"[yellow]missing[/yellow] {what}")
    if written.logged_to:
        console.print(f"logged to {written.logged_to}")


def _decided(name: str, reason: str, decide: Callable[[Client], RunView]) -> None:
    check_name(name)
    try:
        run_actions.check_reason(reason)  # before the API is reached
    except run_actions.RunActionError as err:
        raise CliError(str(err)) from None
    found = call(lambda: decide(api_client(get_settings())))
    status, mv = found.status, found.status.model_version
    console.print(
        f"run {name}: {status.phase.value}" + (f" ({mv.model_name} v{mv.version})" if mv else "")
    )
    if status.phase == Phase.APPROVED and mv:
        console.print(f"alias 'production' -> {mv.model_name} version {mv.version}")
    if status.evaluation is not None and status.evaluation.self_reported:
        console.print(f"its {measured_loss(status.evaluation)}: Forgeline did not measure it")


@commands.command()
def approve(
    name: Annotated[str, typer.Argument(help="run name")],
    note: Annotated[str, typer.Option(help="recorded on the model version")] = "",
    override_gate: Annotated[
        bool, typer.Option(help="approve although the eval gate failed; --note must say why")
    ] = False,
) -> None:
    """Approve the run's model, as the person of your token: alias `production` moves to its
    version. Only a listed approver other than the submitter may (see `forgeline approvals`),
    and the eval gate must pass."""
    _decided(name, note, lambda client: client.approve(name, note, override_gate))


@commands.command()
def reject(
    name: Annotated[str, typer.Argument(help="run name")],
    reason: Annotated[str, typer.Option(help="why; recorded on the model version")],
) -> None:
    """Reject the run's model, as the person of your token; the reason is recorded on the
    version."""
    _decided(name, reason, lambda client: client.reject(name, reason))


@commands.command()
def resume(
    name: Annotated[str, typer.Argument(help="run name")],
    from_step: Annotated[
        int | None,
        typer.Option(
            "--from",
            min=0,
            help="resume there, also a run that finished; a step the run keeps no checkpoint "
            "of is refused, naming those it keeps; its later checkpoints stop counting",
        ),
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(min=1, help="run on this many nodes from now on (the checkpoint reshards)"),
    ] = None,
    detach: Annotated[bool, typer.Option(help="resume and return at once")] = False,
) -> None:
    """Run a FAILED or CANCELLED run again from its last committed checkpoint, or any run that
    has ended from a checkpoint it keeps (--from), on as many nodes as asked (--nodes); yours,
    or anyone's as an operator; then follow it to approval."""
    check_name(name)
    settings = get_settings()
    client = api_client(settings)
    call(lambda: client.resume(name, from_step, nodes))
    where = "its last committed checkpoint" if from_step is None else f"step {from_step}"
    size = f" on {nodes} node{'s' * (nodes != 1)}" if nodes is not None else ""
    console.print(f"resumed run {name}: it trains on from {where}{size}")
    if detach:
        return
    _follow_to_a_decision(client, settings, name)


@commands.command()
def cancel(
    name: Annotated[str, typer.Argument(help="run name")],
    wait_s: Annotated[float, typer.Option(help="how long to wait for the ranks to stop")] = 120,
) -> None:
    """Cancel a run (yours, or anyone's as an operator): its ranks stop, its gang is released."""
    check_name(name)
    final = call(lambda: api_client(get_settings()).cancel(name, wait_s))
    console.print(f"run {name}: {final.status.phase.value}; its nodes are released")
