"""Which data sources a team's runs may read: its queue's `sources` and `s3_endpoints` in the
cluster file, checked at submission before anything a source names is looked at.

Without a list, a run reads whatever lies inside the data workers' roots, any key of the store
and any bucket, and its `?endpoint=` sends the API's and the data workers' requests wherever the
submitter says: another team's corpora, or an internal address nobody outside may reach. With
one, a local source must start inside a listed folder (as written and with its links resolved),
a `store:` or `s3://` source under a listed prefix, part by part, and an endpoint must be listed.
The refusal is a 403 on data.sources that names the source, the team and the key to change.
"""

from __future__ import annotations

import os

from dataprep.errors import SourceError
from dataprep.source_roots import DataRoots
from dataprep.source_urls import S3_SCHEME, STORE_SCHEME, is_glob, parse_s3
from infra.errors import StoreError
from infra.store.s3 import url_options
from worker.api_rules import ApiError
from worker.specfile import walk_start
from workflows.contracts.cluster_models import QueueConfig
from workflows.contracts.spec import RunSpec


def refuse_sources_outside_team(spec: RunSpec, queue: QueueConfig) -> None:
    """403 on the first of data.sources that the team's lists do not hold; nothing for a team
    without lists. Resolves links of local sources: run it off the event loop."""
    if queue.sources is None and queue.s3_endpoints is None:
        return
    for source in spec.data.sources:
        if source.startswith(S3_SCHEME):
            _refuse_unlisted_endpoint(spec, queue, source)
        if queue.sources is not None and not _listed(source, queue.sources):
            raise _refusal(
                spec,
                f"data.sources: {_shown(source)} is not among the sources of team "
                f"{spec.resources.team!r} (it may read {', '.join(queue.sources)}: `sources` of "
                "its queue in the cluster file)",
                "sources",
            )


def _listed(source: str, allowed: list[str]) -> bool:
    if source.startswith(STORE_SCHEME):
        return _under(_parts(source.removeprefix(STORE_SCHEME)), allowed, STORE_SCHEME)
    if source.startswith(S3_SCHEME):
        try:
            found = parse_s3(source)
        except SourceError:
            return False  # not a source at all: nobody's list holds it
        return _under([found.bucket, *_parts(found.pattern)], allowed, S3_SCHEME)
    folders = [entry for entry in allowed if entry.startswith("/")]
    start = walk_start(source)
    written, resolved = DataRoots(tuple(folders)), DataRoots.of(folders)
    # As written, then with every link on the way resolved: a link inside the team's folder
    # that leads into another team's is refused.
    return (written.holds(start) or resolved.holds(start)) and resolved.holds(
        os.path.realpath(start)
    )


def _parts(key: str) -> list[str]:
    """A key pattern's parts before its first wildcard (where listing it starts); a '..' part
    goes nowhere a list could hold."""
    parts = []
    for part in key.split("/"):
        if is_glob(part):
            break
        parts.append(part)
    return [] if ".." in parts else [p for p in parts if p not in ("", ".")]


def _under(parts: list[str], allowed: list[str], scheme: str) -> bool:
    """Whether a listed prefix of `scheme` is the first parts of `parts`."""
    for entry in allowed:
        if entry.startswith(scheme):
            prefix = entry.removeprefix(scheme).split("/")
            if parts[: len(prefix)] == prefix:
                return True
    return False


def _refuse_unlisted_endpoint(spec: RunSpec, queue: QueueConfig, source: str) -> None:
    """An endpoint is where the API and the data workers send the team's requests: one the
    cluster file does not list for the team is refused before anything is sent there."""
    try:
        found = parse_s3(source)
        endpoint = url_options(found.options, "source").get("endpoint")
    except (SourceError, StoreError):
        return  # no source at all: the source check refuses it, sending nothing anywhere
    listed = queue.s3_endpoints or []
    if endpoint is None or endpoint.rstrip("/") in listed:
        return
    where = f"it may name {', '.join(listed)}" if listed else "it lists none"
    raise _refusal(
        spec,
        f"data.sources: {found.written} names the endpoint {endpoint}, which is not among the S3 "
        f"endpoints of team {spec.resources.team!r} ({where}: `s3_endpoints` of its queue in "
        "the cluster file)",
        "s3_endpoints",
    )


def _shown(source: str) -> str:
    return source if len(source) <= 200 else f"{source[:199]}…"


def _refusal(spec: RunSpec, message: str, key: str) -> ApiError:
    team = spec.resources.team
    return ApiError(
        403,
        "forbidden",
        message,
        field="data.sources",
        fix=f"read only what the team may, or ask an operator to add it to `{key}` of the "
        f"queue {team!r} in the cluster file (forgeline cluster apply)",
    )
