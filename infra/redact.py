"""Keep credentials out of what Forgeline writes down: logs, error messages, MLflow, histories.

Secrets reach Forgeline only through the environment (or a file the environment names); nothing
else ever holds them. So the secret values to scrub are exactly those of `SECRET_ENV` (and the
file of `API_KEY_FILE_ENV`), read at the moment of scrubbing, which also covers a credential
rotated while a worker runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

API_KEY_ENV = "FORGELINE_TEMPORAL_API_KEY"
API_KEY_FILE_ENV = "FORGELINE_TEMPORAL_API_KEY_FILE"
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    API_KEY_ENV,
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
MASK = "***"
# Shorter values would turn every occurrence of a common word or number in a message into ***;
# real keys and tokens are far longer (an AWS secret key has 40 characters).
MIN_SECRET_LENGTH = 8


def known_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret values present now: the variables of SECRET_ENV and the API key file."""
    env = os.environ if environ is None else environ
    found = [env.get(name, "").strip() for name in SECRET_ENV]
    if key_file := env.get(API_KEY_FILE_ENV):
        # Settings report a missing file; here there is just nothing to hide.
        with contextlib.suppress(OSError):
            found.append(Path(key_file).read_text().strip())
    return [value for value in found if len(value) >= MIN_SECRET_LENGTH]


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with every secret value replaced by ***; `secrets` defaults to known_secrets()."""
    # Longest first: a secret that contains another is masked whole, not in pieces.
    for secret in sorted(known_secrets() if secrets is None else secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    return text


def redact_url(url: str) -> str:
    """`url` with the secret part of its user info masked: http://me:pw@host ->
    http://me:***@host, and a bare token (https://TOKEN@host) -> https://***@host; the same
    for a URL in its query (s3://b/p?endpoint=https://me:pw@host)."""
    try:
        parts = urlsplit(url)
        username, password = parts.username, parts.password
    except ValueError:  # not a URL at all: nothing structured to redact
        return url
    if any(map(has_credentials, _nested_urls(parts.query))):
        query = [(k, redact_url(v)) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        parts = parts._replace(query=urlencode(query))
    elif username is None and password is None:
        return url  # nothing to mask: unchanged to the character
    if username is None and password is None:
        return urlunsplit(parts)
    host = parts.netloc.rsplit("@", 1)[1]
    userinfo = MASK if password is None else f"{username}:{MASK}"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{host}"))


def has_credentials(url: str) -> bool:
    """Whether `url`, or a URL in its query, carries user info (http://me:pw@host,
    https://TOKEN@host, s3://b/p?endpoint=https://me:pw@host): the whole URL is checked."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return "@" in parts.netloc or any(map(has_credentials, _nested_urls(parts.query)))


def _nested_urls(query: str) -> list[str]:
    """The values of a query that are URLs themselves (an endpoint, say)."""
    return [value for _, value in parse_qsl(query) if "://" in value]
