"""The folders a data worker may read local sources from.

`data.sources` comes from whoever submits a run, and the data worker reads what they name with
its own permissions, then writes it into the shared store as shards anyone with the dataset can
read. So a local source must lie inside one of the worker's data roots (the setting
`data_roots`, or the store's own folder), and so must the file it finally is: a link inside a
root that leads out of it (`corpus.txt -> /proc/self/environ`) is refused by name, as is a path
outside every root. Paths are compared after resolving every link and `..`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from dataprep.errors import SourceError
from dataprep.sources import SourceFile


@dataclass(frozen=True)
class DataRoots:
    """Resolved folders; an empty set of roots confines nothing (in-process use and tests)."""

    folders: tuple[str, ...]

    @classmethod
    def of(cls, folders: Sequence[str]) -> DataRoots:
        return cls(tuple(os.path.realpath(f) for f in folders if f))

    def holds(self, path: str) -> bool:
        return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep)
                   for root in self.folders)  # fmt: skip

    def check(self, sources: list[SourceFile]) -> list[SourceFile]:
        """`sources` unchanged, or SourceError naming the first that lies outside every root."""
        if not self.folders:
            return sources
        for source in sources:
            real = os.path.realpath(source.path)
            if self.holds(real):
                continue
            where = ", ".join(self.folders)
            fix = (
                "copy the data into one of them, or have its folder added to the data "
                "workers' FORGELINE_DATA_ROOTS"
            )
            if real != os.path.normpath(source.path):
                raise SourceError(
                    f"source {source.path} is a link to {real}, outside the data roots "
                    f"({where}): {fix}"
                )
            raise SourceError(f"source {source.path} is outside the data roots ({where}): {fix}")
        return sources


UNCONFINED = DataRoots(())
