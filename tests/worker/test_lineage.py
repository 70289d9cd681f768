"""`forgeline lineage` checks content: the stored bytes are hashed, not the writer's claim."""

from __future__ import annotations

import hashlib
from typing import Any

from infra.store.s3 import SHA256_META, S3Store
from trainer.checkpoint_manifest import CheckpointFile, CheckpointManifest
from trainer.manifest import checkpoint_prefix, manifest_key
from worker.lineage import _checkpoint


def test_lineage_on_s3_finds_weights_swapped_under_their_old_hash(bucket: str, raw: Any) -> None:
    """Someone with the bucket's credentials rewrote a committed checkpoint's weights and put
    the old sha256 in the object's metadata. Before, lineage read that metadata and said "ok"."""
    store = S3Store(bucket, "forgeline")
    weights, key = b"trained weights", f"{checkpoint_prefix('r', 10, 1)}/__0_0.distcp"
    store.put_bytes(key, weights)
    digest = hashlib.sha256(weights).hexdigest()
    listed = CheckpointFile(key=key, name="__0_0.distcp", bytes=len(weights), sha256=digest)
    manifest = CheckpointManifest(step=10, generation=1, files=[listed])
    store.put_if_absent(manifest_key("r", 10, 1), manifest.dump_bytes())
    assert _checkpoint(store, manifest_key("r", 10, 1)).check == "ok"

    swapped = b"someone's weights"[: len(weights)]
    raw.put_object(
        Bucket=bucket, Key=f"forgeline/{key}", Body=swapped, Metadata={SHA256_META: digest}
    )
    link = _checkpoint(store, manifest_key("r", 10, 1))
    assert link.broken and f"checkpoint file {key} is corrupt" in link.check
