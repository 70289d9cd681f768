"""Errors of the registry layer."""


class RegistryError(Exception):
    """A model version cannot be registered, found or changed."""


class VersionNotFound(RegistryError):
    """The model version named does not exist in the registry."""


class ApprovalsInvalid(RegistryError):
    """The operators' approvals file cannot be read as rules."""
