"""What S3 answers, as Forgeline's store errors: one line that names the object and the fix.

The error codes below are S3's and those of the S3-compatible servers seen so far (MinIO,
moto); botocore's own exceptions cover what never reached a server.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as EndpointUnreachable
from s3transfer.exceptions import RetriesExceededError

from infra.errors import ObjectNotFound, StoreError, StoreUnavailable

PRECONDITION_FAILED = frozenset({"PreconditionFailed", "412"})
# AWS answers 409 when another conditional write to the key is in flight: try again.
CONDITIONAL_CONFLICT = "ConditionalRequestConflict"
# What servers without conditional writes answer to If-None-Match on PutObject.
NO_CONDITIONAL_WRITES = frozenset({"NotImplemented", "501", "InvalidArgument"})
NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
# Still failing after botocore's retries: the site is down or overloaded, not the request wrong.
SERVER_DOWN = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "500", "502", "503", "504"}
)
REFUSED = frozenset(
    {
        "AccessDenied",
        "Forbidden",
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
    }
)
CREDENTIALS_FIX = (
    "set AWS credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) "
    "for an identity allowed to use the bucket"
)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def store_error(exc: Exception, url: str, endpoint: str, bucket: str) -> StoreError:
    """A botocore error as a StoreError that names the object (`url`) and the fix."""
    if isinstance(exc, RetriesExceededError) and exc.last_exception is not None:
        exc = exc.last_exception
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StoreError(f"no usable AWS credentials for {url}: {CREDENTIALS_FIX}")
    if isinstance(exc, EndpointUnreachable | HTTPClientError):
        return StoreUnavailable(
            f"cannot reach the S3 endpoint {endpoint} for {url} "
            f"({type(exc).__name__}): check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) "
            "and that the server is up"
        )
    if not isinstance(exc, ClientError):
        return StoreError(f"S3 request for {url} failed: {exc}")
    code = error_code(exc)
    if code == "NoSuchBucket":
        return no_bucket(bucket, endpoint)
    if code in NOT_FOUND:
        return ObjectNotFound(f"no object at {url}")
    if code in SERVER_DOWN:
        return StoreUnavailable(
            f"the S3 endpoint {endpoint} keeps failing for {url} ({code}) after retries"
        )
    if code in REFUSED:
        return StoreError(f"S3 refused access to {url} ({code}): {CREDENTIALS_FIX}")
    if code in PRECONDITION_FAILED:
        return StoreError(f"{url} was replaced while it was being read: retry")
    message = exc.response.get("Error", {}).get("Message", "")
    return StoreError(f"S3 request for {url} failed with {code}: {message}")


def no_bucket(bucket: str, endpoint: str) -> StoreError:
    return StoreError(
        f"S3 bucket {bucket!r} does not exist at {endpoint}: create it, or point "
        "FORGELINE_STORE (store_url) at an existing bucket"
    )


def without_userinfo(url: str | None) -> str:
    """The endpoint as messages may show it: never a user or password written into the URL."""
    if not url:
        return "(default AWS endpoint)"
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
