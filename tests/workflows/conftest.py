"""A task queue per workflow test; the session's Temporal dev server is tests/conftest.py's."""

from __future__ import annotations

import uuid

import pytest

from tests.conftest import CONTINUE_AS_NEW_AFTER
from tests.s3_server import bucket, endpoint, raw

__all__ = ["CONTINUE_AS_NEW_AFTER", "bucket", "endpoint", "raw", "task_queue"]  # S3: moto over HTTP


@pytest.fixture
def task_queue() -> str:
    """A fresh task queue per test, so no test's worker picks up another's tasks."""
    return f"test-{uuid.uuid4().hex[:12]}"
