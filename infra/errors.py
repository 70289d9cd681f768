"""Errors raised by the infrastructure layer."""


class InfraError(Exception):
    """Base class for infrastructure errors."""


class StoreError(InfraError):
    """An object-store operation failed or was refused."""


class ObjectNotFound(StoreError):
    """The key does not exist in the store."""


class InvalidKey(StoreError):
    """A key that could escape the store or is malformed."""


class StoreUnavailable(StoreError):
    """The store did not answer (endpoint down, partitioned, failing with 5xx after retries):
    a twin site may serve instead."""


class NotOnTwin(StoreUnavailable):
    """The primary is unreachable and its twin has no copy of the object (not yet copied, or
    written to the primary just before the outage). An outage to a caller that can wait it out;
    one that can choose another object (resume, an older checkpoint) may pass this one over."""


class IntegrityError(StoreError):
    """A stored object's content does not match its recorded sha256 or size."""


class StackError(InfraError):
    """A local-stack process could not be started, reached or stopped."""


class ObjectChanged(StoreError):
    """An object is no longer the version that was asked for (its ETag moved on)."""
