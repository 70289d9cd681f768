"""Checkpoints and registered weights load without unpickling anything that could run code.

Each crafted file here would create a marker file if anything unpickled it the ordinary way
(the first test shows that it does); the loaders must refuse it, clearly, with no marker.
"""

from __future__ import annotations

import builtins
import json
import pickle
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dataprep.tokenizer import char_tokenizer
from infra.store.local import LocalStore
from trainer.checkpoint import (
    fetch_checkpoint,
    load_model_weights,
    load_training_state,
    vet_metadata,
)
from trainer.checkpoint_manifest import MANIFEST_FORMAT, CheckpointFile, CheckpointManifest
from trainer.manifest import checkpoint_prefix, find_latest, manifest_key
from trainer.model import GPT, GPTConfig
from trainer.safe_load import METADATA_FILE, UnsafeCheckpoint

CONFIG = GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16, block_size=8)


class Payload:
    """Unpickling this runs `exec`: it creates `marker`, as an attacker's code would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def trained(seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    """A model and an AdamW that has stepped once (so it has moments as well as lr, betas)."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    _logits, loss = model(tokens, tokens)
    loss.backward()
    optimizer.step()
    return model, optimizer


def save(folder: Path, model: GPT, optimizer: torch.optim.Optimizer, **tamper: object) -> Path:
    """A DCP checkpoint as the trainer writes it, with optimizer hyperparameters replaced."""
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0].update(tamper)
    with warnings.catch_warnings():  # no process group: that is the point of these tests
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    return folder


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save(tmp_path / "good", *trained(seed=1))


def malicious_metadata(folder: Path, marker: Path) -> Path:
    (folder / METADATA_FILE).write_bytes(pickle.dumps(Payload(marker)))
    return folder


def quiet_load(load: object, *args: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(*args)  # type: ignore[operator]


def test_the_crafted_files_do_run_code_when_unpickled_the_ordinary_way(
    checkpoint: Path, tmp_path: Path
) -> None:
    # Without this, a refusal below could just mean the crafted files were broken.
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()
    marker.unlink()
    folder = save(tmp_path / "evil-item", *trained(seed=2), lr=Payload(marker))
    model, optimizer = trained(seed=3)
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    assert marker.exists()


def test_a_checkpoint_round_trips_through_the_safe_loader(checkpoint: Path) -> None:
    saved_model, saved_optimizer = trained(seed=1)
    model, optimizer = trained(seed=9)
    quiet_load(load_training_state, model, optimizer, checkpoint)
    for mine, theirs in zip(model.parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    group, saved_group = optimizer.param_groups[0], saved_optimizer.param_groups[0]
    assert (group["lr"], group["betas"]) == (saved_group["lr"], saved_group["betas"])
    fresh = GPT(CONFIG)
    quiet_load(load_model_weights, fresh, checkpoint)
    assert torch.equal(fresh.wte.weight, saved_model.wte.weight)


def test_metadata_that_would_run_code_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    malicious_metadata(checkpoint, marker)
    with pytest.raises(UnsafeCheckpoint, match=r"names builtins\.exec") as refused:
        quiet_load(load_model_weights, GPT(CONFIG), checkpoint)
    assert str(checkpoint) in str(refused.value)
    with pytest.raises(UnsafeCheckpoint, match=r"names builtins\.exec"):
        quiet_load(load_training_state, *trained(seed=4), checkpoint)
    assert not marker.exists()


def test_an_item_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    folder = save(tmp_path / "evil-item", *trained(seed=2), lr=Payload(marker))
    with pytest.raises(UnsafeCheckpoint, match=r"optim\.param_groups\.0\.lr.*GLOBAL .*exec"):
        quiet_load(load_training_state, *trained(seed=5), folder)
    assert not marker.exists()


def test_metadata_pointing_outside_its_folder_is_refused(checkpoint: Path) -> None:
    # Our own, trusted metadata, re-pointed at a file two folders up.
    metadata = pickle.loads((checkpoint / METADATA_FILE).read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (checkpoint / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match="outside its folder"):
        quiet_load(load_model_weights, GPT(CONFIG), checkpoint)


def test_a_manifest_cannot_write_a_file_outside_the_checkpoint_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_bytes("runs/r/checkpoints/step-1/x", b"#!/bin/sh\n")
    entry = {"key": "runs/r/checkpoints/step-1/x", "bytes": 10, "sha256": "0" * 64}
    dest = tmp_path / "cache" / "deep" / "checkpoint"
    for name in ("../../../.bashrc", "/etc/cron.d/x", "..", ""):
        with pytest.raises(UnsafeCheckpoint, match="not a plain file name"):
            crafted = {"format": MANIFEST_FORMAT, "step": 1, "generation": 1,
                       "files": [{**entry, "name": name}]}  # fmt: skip
            manifest = CheckpointManifest.parse(crafted, "runs/r/checkpoints/step-1/MANIFEST.json")
            fetch_checkpoint(store, manifest, dest)
    assert not (tmp_path / ".bashrc").exists()


def test_registered_weights_are_safetensors_and_load_without_pickle(tmp_path: Path) -> None:
    # Imported here: it pulls in mlflow.pyfunc.
    from trainer.serving import WEIGHTS_FILE, TextGenerator, export_model

    model, _ = trained(seed=6)
    tokenizer = tmp_path / "tokenizer.json"
    char_tokenizer(["to be or not to be"]).save(str(tokenizer))
    artifacts = export_model(model, tokenizer, tmp_path / "export")
    weights = Path(artifacts["weights"])
    assert weights.name == WEIGHTS_FILE
    # safetensors: an 8-byte little-endian header length, then a JSON header naming each
    # tensor; neither a pickle stream nor torch.save's zip of pickles.
    data = weights.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert "wte.weight" in header or "lm_head.weight" in header
    loaded = TextGenerator(weights, Path(artifacts["config"]), tokenizer).model
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def commit(store: LocalStore, run: str, step: int, folder: Path) -> None:
    """Upload a checkpoint folder and its manifest, as a generation-1 commit would."""
    files = []
    for path in sorted(folder.iterdir()):
        key = f"{checkpoint_prefix(run, step, 1)}/{path.name}"
        store.put_file(key, path)
        size, sha256 = store.digest(key)
        files.append(CheckpointFile(key=key, name=path.name, bytes=size, sha256=sha256))
    manifest = CheckpointManifest(step=step, generation=1, files=files)
    store.put_if_absent(manifest_key(run, step, 1), manifest.dump_bytes())


def test_resume_passes_over_a_checkpoint_whose_metadata_would_run_code(tmp_path: Path) -> None:
    """Its files match their hashes (whoever wrote it listed them), but its metadata is a
    crafted pickle: the run resumes from the checkpoint before, as for a corrupt file, and no
    rank is ever started on the crafted one."""
    store, marker = LocalStore(tmp_path / "store"), tmp_path / "ran"
    commit(store, "r", 10, save(tmp_path / "ten", *trained(seed=1)))
    commit(store, "r", 20, malicious_metadata(save(tmp_path / "twenty", *trained(seed=2)), marker))
    skipped: list[str] = []
    found = find_latest(store, "r", 1, skipped.append, partial(vet_metadata, store))
    assert found is not None and found.step == 10
    assert len(skipped) == 1 and "step-20/gen-1/.metadata: it names builtins.exec" in skipped[0]
    assert not marker.exists()
