"""`forgeline`: bring up the local stack, submit runs, watch them, approve what they produce."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from temporalio.service import RPCError

from forgeline.client import Client
from infra import mlflow_login
from infra.capacity_hardware import PlanError
from infra.code_snapshot import CodeSnapshotError
from infra.errors import InfraError, IntegrityError, InvalidKey, ObjectNotFound, StackError
from infra.extras import MissingExtra
from infra.host_network import HostNetworkError
from infra.settings import Settings, SettingsError, state_home
from infra.tokens import LOCAL_TOKEN_FILE
from worker import run_actions, stack
from worker.api_access import api_client, call
from worker.api_cli import api, tokens_app
from worker.approvals_cli import approvals_app
from worker.chaos import chaos_app
from worker.cli_common import (
    CliError,
    ExitCode,
    check_name,
    console,
    get_client,
    get_settings,
    print_version,
)
from worker.cli_common import run as run_async
from worker.cluster_cli import cluster_app, jobs, node_app, nodes, queues
from worker.data_cli import (
    DataCliError,
    data_app,
    data_summary,
    load_report,
    prepare,
    render_report,
    write_report,
)
from worker.hosts_cli import agent, control, data_worker
from worker.lineage import lineage_command
from worker.live_progress import LiveProgress
from worker.logs_cli import logs
from worker.plan_cli import plan
from worker.processes_cli import worker_app
from worker.render import progress_line, run_link, runs_table, status_text
from worker.replication_cli import replication
from worker.runs import RunNotFound
from worker.serve_cli import generate, serve
from worker.simulate_cli import simulate
from worker.specfile import SpecError, load_spec
from workflows.contracts.api_models import RunList, RunView
from workflows.contracts.models import Phase, RunStatus
from workflows.contracts.names import InvalidName, check_snapshot_id

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Bring up the local stack, submit runs, watch them, approve what they produce."""


app.add_typer(worker_app, name="worker", hidden=True)
app.add_typer(data_app, name="data")
app.add_typer(cluster_app, name="cluster")
app.add_typer(node_app, name="node")
app.add_typer(chaos_app, name="chaos")
app.add_typer(approvals_app, name="approvals")
app.add_typer(tokens_app, name="tokens")
app.command("api")(api)
app.command("agent")(agent)
app.command("control")(control)
data_app.command("worker")(data_worker)
app.command("logs")(logs)
app.command("lineage")(lineage_command)
app.command("plan")(plan)
app.command("simulate")(simulate)
app.command("replication")(replication)
app.command()(serve)
app.command()(generate)
app.command()(nodes)
app.command()(queues)
app.command()(jobs)


def _print_links(settings: Settings) -> None:
    namespace = settings.temporal_namespace
    console.print(f"Temporal UI  {settings.temporal_ui_url}/namespaces/{namespace}/workflows")
    login = mlflow_login.read(settings.home)
    sign_in = ""
    if login is not None and login.uri == settings.mlflow_uri:
        sign_in = (
            f"  (sign in as {mlflow_login.VIEWER}, password {login.viewer_password}: read-only)"
        )
    console.print(f"MLflow UI    {settings.mlflow_uri}{sign_in}", soft_wrap=True)
    console.print(f"API          {settings.api_url}/docs")
    console.print(
        f"Cluster page {settings.api_url}/  (paste your token: {settings.home / LOCAL_TOKEN_FILE})",
        soft_wrap=True,
    )
    console.print(
        f"Metrics      {settings.api_url}/metrics (the fleet, with a token); each worker's and "
        f"agent's address in {settings.home / 'run'}/*.metrics",
        soft_wrap=True,
    )


# --- the local stack ----------------------------------------------------------------------------


@app.command()
def up(
    nodes: Annotated[int, typer.Option(min=1, max=64, help="node agents to run")] = 2,
    gpus_per_node: Annotated[int, typer.Option(min=1, max=64, help="rank slots per node")] = 1,
    temporal_port: Annotated[int | None, typer.Option(help="default 7233, or a free port")] = None,
    ui_port: Annotated[int | None, typer.Option(help="default 8233, or a free port")] = None,
    mlflow_port: Annotated[int | None, typer.Option(help="default 5000, or a free port")] = None,
    api_port: Annotated[int | None, typer.Option(help="default 8700, or a free port")] = None,
    data_workers: Annotated[
        int, typer.Option(min=1, max=64, help="data-preparation workers (more = faster)")
    ] = 1,
    spares: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=64,
            help="that many more node agents, held back (any healthy idle ones) for gangs "
            "recovering from a failure; 0 frees the pool; default: as the cluster has it",
        ),
    ] = None,
) -> None:
    """Start the local stack (idempotent): Temporal, MLflow, workers, node agents."""
    ports = stack.Ports(temporal=temporal_port, ui=ui_port, mlflow=mlflow_port, api=api_port)
    try:
        settings = stack.up(
            state_home(),
            nodes,
            gpus_per_node,
            ports,
            data_workers,
            say=console.print,
            spares=spares,
        )
    except StackError as err:  # a process that would not start, a server that does not answer
        raise CliError(str(err), ExitCode.DOWN) from None
    console.print(f"state folder {settings.home}")
    _print_links(settings)


