"""Map domain errors to Temporal failures: bad input and corrupt data are not retried."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio.exceptions import ApplicationError

from dataprep.errors import DataprepError
from infra.errors import IntegrityError, InvalidKey
from registry.errors import ModelOfAnotherTeam, VersionNotFound
from trainer.errors import CheckpointError, DataError

# Retrying these cannot help: the input or the stored data itself is wrong. ValueError: settings
# that a domain package's own checks refuse (the spec's validation missed a case).
NON_RETRYABLE = (
    DataprepError,
    IntegrityError,
    InvalidKey,
    CheckpointError,
    DataError,
    VersionNotFound,
    ModelOfAnotherTeam,
    ValueError,
)


@contextmanager
def domain_errors() -> Iterator[None]:
    try:
        yield
    except NON_RETRYABLE as err:
        raise ApplicationError(str(err), type=type(err).__name__, non_retryable=True) from err
