"""Reading a dataset snapshot's manifest, checked against the sha256 a run was given.

Its own module, light on purpose: node agents read manifests on GPU hosts whose install has
no data-preparation packages (DuckDB, pyarrow, datasketch), which dataprep.snapshot imports.
"""

from __future__ import annotations

import json

from infra.digest import sha256_bytes
from infra.errors import IntegrityError
from infra.store.protocol import ObjectStore


def load_manifest(store: ObjectStore, key: str, sha256: str) -> dict:
    """Read a dataset manifest and check it is the one the run was given."""
    data = store.get_bytes(key)
    actual = sha256_bytes(data)
    if actual != sha256:
        raise IntegrityError(
            f"dataset manifest {key} has sha256 {actual[:12]}…, expected {sha256[:12]}…: "
            "the snapshot was modified after the run started"
        )
    return json.loads(data)


def snapshot_files(manifest: dict) -> list[dict]:
    """Every file a snapshot is made of (token shards, tokenizer, per-document report), each
    as an entry with its key, size and sha256."""
    shards = [shard for split in manifest["splits"].values() for shard in split["shards"]]
    return [*shards, manifest["tokenizer"], *manifest["report"].values()]
