"""Shared by the store tests: a real S3-compatible server (moto) over HTTP on loopback."""

from __future__ import annotations

from tests.s3_server import bucket, endpoint, new_client, raw

__all__ = ["bucket", "endpoint", "new_client", "raw"]
