"""One id space for what a node's cache holds whole and what a run needs on every node of its
gang: dataset snapshots by their snapshot id, checkpoints (a fine-tune's base model, above all)
by a short digest of their folder in the store. Node agents advertise ids with bytes
(`NodeInfo.held`), runs ask with ids and bytes (`GangRequest.needs`), and placement counts the
bytes a node would have to fetch.

A checkpoint's id is a digest and not its manifest key: keys run to a hundred characters, and
every node's list travels in the Cluster workflow's state (see `MAX_ADVERTISED_HELD`).
"""

from __future__ import annotations

import hashlib

# The most entries a node advertises (its most recently used first), and the most the Cluster
# workflow keeps of any node's list. A node's list is in every continue-as-new input and query
# answer, which Temporal caps at 2 MB: 6 entries of ~30 bytes as JSON are ~180 bytes a node,
# 0.45 MB at 2,500 nodes. The entries worth placing a run by are the few its node used last.
MAX_ADVERTISED_HELD = 6
CHECKPOINT_PREFIX = "ckpt-"


def checkpoint_item(manifest_key: str) -> str:
    """The id of the checkpoint whose manifest is at `manifest_key`."""
    return checkpoint_folder_item(manifest_key.rsplit("/", 1)[0])


def checkpoint_folder_item(folder: str) -> str:
    """The id of the checkpoint whose files are in store folder `folder` (the manifest's)."""
    return CHECKPOINT_PREFIX + hashlib.sha256(folder.encode()).hexdigest()[:16]


def bytes_to_fetch(needs: dict[str, int], held: dict[str, int]) -> int:
    """What a node holding `held` must fetch of `needs`. A need of unknown size (0, from a run
    that did not say) counts one byte: a node that holds it still wins over one that does not."""
    return sum(max(1, size) for item, size in needs.items() if item not in held)
