"""Infrastructure: object store, settings, local servers, process management.

Only stdlib and third-party imports live here; every other package may import it.
"""
