"""Sharded checkpoints with torch.distributed.checkpoint, committed by manifest.

Save (collective): every rank writes its shard files to node-local staging, uploads the files it
wrote, and the ranks gather (name, key, size, sha256) to rank 0, which writes the manifest last
with create-if-absent. Load: the caller fetches and verifies every file into a local folder first
(`fetch_checkpoint`), then each rank reads what it needs from there.
"""

from __future__ import annotations

import json
import shutil
import warnings
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from infra.digest import sha256_file
from infra.store import ObjectStore, fetch_verified
from trainer.manifest import MANIFEST_FORMAT, checkpoint_prefix, manifest_key, prune

METADATA_FILE = ".metadata"


def _files_written_by(folder: Path, rank: int) -> list[Path]:
    # DCP's file writer names each rank's data files `__<rank>_<n>.distcp`; the coordinator
    # (rank 0) also writes the global `.metadata`.
    files = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        files.append(folder / METADATA_FILE)
    return files


def save_checkpoint(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    store: ObjectStore,
    staging_dir: Path,
    run_id: str,
    step: int,
    keep: int,
    meta: dict,
) -> str | None:
    """Save, upload and commit a checkpoint; every rank returns the manifest key, or None if
    another writer had already committed this step (the store's copy wins)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Ranks of one node share the staging folder (the job gives each generation its own).
    folder = staging_dir / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))

    prefix = checkpoint_prefix(run_id, step)
    mine = []
    for path in _files_written_by(folder, rank):
        key = f"{prefix}/{path.name}"
        store.put_file(key, path)
        mine.append(
            {
                "name": path.name,
                "key": key,
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        )
    gathered: list[list[dict] | None] = [None] * world
    dist.all_gather_object(gathered, mine)

    committed: list[str | None] = [None]
    if rank == 0:
        manifest = {
            "format": MANIFEST_FORMAT,
            "run_id": run_id,
            "step": step,
            "world_size": world,
            "layout": {"data_parallel": world, "strategy": "ddp"},
            "committed_at": datetime.now(UTC).isoformat(),
            **meta,
            "files": [entry for part in gathered for entry in part or []],
        }
        key = manifest_key(run_id, step)
        if store.put_if_absent(key, json.dumps(manifest, indent=2, sort_keys=True).encode()):
            committed[0] = key
            prune(store, run_id, keep)
    dist.broadcast_object_list(committed, src=0)
    shutil.rmtree(folder, ignore_errors=True)
    return committed[0]


def fetch_checkpoint(store: ObjectStore, manifest: dict, dest: Path) -> Path:
    """Download every file of a committed checkpoint into `dest`, each checked by sha256."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in manifest["files"]:
        fetch_verified(store, entry["key"], dest / entry["name"], entry["sha256"], entry["bytes"])
    return dest


def load_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path
) -> None:
    """Restore model and optimizer in place from a fetched checkpoint (any world size)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_model_weights(model: torch.nn.Module, folder: Path) -> None:
    """Restore only the model's weights, in a plain process (no process group needed)."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # Loading without a process group is the point here, not a mistake to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder))
    model.load_state_dict(state["model"])
