"""A script's final commit as the files of a registered version (train.checkpoints = "folder").

The script saved whatever it saves (`last.pt`, a config, a tokenizer, optimizer state Forgeline
never reads); the spec's `registry.files` says which of those make the model. They are fetched
from the store, each checked by its sha256, and the version keeps them at their paths in the
folder. Nothing is loaded: the script's own code is what reads them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from infra.store.protocol import ObjectStore
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import CheckpointError
from trainer.folder_checkpoint import restore_folder


def chosen_files(manifest: CheckpointManifest, globs: list[str]) -> list[str]:
    """The names in the commit that `globs` match (as fnmatch matches, `*` crossing `/`); every
    file when there are none. A glob that matches nothing is a mistake in the spec: it names
    the files the commit does hold, so the next spec gets them right."""
    names = sorted(entry.name for entry in manifest.files)
    if not globs:
        return names
    unmatched = [g for g in globs if not any(fnmatchcase(name, g) for name in names)]
    if unmatched:
        held = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise CheckpointError(
            f"registry.files {unmatched} match no file of the final checkpoint (step "
            f"{manifest.step}), which holds: {held or 'nothing'}; name files it holds, or "
            "leave registry.files empty to register them all"
        )
    return [name for name in names if any(fnmatchcase(name, g) for g in globs)]


def export_folder(
    store: ObjectStore, manifest: CheckpointManifest, globs: list[str], dest: Path
) -> dict[str, str]:
    """The chosen files of the commit fetched under `dest`, by their path in the folder."""
    names = chosen_files(manifest, globs)
    restored = restore_folder(store, manifest, dest, only=set(names))
    return {name: str(restored.path.joinpath(*name.split("/"))) for name in names}