@app.command()
def down() -> None:
    """Stop everything `forgeline up` started from this state folder."""
    stack.down(state_home(), say=console.print)


# --- runs ---------------------------------------------------------------------------------------

JsonOption = Annotated[
    bool, typer.Option("--json", help="the state as JSON (the HTTP API's models), not a table")
]


@app.command()
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
    _print_links(settings)
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


@app.command()
def whoami() -> None:
    """The person and roles of your token (FORGELINE_TOKEN, else the local stack's)."""
    who = call(api_client(get_settings()).whoami)
    console.print(f"{who.person}  {', '.join(who.roles)}  (token {who.token_id})", markup=False)


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
def reject(
    name: Annotated[str, typer.Argument(help="run name")],
    reason: Annotated[str, typer.Option(help="why; recorded on the model version")],
) -> None:
    """Reject the run's model, as the person of your token; the reason is recorded on the
    version."""
    _decided(name, reason, lambda client: client.reject(name, reason))


@app.command()
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


@app.command()
def cancel(
    name: Annotated[str, typer.Argument(help="run name")],
    wait_s: Annotated[float, typer.Option(help="how long to wait for the ranks to stop")] = 120,
) -> None:
    """Cancel a run (yours, or anyone's as an operator): its ranks stop, its gang is released."""
    check_name(name)
    final = call(lambda: api_client(get_settings()).cancel(name, wait_s))
    console.print(f"run {name}: {final.status.phase.value}; its nodes are released")


# --- data -----------------------------------------------------------------------------------------


@data_app.command("prepare")
def data_prepare(
    spec_file: Annotated[Path, typer.Argument(help="run spec (TOML); only [data] is used")],
) -> None:
    """Prepare the spec's dataset snapshot on the data workers (or find it), then report it."""
    try:
        spec = load_spec(spec_file)
    except SpecError as err:
        raise CliError(f"{spec_file}: {err}") from None
    settings = get_settings()

    async def go():
        return await prepare(await get_client(settings), spec.data, console)

    dataset = run_async(go())
    console.print(data_summary(dataset))
    render_report(load_report(settings, dataset.snapshot_id), console)


@data_app.command("report")
def data_report(
    snapshot: Annotated[str, typer.Argument(help="snapshot id (see `forgeline status RUN`)")],
    out: Annotated[Path | None, typer.Option(help="default: report-SNAPSHOT.json")] = None,
) -> None:
    """What happened to every document of a snapshot: per source, filter, dedup and split."""
    # The id becomes a store key and a file name: a '/' or '..' must not reach either.
    try:
        check_snapshot_id(snapshot)
    except InvalidName as err:
        raise CliError(str(err)) from None
    report = load_report(get_settings(), snapshot)
    render_report(report, console)
    path = write_report(report, out or Path(f"report-{snapshot}.json"))
    console.print(f"wrote {path}")


def outcome(err: BaseException) -> tuple[str, ExitCode] | None:
    """What `forgeline` prints and exits with for an error it expects (bad input, a refusal, a
    stack that is down), or None for anything else: a bug, which keeps its traceback."""
    if isinstance(err, CliError):
        return str(err), err.code
    if isinstance(err, RunNotFound | ObjectNotFound):
        return str(err), ExitCode.NOT_FOUND
    # A bad setting, a plan or a host network that cannot be, an extra not installed, a
    # corrupt object: the message names the setting or the object, and the fix.
    if isinstance(err, DataCliError | SettingsError | PlanError | HostNetworkError | MissingExtra
                  | IntegrityError | InvalidKey):  # fmt: skip
        return str(err), ExitCode.BAD_INPUT
    # A store or a stack process that did not answer or would not start.
    if isinstance(err, InfraError):
        return str(err), ExitCode.DOWN
    if isinstance(err, RPCError | TimeoutError):
        reason = err or type(err).__name__
        return f"Temporal did not answer ({reason}): is the stack up? `forgeline up`", ExitCode.DOWN
    return None


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    code = 0
    try:
        app()
    except SystemExit as done:  # typer ends every command this way
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as err:
        expected = outcome(err)
        if expected is None:
            traceback.print_exc()
            code = ExitCode.BUG
        else:
            # Escaped: messages quote TOML sections and paths, whose [brackets] are not markup.
            console.print(f"[red]error:[/red] {escape(expected[0])}")
            code = expected[1]
    # Skip interpreter finalisation: the Temporal client's core threads can still hold Python
    # objects then, and releasing them in a finalising interpreter aborts the process
    # ("PyGILState_Release ... finalizing", seen in about one `up` in five here). Everything
    # this process owns is flushed or closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
