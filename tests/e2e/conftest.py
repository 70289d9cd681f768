"""The real local stack, driven through the `forgeline` CLI as a person would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import mlflow
import pytest
import torch

from infra.mlflow_login import use_local_login
from infra.processes import free_ports, port_is_open
from infra.settings import load_settings
from infra.store.protocol import ObjectStore, fetch_verified
from infra.store.s3 import S3Store, client_config
from infra.store.twin import TwinStore
from infra.tokens import LOCAL_TOKEN_FILE, TokenStore
from tests.conftest import REPO
from tests.partition import Partition
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.evaluate import load_model
from trainer.manifest import find_latest
from worker.chaos import trainer_processes
from worker.stack import free_port_flags

FORGELINE = str(Path(sys.executable).parent / "forgeline")
TINY = REPO / "examples" / "tiny.toml"
# The stack keeps datasets and checkpoints in a bucket of an S3-compatible server (moto, over HTTP
# on loopback), chosen by settings alone: FORGELINE_STORE and the standard AWS variables. A second
# server is its twin site (FORGELINE_TWIN_STORE); the primary is reached through a forwarder that
# a test can cut, as a site dropping off the network.
BUCKET, TWIN_BUCKET = "forgeline-e2e", "forgeline-e2e-twin"


@dataclass
class Sites:
    env: dict[str, str]  # the AWS variables: credentials, and the primary's endpoint
    twin_endpoint: str
    partition: Partition  # between everyone and the primary


@dataclass
class Stack:
    home: Path
    env: dict[str, str]
    sites: Sites
    tokens: dict[tuple[str, ...], str] = field(default_factory=dict)

    def _site(self, bucket: str, endpoint: str) -> S3Store:
        client = s3_client(endpoint, self.env, config=client_config(max_attempts=2))
        return S3Store(bucket, self.home.name, client=client)

    def primary(self) -> S3Store:
        return self._site(BUCKET, self.env["AWS_ENDPOINT_URL"])

    def twin(self) -> S3Store:
        return self._site(TWIN_BUCKET, self.sites.twin_endpoint)

    def store(self) -> ObjectStore:
        """The store as the stack's processes see it: the primary, the twin standing in (from
        this process's own boto3 clients: the test process's environment is left alone)."""
        return TwinStore(self.primary(), self.twin())

    @property
    def me(self) -> str:
        """The local user's person: the stack's admin, who submits the tests' runs."""
        token = (self.home / LOCAL_TOKEN_FILE).read_text().strip()
        return TokenStore(self.home).authenticate(token).person

    def token(self, person: str, *roles: str) -> str:
        """A token for `person` with `roles`, made once per stack (as an admin would)."""
        key = (person, *sorted(roles))
        if key not in self.tokens:
            made, _ = TokenStore(self.home).create(person, list(roles), created_by="e2e")
            self.tokens[key] = made
        return self.tokens[key]

    def cli(
        self,
        *args: str,
        timeout: float = 300,
        check: bool = True,
        as_person: tuple[str, ...] | None = None,
    ) -> subprocess.CompletedProcess:
        """`forgeline ARGS` as the local user (the stack's admin), or `as_person` = (PERSON,
        ROLE, ...) with a token of theirs."""
        env = self.env
        if as_person is not None:
            env = {**env, "FORGELINE_TOKEN": self.token(*as_person)}
        try:
            result = subprocess.run(
                [FORGELINE, *args], env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as err:
            output = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else ""
            raise AssertionError(
                f"forgeline {' '.join(args)} still running after {timeout:.0f} s\n"
                f"stdout:\n{output[-3000:]}\n{self.log_tails()}"
            ) from None
        if check and result.returncode != 0:
            raise AssertionError(
                f"forgeline {' '.join(args)} exited {result.returncode}\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}\n{self.log_tails()}"
            )
        return result

    def log_tails(self, lines: int = 15) -> str:
        """The end of every stack process's log: what a failure in CI leaves to go on."""
        tails = []
        for log in sorted((self.home / "logs").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(tails)

    @property
    def settings(self):
        return load_settings(self.home)


def ranks_of(home: Path, run: str) -> list[int]:
    """Pids of trainer rank or torchrun processes working on `run` under this stack's home."""
    return trainer_processes(home, run=run)


def variant(
    tmp_path: Path,
    name: str,
    team: str | None = None,
    recovery: dict[str, object] | None = None,
    registry: dict[str, object] | None = None,
    **train: int,
) -> Path:
    """examples/tiny.toml under another name, with other [train] values (any of its keys, or
    another [train] key), a team, and more [recovery] and [registry] settings."""
    text = TINY.read_text().replace('name = "tiny"', f'name = "{name}"')
    if team is not None:
        text = text.replace("[resources]\n", f'[resources]\nteam = "{team}"\n')
    for section, settings in (("recovery", recovery), ("registry", registry)):
        for key, value in (settings or {}).items():
            literal = f'"{value}"' if isinstance(value, str) else value
            text = text.replace(f"[{section}]\n", f"[{section}]\n{key} = {literal}\n")
    text = text.replace(
        '"data/tinyshakespeare.txt"', f'"{REPO / "examples" / "data" / "tinyshakespeare.txt"}"'
    )
    for key, value in train.items():
        if re.search(rf"^{key} = ", text, flags=re.M):
            text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        else:  # a [train] key the example leaves at its default
            text = text.replace("[train]\n", f"[train]\n{key} = {value}\n")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def wait_for(check: Callable[[], object], timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def node_of(pid: int) -> str | None:
    """The node whose agent started this trainer process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return None
    match = re.search(r"/nodes/([^/]+)/runs/", argv)
    return match.group(1) if match else None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def final_checkpoint(stack: Stack, run: str, scratch: Path) -> tuple[Path, dict]:
    """The run's last committed checkpoint, fetched from the store: its folder and manifest."""
    return fetched_checkpoint(stack.store(), run, scratch)


def fetched_checkpoint(
    store: ObjectStore, run: str, scratch: Path
) -> tuple[Path, CheckpointManifest]:
    """The run's last committed checkpoint in `store`, fetched: its folder and manifest."""
    found = find_latest(store, run, max_generation=10**9)
    assert found is not None, f"{run} has no committed checkpoint"
    folder = scratch / f"{run}-step-{found.step}"
    prefix = found.key.rsplit("/", 1)[0] + "/"
    for entry in found.manifest.files:
        dest = folder / entry.key.removeprefix(prefix)
        fetch_verified(store, entry.key, dest, entry.sha256, entry.bytes)
    return folder, found.manifest


def final_weights(stack: Stack, run: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The built-in GPT's weights of the run's last committed checkpoint."""
    folder, manifest = final_checkpoint(stack, run, scratch)
    return load_model(folder, manifest.network).state_dict()


def flip_a_byte(store: ObjectStore, key: str) -> bytes:
    """Corrupt an object in place, as bit rot at rest would; returns what it held."""
    original = store.get_bytes(key)
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))
    return original


def progress_events(stack: Stack, run: str, generation: int) -> list[dict]:
    """Every progress line the ranks of one generation wrote, on every node."""
    events = []
    for path in (stack.home / "nodes").glob(f"*/runs/{run}/gen-{generation}/progress.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line being written is not complete yet
                events.append(json.loads(line))
    return events


@pytest.fixture(scope="package")
def reference(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A fault-free run that others compare themselves with (same spec, another name)."""
    # Nobody decides on it: its approval window (18 s) closes and it ends EXPIRED.
    spec = variant(
        tmp_path_factory.mktemp("reference"),
        "reference",
        registry={"approval_window_hours": 0.005},
        steps=300,
        checkpoint_every=100,
    )
    stack.cli("run", str(spec))
    return "reference"


def s3_client(endpoint: str, env: dict[str, str], **options: Any) -> Any:
    """A boto3 client of this process for one site, with the stack's credentials (the test
    process's own environment is left alone)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        **options,
    )


def _s3_server(port: int, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture(scope="package")
def s3_sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sites]:
    """Two S3-compatible servers over HTTP (moto), each in its own process with its bucket: the
    primary (behind a forwarder) and the twin."""
    logs = tmp_path_factory.mktemp("s3")
    ports = dict(zip((BUCKET, TWIN_BUCKET), free_ports(2), strict=True))
    servers = [_s3_server(port, logs / f"{bucket}.log") for bucket, port in ports.items()]
    partition = Partition(ports[BUCKET])
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{partition.port}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "forgeline-e2e",
        "AWS_SECRET_ACCESS_KEY": "forgeline-e2e-secret",
    }
    try:
        for bucket, port in ports.items():
            wait_for(lambda p=port: port_is_open("127.0.0.1", p), 30, f"S3 server ({logs})")
            s3_client(f"http://127.0.0.1:{port}", env).create_bucket(Bucket=bucket)
        partition.heal()
        yield Sites(env, f"http://127.0.0.1:{ports[TWIN_BUCKET]}", partition)
    finally:
        partition.cut()
        for server in servers:
            server.terminate()
            server.wait(timeout=30)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test on the stack shows the end of every stack process's log, whatever failed:
    a timeout from pytest-timeout (which interrupts a CLI call before it can add them) included."""
    outcome = yield
    report = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("stack")
    if report.failed and call.when == "call" and isinstance(stack, Stack):
        report.sections.append(("stack logs", stack.log_tails(40)))


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_sites: Sites) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("forgeline-home")
    env = {**os.environ, "FORGELINE_HOME": str(home)}
    # Nothing of another stack's: a test run in this process before (a CLI called in-process
    # signs in to its stack's MLflow through os.environ) left its MLflow login there, and this
    # stack's control worker sent it to its own MLflow: 401 (make test on two workers).
    for name in list(env):
        if name.startswith(("FORGELINE_", "AWS_", "MLFLOW_")) and name != "FORGELINE_HOME":
            del env[name]
    env |= s3_sites.env | {
        # The stack reads the corpora of examples/ wherever pytest was started.
        "FORGELINE_DATA_ROOTS": str(REPO / "examples" / "data"),
        # podman as this kind of host needs it (tests/e2e/test_image.py): runc, not crun.
        "CONTAINERS_CONF": str(REPO / "tests" / "e2e" / "containers.conf"),
        "FORGELINE_STORE": f"s3://{BUCKET}/{home.name}",
        "FORGELINE_TWIN_STORE": f"s3://{TWIN_BUCKET}/{home.name}?endpoint={s3_sites.twin_endpoint}",
    }
    s = Stack(home, env, s3_sites)
    before = dict(os.environ)
    try:
        s.cli("up", "--nodes", "3", "--gpus-per-node", "1", *free_port_flags(), timeout=240)
        # The tests' own MLflow clients sign in as Forgeline's processes do (its MLflow answers
        # to nobody else); the environment is restored for the packages after this one.
        for name in [n for n in os.environ if n.startswith("MLFLOW_TRACKING_")]:
            del os.environ[name]  # another stack's login would win (use_local_login keeps it)
        use_local_login(home, s.settings.mlflow_uri)
        # And this process's MLflow points here: registry code a test ran in-process before
        # (registry.tracking) left its own SQLite file as the registry of every client made
        # with a tracking URI alone ("Registered Model with name=tiny not found").
        mlflow.set_tracking_uri(s.settings.mlflow_uri)
        mlflow.set_registry_uri(s.settings.mlflow_uri)
        yield s
    finally:
        os.environ.clear()
        os.environ.update(before)
        s.cli("down", timeout=120, check=False)
        leftovers = [p for p in (home / "run").glob("*.pid")]
        assert leftovers == [], f"`forgeline down` left pid files: {leftovers}"
