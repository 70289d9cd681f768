"""Reaching a production-like Temporal: TLS with a private CA, mTLS, a server name and an API
key, against the real dev server behind a TLS-terminating proxy; and no secret of the
environment in what the client puts into histories.

The dev server speaks plaintext gRPC only, so `TlsProxy` terminates TLS (HTTP/2 by ALPN, as a
load balancer in front of a cluster does) and passes the bytes through to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import BaseModel
from temporalio import activity
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import WorkflowFailureError
from temporalio.worker import Worker

from infra.local_servers import temporal_dev_server_argv
from infra.processes import ManagedProcess, free_port, port_is_open, wait_until
from infra.settings import Settings, load_settings
from tests.worker.leaky_workflow import LEAK_ACTIVITY, LeakyWorkflow
from trainer.manifest import manifest_key
from worker.temporal_client import DATA_CONVERTER, TemporalUnreachable, connect, connect_options
from workflows.cluster_calls import gang_request
from workflows.contracts.cluster_models import Allocation, NodeInfo
from workflows.contracts.models import (
    CheckpointRef,
    DatasetInput,
    DatasetRef,
    Decision,
    DecisionInput,
    EvalResult,
    EvaluateInput,
    LatestCheckpointInput,
    ModelVersionRef,
    NodeTrainInput,
    RegisterInput,
    TrackingInput,
    TrainingRunInput,
)
from workflows.contracts.spec import RunSpec

SERVER_NAME = "temporal.forgeline.test"  # the only name in the server's certificate
API_KEY = "tmprl-test-api-key-0123456789abcdef"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"

# --- a private PKI: a CA, a server certificate and a client certificate it signed ----------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    """A CA when `issuer` is None (self-signed), else a leaf for `usage` signed by `issuer`."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
        )
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("Forgeline test CA", ca_key, None)
    files = {"ca": ca.public_bytes(serialization.Encoding.PEM)}
    for role, usage, subject in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, SERVER_NAME),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, "node-agent"),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(subject, key, (ca, ca_key), usage)
        files[f"{role}_cert"] = cert.public_bytes(serialization.Encoding.PEM)
        files[f"{role}_key"] = _key_pem(key)
    paths = {}
    for role, data in files.items():
        paths[role] = folder / f"{role}.pem"
        paths[role].write_bytes(data)
    return Pki(**paths)


# --- the dev server, and a TLS-terminating proxy in front of it -----------------------------


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    home = tmp_path_factory.mktemp("temporal")
    port = free_port()
    server = ManagedProcess(home, "temporal")
    server.start(temporal_dev_server_argv(home / "temporal.db", port, 0, headless=True))
    try:
        wait_until(lambda: port_is_open("127.0.0.1", port), 60, "Temporal dev server", server)
        yield port
    finally:
        server.stop()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # either side hanging up ends the tunnel
    finally:
        with contextlib.suppress(ConnectionError, ssl.SSLError, RuntimeError):
            writer.close()


