"""Errors of the registry layer."""


class RegistryError(Exception):
    """A model version cannot be registered, found or changed."""


class VersionNotFound(RegistryError):
    """The model version named does not exist in the registry."""


class ModelOfAnotherTeam(RegistryError):
    """A model name belongs to the team that first registered it; another team's run may not
    register versions of it or move its aliases."""


class ApprovalsInvalid(RegistryError):
    """The operators' approvals file cannot be read as rules."""
