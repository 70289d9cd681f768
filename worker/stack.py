"""`forgeline up` / `down`: the whole local stack as processes under the state folder.

Temporal dev server (history in a SQLite file, so it survives down/up), MLflow server (SQLite +
artifact folder), one control worker, data workers, N node agents. Each has a pid file and a
log; `up` starts only what is missing and `down` stops only what it started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client

from infra import mlflow_login
from infra.errors import StackError
from infra.extras import require_extra
from infra.identity import InvalidIdentity, canonical_person
from infra.local_servers import (
    MLFLOW_SERVER_ENV,
    mlflow_server_argv,
    temporal_dev_server_argv,
)
from infra.processes import (
    ManagedProcess,
    free_ports,
    http_ok,
    port_is_open,
    wait_until,
)
from infra.settings import (
    Settings,
    default_data_roots,
    load_settings,
    set_in_environment,
    setting_label,
)
from infra.tokens import LOCAL_TOKEN_FILE, ensure_local_admin
from worker.cli_common import get_client
from worker.cluster_actions import apply_config
from worker.process_metrics import METRICS_ADDRESS_ENV
from worker.process_names import (
    API,
    CONTROL,
    DATA_PREFIX,
    MLFLOW,
    NODE_PREFIX,
    REPLICATOR,
    TEMPORAL,
)
from worker.temporal_client import ensure_cluster, ensure_search_attributes
from workflows.contracts.cluster_models import ClusterConfig, ClusterState, Health, Node
from workflows.contracts.names import CLUSTER_WORKFLOW_ID
from workflows.search_attributes import SEARCH_ATTRIBUTE_TYPES

DEFAULT_PORTS = {"temporal": 7233, "ui": 8233, "mlflow": 5000, "api": 8700}


@dataclass
class Ports:
    temporal: int | None = None
    ui: int | None = None
    mlflow: int | None = None
    api: int | None = None


def free_port_flags() -> list[str]:
    """`forgeline up` options that put every server of the stack on a free port: for tests
    and benchmarks, which must not take the conventional ones from a person's own stack."""
    names = ("temporal", "ui", "mlflow", "api")
    return [flag for name, port in zip(names, free_ports(len(names)), strict=True)
            for flag in (f"--{name}-port", str(port))]  # fmt: skip


def _port(
    requested: int | None, recorded: int | None, default: int, other: int | None = None
) -> int:
    """The requested port; else the one this stack used last time (links stay the same across
    down / up); else the conventional one; else any free port; never `other`, the port of a
    server chosen alongside but not yet listening. Only a requested port that is taken is an
    error."""
    if requested:
        if port_is_open("127.0.0.1", requested) or requested == other:
            raise StackError(f"port {requested} is already in use: choose another or omit it")
        return requested
    for candidate in (recorded, default):
        if candidate and candidate != other and not port_is_open("127.0.0.1", candidate):
            return candidate
    return next(port for port in free_ports(2) if port != other)


def _port_of(url: str) -> int | None:
    tail = url.rsplit(":", 1)[-1].split("/", 1)[0]
    return int(tail) if tail.isdigit() else None


def _local_person() -> str:
    """The local user's name as a Forgeline person ('root' and 'Jane.Doe' are fine; a name
    outside the rule falls back to 'local')."""
    try:
        return canonical_person(getpass.getuser())
    except (InvalidIdentity, KeyError, OSError):
        return "local"


def node_name(index: int) -> str:
    return f"{NODE_PREFIX}{index}"


def _worker_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "worker.cli", "worker", *args]


def up(
    home: Path,
    nodes: int,
    gpus_per_node: int,
    ports: Ports,
    data_workers: int = 1,
    say: Callable[[str], None] = print,
    spares: int | None = None,
) -> Settings:
    """`spares`: that many more node agents, and the cluster told to hold that many healthy idle
    nodes back for recovering gangs (None: the spare pool stays as the cluster has it)."""
    # One event loop for the whole command: the Temporal client's core runtime is not meant
    # to hop between loops.
    return asyncio.run(_up(home, nodes, gpus_per_node, ports, data_workers, say, spares))