@contextlib.asynccontextmanager
async def tls_proxy(
    pki: Pki, upstream_port: int, *, require_client_cert: bool
) -> AsyncIterator[int]:
    """Serve TLS (h2) on a free port, forwarding the decrypted bytes to the dev server."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.set_alpn_protocols(["h2"])  # gRPC insists on HTTP/2 being negotiated
    if require_client_cert:  # mTLS: only clients with a certificate from our CA get through
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki.ca)

    async def tunnel(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))

    server = await asyncio.start_server(tunnel, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        # Not wait_closed(): a temporalio client keeps its connection open until it is dropped.
        server.close()


def _settings(tmp_path: Path, port: int, **tls: object) -> Settings:
    return Settings(home=tmp_path, temporal_address=f"127.0.0.1:{port}", **tls)  # type: ignore[arg-type]


async def _namespace_of(settings: Settings) -> str:
    """Connect and ask the server one thing: the name of the namespace the settings name."""
    client = await connect(settings)
    described = await client.workflow_service.describe_namespace(
        DescribeNamespaceRequest(namespace=client.namespace)
    )
    return described.namespace_info.name


# --- the tests ----------------------------------------------------------------------------


def test_mtls_with_a_private_ca_server_name_and_api_key(
    pki: Pki,
    dev_server: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("FORGELINE_TEMPORAL_API_KEY", API_KEY)
    for name, value in {
        "CA": pki.ca,
        "CERT": pki.client_cert,
        "KEY": pki.client_key,
        "SERVER_NAME": SERVER_NAME,
    }.items():
        monkeypatch.setenv(f"FORGELINE_TEMPORAL_TLS_{name}", str(value))

    async def main() -> None:
        async with tls_proxy(pki, dev_server, require_client_cert=True) as port:
            monkeypatch.setenv("FORGELINE_TEMPORAL_ADDRESS", f"127.0.0.1:{port}")
            client = await connect(load_settings(tmp_path))
            described = await client.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace="default")
            )
            assert described.namespace_info.name == "default"
            assert [w async for w in client.list_workflows(limit=1)] == []
            assert client.api_key == API_KEY  # temporalio sends it as Authorization metadata

    with caplog.at_level("DEBUG"):
        asyncio.run(main())
    assert API_KEY not in caplog.text


TLS_FILES = ("temporal_tls_ca", "temporal_tls_cert", "temporal_tls_key")
# Each way a client can misfit a TLS port that wants mTLS, and the setting the error names.
MISFITS = {
    "plaintext": ({"temporal_tls": False}, "FORGELINE_TEMPORAL_TLS=true"),
    "untrusted server": ({"temporal_tls": True}, "FORGELINE_TEMPORAL_TLS_CA"),
    "wrong name": (
        {
            "temporal_tls_ca": "ca",
            "temporal_tls_cert": "client_cert",
            "temporal_tls_key": "client_key",
        },
        "FORGELINE_TEMPORAL_TLS_SERVER_NAME",
    ),
    "no client cert": (
        {"temporal_tls_ca": "ca", "temporal_tls_server_name": SERVER_NAME},
        "FORGELINE_TEMPORAL_TLS_CERT",
    ),
}


@pytest.mark.parametrize("misfit", MISFITS)
def test_a_client_that_misfits_the_tls_port_is_told_which_setting_to_fix(
    pki: Pki, dev_server: int, tmp_path: Path, misfit: str
) -> None:
    options, fix = MISFITS[misfit]
    # A TLS file setting names one of the PKI's files ("ca", "client_cert", ...).
    tls = {k: str(getattr(pki, v)) if k in TLS_FILES else v for k, v in options.items()}

    async def main() -> None:
        async with tls_proxy(pki, dev_server, require_client_cert=True) as port:
            with pytest.raises(TemporalUnreachable, match=f"127.0.0.1:{port} over .*{fix}"):
                await asyncio.wait_for(_namespace_of(_settings(tmp_path, port, **tls)), 30)

    asyncio.run(main())


def test_without_tls_settings_the_client_speaks_plaintext(dev_server: int, tmp_path: Path) -> None:
    options = connect_options(_settings(tmp_path, dev_server))
    assert (options["tls"], options["api_key"]) == (False, None)
    assert asyncio.run(_namespace_of(_settings(tmp_path, dev_server))) == "default"


# --- secrets never reach a history --------------------------------------------------------


@activity.defn(name=LEAK_ACTIVITY)
async def leak() -> None:
    # What a careless client library might do: quote a credential in its error, and in the
    # error's cause.
    try:
        raise ValueError(f"signature computed with {SECRET}")
    except ValueError as cause:
        raise RuntimeError(f"S3 PUT refused; request signed with secret {SECRET}") from cause


def test_an_activity_error_quoting_a_secret_reaches_the_history_masked(
    dev_server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    async def main() -> str:
        client = await connect(_settings(tmp_path, dev_server))
        queue = f"leak-{uuid.uuid4().hex[:8]}"
        async with Worker(client, task_queue=queue, workflows=[LeakyWorkflow], activities=[leak]):
            handle = await client.start_workflow(
                LeakyWorkflow.run, id=f"leaky-{uuid.uuid4().hex[:8]}", task_queue=queue
            )
            with pytest.raises(WorkflowFailureError):
                await handle.result()
        return (await handle.fetch_history()).to_json()

    history = asyncio.run(main())
    assert SECRET not in history
    assert "S3 PUT refused; request signed with secret ***" in history
    assert "signature computed with ***" in history


def test_workflow_inputs_built_with_secrets_in_the_environment_carry_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLE-session-token",
        "FORGELINE_TEMPORAL_API_KEY": API_KEY,
        "MLFLOW_TRACKING_PASSWORD": "mlflow-password-123",
        "MLFLOW_TRACKING_TOKEN": "mlflow-token-0123456789",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    settings = load_settings(tmp_path)  # holds the API key now
    wire = b"".join(
        payload.data
        for payload in DATA_CONVERTER.payload_converter.to_payloads(
            [*representative_inputs(), settings]  # Settings too, were one ever sent by mistake
        )
    )
    for value in secrets.values():
        assert value.encode() not in wire


def representative_inputs() -> list[BaseModel]:
    """One of each kind of workflow and activity input, built as the code builds them."""
    spec = RunSpec.model_validate(
        {"name": "secret-free", "owner": "ada", "data": {"sources": ["/data/corpus.txt"]}}
    )
    now = datetime.datetime.now(datetime.UTC)
    node = NodeInfo(node_id="node-0", rdzv_port=29500, incarnation=uuid.uuid4().hex)
    dataset = DatasetRef(
        snapshot_id="abc123",
        manifest_key="datasets/abc123/MANIFEST.json",
        manifest_sha256="0" * 64,
        vocab_size=65,
        train_tokens=1000,
        val_tokens=100,
        documents=10,
        duplicates_removed=0,
    )
    checkpoint = CheckpointRef(
        manifest_key=manifest_key(spec.name, 10, 1), step=10, generation=1, tokens_seen=1000
    )
    allocation = Allocation(run_id=spec.name, generation=1, nodes=[node], granted_at=now)
    evaluation = EvalResult(step=10, val_loss=1.5, perplexity=4.5, val_tokens=100, sample="x")
    version = ModelVersionRef(model_name=spec.model_name, version="1", mlflow_run_id="r" * 32)
    return [
        TrainingRunInput(spec=spec, spec_sha256="0" * 64, submitted_by=spec.owner),
        DatasetInput(data=spec.data, requested_by=spec.name),
        gang_request(spec, dataset.snapshot_id, recovering=False, submitted_at=now),
        node,
        NodeTrainInput(
            run_id=spec.name, spec=spec, dataset=dataset, allocation=allocation, node_id="node-0"
        ),
        LatestCheckpointInput(run_id=spec.name, max_generation=1),
        EvaluateInput(run_id=spec.name, spec=spec, dataset=dataset, checkpoint=checkpoint),
        TrackingInput(run_id=spec.name, workflow_run_id="w", spec=spec, spec_sha256="0" * 64),
        RegisterInput(
            run_id=spec.name,
            workflow_run_id="w",
            spec=spec,
            spec_sha256="0" * 64,
            dataset=dataset,
            checkpoint=checkpoint,
            evaluation=evaluation,
        ),
        DecisionInput(
            version=version, decision=Decision(approver="bob", approve=True), decided_at=now
        ),
    ]
