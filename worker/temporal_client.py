"""One way to reach Temporal, with the pydantic converter every model on the wire needs.

A production cluster is reached over TLS (a private CA, mTLS client certificate, a server name
override) and/or with an API key; `connect_options` turns the settings into `Client.connect`'s
arguments. The API key travels only as gRPC metadata (temporalio sends it as the Authorization
header); nothing here logs or records it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.failure.v1 import Failure
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverter, PayloadConverter
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

from infra.redact import redact_text
from infra.settings import Settings, SettingsError, setting_label
from workflows import search_attributes
from workflows.contracts.cluster_models import ClusterState
from workflows.contracts.names import CLUSTER_WORKFLOW_ID, CONTROL_TASK_QUEUE


class RedactingFailureConverter(DefaultFailureConverter):
    """Failures become part of workflow histories, kept for as long as the namespace keeps
    them: scrub the secrets of the environment out of every message and stack trace an
    activity's exception carries (an S3 or MLflow error quoting a request, a command line)."""

    def to_failure(
        self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure
    ) -> None:
        super().to_failure(exception, payload_converter, failure)  # recurses into causes
        # Workflow code holds no secrets and may do no I/O; the activity failures it wraps
        # were scrubbed on the worker that ran the activity.
        if workflow.in_workflow():
            return
        failure.message = redact_text(failure.message)
        failure.stack_trace = redact_text(failure.stack_trace)


DATA_CONVERTER: DataConverter = dataclasses.replace(
    pydantic_data_converter, failure_converter_class=RedactingFailureConverter
)


def _read_tls_file(settings: Settings, name: str) -> bytes | None:
    path = getattr(settings, name)
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:  # checked when the settings loaded; gone or unreadable since
        raise SettingsError(
            f"{setting_label(name)}: cannot read {path} ({err.strerror or err})"
        ) from None


def tls_config(settings: Settings) -> TLSConfig | bool:
    """What `Client.connect(tls=...)` gets: False (plaintext), True (TLS with the system's
    roots), or a TLSConfig when a CA, a client certificate or a server name is set."""
    if not settings.temporal_tls_enabled:
        return False
    ca = _read_tls_file(settings, "temporal_tls_ca")
    cert = _read_tls_file(settings, "temporal_tls_cert")
    key = _read_tls_file(settings, "temporal_tls_key")
    server_name = settings.temporal_tls_server_name or None
    if ca is None and cert is None and server_name is None:
        return True
    return TLSConfig(
        server_root_ca_cert=ca, client_cert=cert, client_private_key=key, domain=server_name
    )


def connect_options(settings: Settings) -> dict[str, Any]:
    """`Client.connect`'s keyword arguments for these settings (all but the address)."""
    api_key = settings.temporal_api_key
    return {
        "namespace": settings.temporal_namespace,
        "data_converter": DATA_CONVERTER,
        # Explicit, never None: temporalio would otherwise pick TLS from the API key itself,
        # and Forgeline's settings already decided (temporal_tls_enabled).
        "tls": tls_config(settings),
        "api_key": api_key.get_secret_value() if api_key is not None else None,
    }


class TemporalUnreachable(RuntimeError):
    """Temporal could not be reached as configured; the message says what to change.

    A RuntimeError, as temporalio's own connection errors are, so callers catching those
    still catch this."""


_MTLS_HINT = (
    "it wants a client certificate (mTLS): set temporal_tls_cert and temporal_tls_key "
    "(FORGELINE_TEMPORAL_TLS_CERT, FORGELINE_TEMPORAL_TLS_KEY)"
)
# Substrings of the transport's errors, and the setting that most likely fixes each.
_TLS_HINTS = (
    ("UnknownIssuer", "its certificate is not signed by a CA this client trusts: set "
     "temporal_tls_ca (FORGELINE_TEMPORAL_TLS_CA) to the CA that signed it"),
    ("NotValidForName", "its certificate is not for the name dialled: set "
     "temporal_tls_server_name (FORGELINE_TEMPORAL_TLS_SERVER_NAME) to a name it carries"),
    ("CertificateRequired", _MTLS_HINT),
)  # fmt: skip
_PLAINTEXT_HINT = (
    "it did not answer plaintext gRPC: if it expects TLS, set FORGELINE_TEMPORAL_TLS=true "
    "(and FORGELINE_TEMPORAL_TLS_CA for a private CA)"
)
# The transport connected, then the first call failed: the server hung up on what it got.
_AFTER_CONNECTING = "after connection"


def _diagnosis(settings: Settings, raw: str) -> str | None:
    """The likely fix for a failed connection, from the transport's error text."""
    if "Connection refused" in raw:
        return "nothing listens there"
    if not settings.temporal_tls_enabled:
        return _PLAINTEXT_HINT if _AFTER_CONNECTING in raw or "transport error" in raw else None
    if hint := next((hint for marker, hint in _TLS_HINTS if marker in raw), None):
        return hint
    if _AFTER_CONNECTING in raw:
        # TLS 1.3 checks a client's certificate after the client sees the handshake done, so a
        # refused (or missing) one surfaces as a hang-up on the first call.
        if not settings.temporal_tls_cert:
            return _MTLS_HINT
        return "it hung up after the TLS handshake: check that it trusts temporal_tls_cert's CA"
    return None


async def connect(settings: Settings, runtime: Runtime | None = None) -> Client:
    """`runtime`: the process's Temporal runtime when it exports the SDK's metrics
    (worker.process_metrics); the default one otherwise."""
    try:
        return await Client.connect(
            settings.temporal_address, **connect_options(settings), runtime=runtime
        )
    except RuntimeError as err:
        raw = redact_text(str(err))  # the transport's words; the API key is never in them
        mode = "TLS" if settings.temporal_tls_enabled else "plaintext"
        hint = _diagnosis(settings, raw)
        raise TemporalUnreachable(
            f"Temporal at {settings.temporal_address} over {mode}: "
            + (f"{hint} (cause: {raw})" if hint else raw)
        ) from None


async def ensure_cluster(client: Client) -> WorkflowHandle:
    """Start the singleton Cluster workflow unless it runs already."""
    return await client.start_workflow(
        "Cluster",
        ClusterState(),
        id=CLUSTER_WORKFLOW_ID,
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


async def ensure_search_attributes(client: Client) -> list[str]:
    """Add the TrainingRun's search attributes the server lacks (a Temporal database made
    before they existed, or a cluster of your own); returns the names added. A run that upserts
    an attribute the server does not know would stall, so `up` and the control worker ask."""
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        key.name: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
        for key in search_attributes.ALL
        if key.name not in listed.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
    return sorted(missing)
