"""Errors the SDK raises at a rank script."""


class SDKUsageError(RuntimeError):
    """The rank script called the SDK out of order (a bug in the script, not in a node)."""
