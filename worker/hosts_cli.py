"""`forgeline agent`, `forgeline control`, `forgeline data worker`: Forgeline's processes on hosts
of their own, against a Temporal cluster, an object store and an MLflow server.

`forgeline up` starts the same processes on one machine. Here each takes its settings from the
environment (FORGELINE_TEMPORAL_ADDRESS, FORGELINE_STORE, FORGELINE_MLFLOW_URI, ...; see
`infra/settings.py`) or from the options below, checks that every service it needs answers, and
refuses to start with one line when one does not.
"""

from __future__ import annotations

import urllib.parse
from typing import Annotated

import typer

from infra.extras import require_extra
from infra.settings import Settings
from worker.cli_common import (
    CliError,
    UnconfinedOption,
    check_name,
    checked_unconfined_form,
    console,
    get_settings,
    parse_topology,
)
from worker.cli_common import run as run_async
from worker.preflight import apply_overrides, preflight, require_settings

commands = typer.Typer()

TemporalOption = Annotated[
    str | None,
    typer.Option(help="host:port of Temporal's frontend (env FORGELINE_TEMPORAL_ADDRESS)"),
]
NamespaceOption = Annotated[
    str | None, typer.Option(help="Temporal namespace (env FORGELINE_TEMPORAL_NAMESPACE)")
]
StoreOption = Annotated[
    str | None,
    typer.Option(help="s3://bucket/prefix[?endpoint=URL] or a folder (env FORGELINE_STORE)"),
]
MlflowOption = Annotated[
    str | None, typer.Option(help="MLflow tracking server URL (env FORGELINE_MLFLOW_URI)")
]


def _settings_for(
    process: str,
    temporal_address: str | None,
    namespace: str | None,
    store: str | None,
    mlflow_uri: str | None,
) -> Settings:
    apply_overrides(
        {
            "FORGELINE_TEMPORAL_ADDRESS": temporal_address,
            "FORGELINE_TEMPORAL_NAMESPACE": namespace,
            "FORGELINE_STORE": store,
            "FORGELINE_MLFLOW_URI": mlflow_uri,
        }
    )
    require_settings(process)
    settings = get_settings()
    preflight(process, settings)
    return settings


@commands.command()
def agent(
    node_id: Annotated[
        str,
        typer.Option(envvar="FORGELINE_NODE_ID", help="this node's name in the cluster, unique"),
    ],
    gpus: Annotated[
        int | None,
        typer.Option(min=1, help="GPUs to offer (default: all NVML sees; no GPUs: a slot a core)"),
    ] = None,
    pod: Annotated[
        str, typer.Option(envvar="FORGELINE_POD", help="the fabric island (pod) this node is in")
    ] = "default",
    topology: Annotated[
        str,
        typer.Option(
            envvar="FORGELINE_TOPOLOGY",
            help="where this node sits inside its pod, by the cluster's levels: block=b1,rack=r3",
        ),
    ] = "",
    advertise_address: Annotated[
        str | None,
        typer.Option(
            help="address peers reach this node at (default: the one that routes to Temporal)"
        ),
    ] = None,
    rdzv_ports: Annotated[
        str, typer.Option(help="ports kept free for the gangs' rendezvous: one a grant, in turn")
    ] = "29400-29463",
    temporal_address: TemporalOption = None,
    namespace: NamespaceOption = None,
    store: StoreOption = None,
    mlflow_uri: MlflowOption = None,
    unconfined_user_code: UnconfinedOption = None,
) -> None:
    """One per GPU host: runs the ranks of the gangs this node is granted."""
    from infra.host_network import address_towards, interface_of
    from infra.node_hardware import discover
    from trainer.launch import Fabric
    from worker.processes_main import RendezvousPorts, run_node_agent

    checked_unconfined_form(unconfined_user_code)
    node_id = check_name(node_id, "node id")
    pod = check_name(pod, "pod")
    position = parse_topology(topology)
    try:
        ports = RendezvousPorts.parse(rdzv_ports)
    except ValueError as err:
        raise CliError(f"--rdzv-ports: {err}") from None
    settings = _settings_for("agent", temporal_address, namespace, store, mlflow_uri)
    target = urllib.parse.urlsplit(f"//{settings.temporal_address}")
    address = advertise_address or address_towards(target.hostname or "", target.port or 7233)
    fabric = Fabric(address, interface_of(address))
    hardware = discover(slots=gpus)
    console.print(
        f"node {node_id}: {hardware.describe()}; peers reach it at {address} ({fabric.interface})"
    )
    run_async(
        run_node_agent(
            settings, node_id, hardware, fabric, pod, ports=ports, topology=position,
            unconfined_user_code=unconfined_user_code,
        )
    )  # fmt: skip


@commands.command()
def control(
    temporal_address: TemporalOption = None,
    namespace: NamespaceOption = None,
    store: StoreOption = None,
    mlflow_uri: MlflowOption = None,
) -> None:
    """The control worker: runs the workflows (runs, the cluster, datasets) and evaluation and
    registration. One is enough; more share the work."""
    from worker.processes_main import run_control_worker

    require_extra("control", "forgeline control")
    settings = _settings_for("control", temporal_address, namespace, store, mlflow_uri)
    run_async(run_control_worker(settings))


def data_worker(
    name: Annotated[str, typer.Option(help="this worker's name, in logs and reports")] = "data-0",
    temporal_address: TemporalOption = None,
    namespace: NamespaceOption = None,
    store: StoreOption = None,
) -> None:
    """A data worker: prepares dataset snapshots (one stage at a time; add workers to go
    faster)."""
    from worker.processes_main import run_data_worker

    name = check_name(name, "worker name")
    require_extra("data", "forgeline data worker")
    settings = _settings_for("data worker", temporal_address, namespace, store, None)
    run_async(run_data_worker(settings, name))
