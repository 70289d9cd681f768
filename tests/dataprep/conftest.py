"""The S3 sources' tests read from a real S3-compatible server (moto) over HTTP on loopback."""

from __future__ import annotations

from tests.s3_server import bucket, endpoint, raw

__all__ = ["bucket", "endpoint", "raw"]
