"""What the node agent tells a boxed job and what it lets out of one: whether this node may run
the job at all, the run's store-door policy (trainer.store_door) and a rank failure's text,
masked before it reaches the history."""

from __future__ import annotations

from pathlib import Path

from temporalio.exceptions import ApplicationError

from infra.containers import ContainerRuntime
from infra.redact import known_secrets
from infra.secret_shapes import redact_log
from trainer.rank_box import Confinement, NodeConfinement
from trainer.store_door import DoorPolicy
from workflows.contracts.models import NodeTrainInput


def refuse_what_this_node_cannot_run(
    inp: NodeTrainInput,
    node_id: str,
    confinement: NodeConfinement,
    runtime: ContainerRuntime | None,
) -> None:
    """Refuse, for good, a job this node cannot run as its spec asks: an image with no container
    runtime here, or user code outside an image where it cannot be boxed (a container is a box
    of its own: a node that cannot make bubblewrap's may run it)."""
    image = inp.spec.train.image
    if image is not None and runtime is None:
        raise ApplicationError(
            f"node {node_id} cannot run train.image {image!r}: it has no container "
            "runtime (its operator may install podman), so its ranks would not run in the "
            "image the spec names",
            type="NodeRefusesImage",
            non_retryable=True,
        )
    if inp.code is not None and image is None and confinement.mode is Confinement.REFUSED:
        raise ApplicationError(
            f"node {node_id} runs no user code: it cannot box it ({confinement.why}); its "
            "operator may install bubblewrap, or start the agent with --unconfined-user-code",
            type="NodeRefusesUserCode",
            non_retryable=True,
        )


def quoted_output(err: Exception) -> str:
    """A failure that quotes what the ranks printed (a traceback, the log's last lines), with
    every credential shape and the agent's own secrets masked: it goes into the run's history,
    which every reader of the run sees."""
    return redact_log(str(err), known_secrets())[0]


def door_policy(inp: NodeTrainInput, run_dir: Path) -> DoorPolicy:
    """What the run's ranks may read and write through their door: their run's keys, their
    dataset and code, and the checkpoint the control plane authorized them to start from."""
    readable = [f"datasets/{inp.dataset.snapshot_id}/"]
    if inp.code is not None:
        readable.append(f"code/{inp.code.snapshot_id}/")
    if inp.init_from is not None:
        readable.append(inp.init_from.manifest_key.rsplit("/", 1)[0] + "/")
    return DoorPolicy(
        run_id=inp.run_id,
        generation=inp.allocation.generation,
        run_dir=run_dir,
        readable=tuple(readable),
        run_uid=inp.run_uid,
    )
