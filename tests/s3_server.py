"""A real S3-compatible server (moto) over HTTP on loopback, for the tests that need one.

The fixtures are imported by the conftest of each test package that uses them (tests/infra,
tests/dataprep, tests/worker): each package gets its own server, on a port the OS picks, and
the AWS variables it sets last only as long as that package's tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

from infra.store.s3 import client_config

# Removed so that nothing from the machine's own AWS setup leaks into the tests.
_AWS_ENV_UNSET = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


@pytest.fixture(scope="package")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 on a port the OS picks, reached through boto3's standard env chain only."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    nowhere = tmp_path_factory.mktemp("aws") / "absent"
    with pytest.MonkeyPatch.context() as env:
        for name in _AWS_ENV_UNSET:
            env.delenv(name, raising=False)
        env.setenv("AWS_ENDPOINT_URL", url)
        env.setenv("AWS_ACCESS_KEY_ID", "forgeline-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "forgeline-test-secret")
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_CONFIG_FILE", str(nowhere))
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield url
    server.stop()


def new_client(max_attempts: int = 5) -> Any:
    return boto3.session.Session().client("s3", config=client_config(max_attempts=max_attempts))


@pytest.fixture(scope="package")
def raw(endpoint: str) -> Any:
    """A plain S3 client, to set up and tamper with objects behind the store's back."""
    return new_client()


@pytest.fixture
def bucket(raw: Any) -> str:
    name = f"forgeline-{uuid.uuid4().hex[:12]}"
    raw.create_bucket(Bucket=name)
    return name
