"""Load torch.distributed.checkpoint folders without running code hidden in them.

A checkpoint comes from the object store, which more than this trainer can write to; the sha256s
in its manifest prove the files are the ones listed, not that whoever listed them meant well.
DCP unpickles two things when it loads: the `.metadata` file (plain `pickle.load`) and every
non-tensor item (`torch.load(weights_only=False)` in `DefaultLoadPlanner.load_bytes`; the
optimizer's lr, betas and other hyperparameters are such items). Either would call whatever a
crafted pickle names. Here the metadata is unpickled against an allowlist of DCP's own record
types, and the items by torch's weights-only unpickler; anything else raises UnsafeCheckpoint
before a single callable of the file has run. Tensors DCP already reads with weights_only=True.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from trainer.errors import CheckpointError

METADATA_FILE = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Everything a DCP `.metadata` pickle refers to (seen in saves of DDP, FSDP2 and TP layouts):
# DCP's record dataclasses, tensor sizes, dtypes and layouts, and the checkpoint id's path.
_METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13 moved it
    }
)
_WEIGHTS_ONLY_REASON = re.compile(r"WeightsUnpickler error: ([^\n]*?)(?: by default)?\.")


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file would run code or reach outside its folder if loaded: refused."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file needs; every import and call a pickle
    makes goes through find_class, so nothing else can be reached (Python's "restricting
    globals" recipe)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which no checkpoint metadata needs"
        )


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def read_metadata(folder: Path) -> Metadata:
    """The folder's DCP metadata, unpickled safely, with every data file it points at checked
    to be a plain file name inside the folder."""
    path = folder / METADATA_FILE
    return check_metadata(path.read_bytes(), str(path))


def check_metadata(data: bytes, path: str) -> Metadata:
    """`read_metadata` of bytes already in hand (e.g. read from the store, to vet a checkpoint
    before any rank is started on it); `path` names it in messages."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise UnsafeCheckpoint(f"refusing checkpoint {path}: {err}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(
            f"refusing checkpoint {path}: it holds a {type(metadata).__name__}, not DCP Metadata"
        )
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not is_plain_file_name(name):
            raise UnsafeCheckpoint(
                f"refusing checkpoint {path}: it points at {name!r}, outside its folder"
            )
    return metadata


def is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


class _VettedReader(FileSystemReader):
    """DCP's file reader, handed metadata that `read_metadata` already unpickled safely
    instead of unpickling the file itself."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # What FileSystemReader.read_metadata does after its pickle.load.
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor items with the weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            item = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(
                f"refusing checkpoint item {read_item.dest_index.fqn}: {_weights_only_reason(err)}"
            ) from None
        # The parent stores the item (into nested state as needed) but unpickles with
        # weights_only=False: hand it bytes re-saved from the safely loaded value, so what it
        # unpickles is plain data by construction, not a second reading of the file's bytes.
        clean = io.BytesIO()
        torch.save(item, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _weights_only_reason(err: pickle.UnpicklingError) -> str:
    """The one line of torch's long weights-only message that says what was refused."""
    found = _WEIGHTS_ONLY_REASON.search(str(err))
    return found.group(1) if found else str(err).splitlines()[0]


def load(state: dict[str, Any], folder: Path) -> None:
    """`dcp.load(state, folder)` that refuses, with UnsafeCheckpoint, any checkpoint whose
    metadata or items would run code when unpickled. Collective like dcp.load when a process
    group is up: every rank calls it."""
    metadata = read_metadata(folder)
    try:
        dcp.load(
            state, storage_reader=_VettedReader(folder, metadata), planner=_WeightsOnlyPlanner()
        )
    except CheckpointException as err:
        # DCP gathers each rank's exception; the refusal is the one worth reporting.
        for exc, _trace in err.failures.values():
            if isinstance(exc, UnsafeCheckpoint):
                raise UnsafeCheckpoint(f"{exc} (in {folder})") from None
        raise
