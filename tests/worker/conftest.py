"""The spec checks of s3:// sources list a real S3-compatible server (moto over HTTP)."""

from __future__ import annotations

from tests.s3_server import bucket, endpoint, raw

__all__ = ["bucket", "endpoint", "raw"]
