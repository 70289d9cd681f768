"""The node agent's part in a run whose script keeps its own checkpoints (train.checkpoints =
"folder"): the folder it saves into, restored from the run's last commit before the ranks
start, and the watch that commits it while they run (trainer.script_folder).

Every node restores the folder (any rank may read it to resume); only the agent of the gang's
first node, where global rank 0 saves, commits it.
"""

from __future__ import annotations

from pathlib import Path

from infra.store.protocol import ObjectStore
from trainer.checkpoint_manifest import FOLDER_CONTENTS
from trainer.errors import CheckpointError
from trainer.folder_checkpoint import CommitTarget, clear_folder, restore_folder
from trainer.folder_watch import SETTLE_S, FolderWatcher
from trainer.job import TrainJob
from trainer.manifest import read_manifest
from trainer.script_folder import POLL_S, ScriptFolder
from workflows.contracts.models import NodeTrainInput

SCRIPT_FOLDER = "checkpoint"  # in the generation's folder on the node


def keeps_its_own(inp: NodeTrainInput) -> bool:
    return inp.spec.train.keeps_its_own_checkpoints


def restore_script_folder(store: ObjectStore, inp: NodeTrainInput, job: TrainJob) -> None:
    """Make the script's folder in the job's generation folder: the run's last commit (every
    file checked by its sha256) or, on the run's first gang, empty. Tell the job where it is
    and the script's arguments."""
    folder = Path(job.progress_file).parent / SCRIPT_FOLDER
    if inp.resume is None:
        clear_folder(folder)
    else:
        key = inp.resume.manifest_key
        manifest = read_manifest(store, key)
        if manifest.contents != FOLDER_CONTENTS:
            raise CheckpointError(
                f"{key} holds the SDK's checkpoint, not a script's folder: a run keeps its "
                "checkpoints one way from its start (train.checkpoints)"
            )
        restore_folder(store, manifest, folder)
    job.checkpoint_folder = str(folder)
    job.checkpoint_resumed = inp.resume is not None
    job.script_argv = inp.spec.train.script_argv(str(folder), job.checkpoint_resumed)


def script_folder_watch(
    store: ObjectStore,
    inp: NodeTrainInput,
    job: TrainJob,
    staging: Path,
    settle_s: float = SETTLE_S,
    poll_s: float = POLL_S,
) -> ScriptFolder:
    """The watch over the job's folder: committing on the gang's first node, restoring only
    on the others. `staging` is the agent's own, outside the ranks' box: a file is hashed
    there and uploaded from there, where the script cannot change it in between. `settle_s`:
    how long the folder is quiet before a commit, `poll_s` how often it is looked at (a test's
    small script saves more often, and its whole run lasts a few polls of a node's)."""
    watcher = None
    start_step = inp.resume.step if inp.resume else 0
    if inp.allocation.nodes[0].node_id == job.node_id:
        world = inp.spec.resources.world_size
        watcher = FolderWatcher(
            Path(job.checkpoint_folder),
            staging,
            store,
            CommitTarget(inp.run_id, inp.allocation.generation, inp.run_uid),
            last_step=start_step,
            settle_s=settle_s,
            keep=inp.spec.train.keep_checkpoints,
            # As the SDK's manifests say it: the data the weights were trained on, the spec.
            meta=lambda: {"world_size": world, "train_config": job.train, **job.lineage},
        )
    return ScriptFolder(
        Path(job.checkpoint_folder),
        Path(job.progress_file),
        watcher,
        Path(job.stop_file),
        start_step,
        poll_s,
    )