async def _up(
    home: Path,
    nodes: int,
    gpus_per_node: int,
    ports: Ports,
    data_workers: int,
    say: Callable[[str], None],
    spares: int | None,
) -> Settings:
    # The whole stack on one machine: Temporal's and MLflow's servers (control), data workers
    # (data). Checked before anything starts, so a host's lean install fails in one line.
    require_extra("all", "forgeline up")
    home.mkdir(parents=True, exist_ok=True)
    agents = [node_name(index) for index in range(nodes + (spares or 0))]
    peak = 0.0
    if any(not ManagedProcess(home, name).running() for name in agents):
        # The agents' CPU slots' peak, before anything here starts (infra.node_hardware).
        from infra.node_hardware import measured_matmul_peak  # late: it imports torch

        peak = measured_matmul_peak()
    recorded = load_settings(home)
    env = {"FORGELINE_HOME": str(home)}

    temporal = ManagedProcess(home, TEMPORAL)
    # Settings that point elsewhere are used as they are: no local server behind them.
    if external := set_in_environment("temporal_address"):
        temporal_address, ui_url = external, recorded.temporal_ui_url
        say(f"temporal      external at {temporal_address} ({setting_label('temporal_address')})")
    elif temporal.running() and _settles(temporal, recorded.temporal_address):
        temporal_address, ui_url = recorded.temporal_address, recorded.temporal_ui_url
        say(f"temporal      running (pid {temporal.pid()}) at {temporal_address}")
    else:
        port = _port(ports.temporal, _port_of(recorded.temporal_address), DEFAULT_PORTS["temporal"])
        ui_port = _port(ports.ui, _port_of(recorded.temporal_ui_url), DEFAULT_PORTS["ui"], port)
        argv = temporal_dev_server_argv(
            home / "temporal.db", port, ui_port, search_attributes=SEARCH_ATTRIBUTE_TYPES
        )
        temporal.start(argv, env)
        wait_until(lambda: port_is_open("127.0.0.1", port), 60, "Temporal dev server", temporal)
        temporal_address, ui_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}"
        say(f"temporal      started (pid {temporal.pid()}) at {temporal_address}")

    mlflow = ManagedProcess(home, MLFLOW)
    if external := set_in_environment("mlflow_uri"):
        mlflow_uri = external
        if not http_ok(f"{mlflow_uri.rstrip('/')}/health"):
            raise StackError(
                f"MLflow at {mlflow_uri} ({setting_label('mlflow_uri')}) does not answer: "
                "start it, or unset the variable to run a local one"
            )
        say(f"mlflow        external at {mlflow_uri}")
    elif mlflow.running():
        mlflow_uri = recorded.mlflow_uri
        say(f"mlflow        running (pid {mlflow.pid()}) at {mlflow_uri}")
    else:
        port = _port(ports.mlflow, _port_of(recorded.mlflow_uri), DEFAULT_PORTS["mlflow"])
        mlflow_uri = f"http://127.0.0.1:{port}"
        login = mlflow_login.prepare(home, mlflow_uri)
        server_env = {**env, **MLFLOW_SERVER_ENV, **login.server_env(home)}
        mlflow.start(mlflow_server_argv(home, port, basic_auth=True), server_env)
        wait_until(lambda: http_ok(f"{mlflow_uri}/health"), 120, "MLflow server", mlflow)
        mlflow_login.add_viewer(login)
        say(f"mlflow        started (pid {mlflow.pid()}) at {mlflow_uri}")
    # Forgeline's processes (started below, and this one) write as Forgeline; people read.
    mlflow_login.use_local_login(home, mlflow_uri)

    api = ManagedProcess(home, API)
    if api.running():
        api_url = recorded.api_url
    else:
        port = _port(ports.api, _port_of(recorded.api_url), DEFAULT_PORTS["api"])
        api_url = f"http://127.0.0.1:{port}"

    # Everything else as it was set (namespace, TLS, the API key, the stores). The local data
    # worker reads local sources from the folder the stack was started in, too.
    settings = dataclasses.replace(
        recorded,
        temporal_address=temporal_address,
        temporal_ui_url=ui_url,
        mlflow_uri=mlflow_uri,
        api_url=api_url,
        data_roots=recorded.data_roots or os.pathsep.join([os.getcwd(), *default_data_roots(home)]),
    )
    settings.save()
    # One command for one person: the local user is the stack's admin (infra.tokens).
    me = ensure_local_admin(home, _local_person())
    if api.running():
        say(f"api           running (pid {api.pid()}) at {api_url}")
    else:
        api.start(
            [sys.executable, "-m", "worker.cli", "api", "--port", str(_port_of(api_url))], env
        )
        wait_until(lambda: http_ok(f"{api_url}/openapi.json"), 60, "Forgeline API", api)
        say(f"api           started (pid {api.pid()}) at {api_url}")
    say(f"you           {me.person}, admin (token in {home / LOCAL_TOKEN_FILE})")
    client = await get_client(
        settings, f"check {setting_label('temporal_address')}, or unset it to run a local one"
    )
    await ensure_search_attributes(client)
    await ensure_cluster(client)

    # The workers and agents serve their own /metrics, each on a free port it writes to
    # run/NAME.metrics (worker.process_metrics.endpoints lists them).
    measured = {**env, METRICS_ADDRESS_ENV: "127.0.0.1:0"}
    control = ManagedProcess(home, CONTROL)
    if control.running():
        say(f"control       running (pid {control.pid()})")
    else:
        control.start(_worker_argv("control"), measured)
        say(f"control       started (pid {control.pid()})")

    if settings.twin_store_url:
        replicator = ManagedProcess(home, REPLICATOR)
        if replicator.running():
            say(f"{REPLICATOR:<13} running (pid {replicator.pid()})")
        else:
            replicator.start(_worker_argv(REPLICATOR), env)
            say(f"{REPLICATOR:<13} started (pid {replicator.pid()}) to {settings.twin_store_url}")

    for index in range(data_workers):
        name = f"{DATA_PREFIX}{index}"
        worker = ManagedProcess(home, name)
        if worker.running():
            say(f"{name:<13} running (pid {worker.pid()})")
        else:
            worker.start(_worker_argv("data", "--name", name), measured)
            say(f"{name:<13} started (pid {worker.pid()})")

    expected: dict[str, str | None] = {}
    confinement = _local_confinement(say) if agents else []
    for name in agents:
        agent = ManagedProcess(home, name)
        if agent.running():
            expected[name] = None
            say(f"{name:<13} running (pid {agent.pid()})")
            continue
        incarnation = uuid.uuid4().hex
        agent.start(
            _worker_argv(
                "node", "--node-id", name, "--gpus", str(gpus_per_node),
                "--incarnation", incarnation, "--peak-flops", repr(peak), *confinement,
            ),
            measured,
        )  # fmt: skip
        expected[name] = incarnation
        say(f"{name:<13} started (pid {agent.pid()}, {gpus_per_node} GPU slots)")

    state = await _wait_for_nodes(
        client, expected, [control, *_processes(home, NODE_PREFIX), *_processes(home, DATA_PREFIX)]
    )
    for node in state.nodes:
        if node.info.node_id in expected and node.health == Health.DOWN:
            say(
                f"{node.info.node_id:<13} its agent runs, but the cluster has the node down "
                f"({node.down_reason}): it gets no work until its agent restarts "
                f"(`kill {ManagedProcess(home, node.info.node_id).pid()}`, then `forgeline up`)"
            )
    if spares is not None:
        await _hold_spares(client, state.config, spares, say)
    return settings


def _settles(server: ManagedProcess, address: str, within_s: float = 20.0) -> bool:
    """Whether a server we started and that still runs answers at `address` (waiting for it
    while it is still starting), False once it has exited. A server stopped a moment ago may
    still be on its way down: `up` then took it for running and failed to reach it ("cannot
    reach Temporal ... connection refused", found by bench/soak.py); now it waits for the end
    and starts it again."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not server.running():
            return False
        if port.isdigit() and port_is_open(host or "127.0.0.1", int(port)):
            return True
        time.sleep(0.2)
    return True  # neither: reaching it fails below, naming the address


def _local_confinement(say: Callable[[str], None]) -> list[str]:
    """The local stack's agents box their ranks where this machine can (bwrap); where it cannot,
    this is one person's machine running their own code: the agents run it unconfined, and say
    so here, once."""
    from infra.sandbox import SandboxUnavailable, check
    from trainer.rank_box import UNCONFINED_FORM

    try:
        check()
    except SandboxUnavailable as why:
        say(f"ranks         run unconfined on this machine: {why}")
        return ["--unconfined-user-code", UNCONFINED_FORM]
    return []


async def _hold_spares(
    client: Client, config: ClusterConfig, spares: int, say: Callable[[str], None]
) -> None:
    """Set the cluster's spare pool, keeping the rest of its configuration (pods, queues) as
    `forgeline cluster apply` left it. The Cluster workflow picks which idle nodes are held."""
    if config.spare_nodes != spares:
        await apply_config(client, config.model_copy(update={"spare_nodes": spares}))
    say(f"spares        {spares} healthy idle node(s) held back for recovering gangs")


def _ready(node: Node, expected: dict[str, str | None]) -> bool:
    """An agent started now: registered with its new incarnation and up. One that was already
    running: registered, whatever the cluster thinks of its health (a gang may have reported it
    dead after a hang; waiting cannot change that, and `up` says so below)."""
    wanted = expected.get(node.info.node_id)
    if wanted is None:
        return True
    return node.info.incarnation == wanted and node.health != Health.DOWN


async def _wait_for_nodes(
    client: Client,
    expected: dict[str, str | None],
    processes: list[ManagedProcess],
    timeout: float = 120.0,
) -> ClusterState:
    """Until every node agent has registered (with the incarnation we just started it with)
    and the control worker answers queries: then a run submitted next is scheduled at once."""
    handle = client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        for process in processes:
            if not process.running():
                raise StackError(f"{process.name} exited during start-up:\n{process.log_tail()}")
        try:
            # rpc_timeout, not asyncio.wait_for: a cancelled query left running inside the
            # client's core can call back into a finalizing interpreter and abort it.
            state = await handle.query(
                "state", result_type=ClusterState, rpc_timeout=timedelta(seconds=5)
            )
        except Exception:  # the control worker is still starting: queries need a worker
            state = None
        if state is not None:
            ready = {n.info.node_id for n in state.nodes if _ready(n, expected)}
            if set(expected) <= ready:
                return state
        if loop.time() > deadline:
            raise StackError(f"node agents did not register within {timeout:.0f} s")
        await asyncio.sleep(0.5)


def _processes(home: Path, prefix: str) -> list[ManagedProcess]:
    """The processes of one kind (node agents, data workers) that have a pid file."""
    run_dir = home / "run"
    names = sorted(p.stem for p in run_dir.glob(f"{prefix}*.pid")) if run_dir.is_dir() else []
    return [ManagedProcess(home, name) for name in names]


def down(home: Path, say: Callable[[str], None] = print) -> None:
    """Stop node agents first (they stop their ranks), then the workers, then the servers."""
    for process in [
        *_processes(home, NODE_PREFIX),
        *_processes(home, DATA_PREFIX),
        ManagedProcess(home, API),
        ManagedProcess(home, CONTROL),
        ManagedProcess(home, REPLICATOR),
        ManagedProcess(home, MLFLOW),
        ManagedProcess(home, TEMPORAL),
    ]:
        if process.stop(timeout=20):
            say(f"{process.name:<13} stopped")
