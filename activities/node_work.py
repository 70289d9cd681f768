"""The work a run sends a node agent, read by the agent itself: an agent older than the control
plane says so, and takes its node out of service until it is upgraded.

The models on the wire refuse fields they do not know (a typo in a spec must not pass
unnoticed), so a control plane upgraded before its agents sends a spec field (a new
`recovery.exit_grace_s`, say) that every old agent refuses. Decoded by the SDK, that refusal was
a bare "ValidationError for NodeTrainInput" failing every gang on those nodes, and the runs
restarted on them until their restarts ran out. Read here, the refusal names the fields, the
versions and the fix, and the node's own health check fails with it (infra.node_health): the
run goes on elsewhere, and the node stays drained until its agent restarts on the new code.

The rule for a rolling upgrade: agents first, then the control plane. An agent newer than its
control plane reads everything an older one sends (new fields have defaults).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError
from temporalio import activity
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from infra import node_health
from infra.installed import forgeline_version
from workflows.contracts.models import NodeTrainInput
from workflows.gang_outcome import NODE_UNHEALTHY


def read_train_input(raw: RawValue, node_dir: Path) -> NodeTrainInput:
    """The run's work for this node; refused (and the node's check failed) where this agent
    is too old to read it."""
    try:
        return activity.payload_converter().from_payload(raw.payload, NodeTrainInput)
    except ValidationError as err:
        reason = too_old(err)
        node_health.fail(node_dir, reason)
        raise ApplicationError(reason, type=NODE_UNHEALTHY, non_retryable=True) from None


def too_old(err: ValidationError) -> str:
    """Why this agent cannot read the work, and what an operator does about it."""
    unknown = [_dotted(e["loc"]) for e in err.errors() if e["type"] == "extra_forbidden"]
    other = [f"{_dotted(e['loc'])}: {e['msg']}" for e in err.errors()
             if e["type"] != "extra_forbidden"]  # fmt: skip
    what = "; ".join(
        ([f"fields it does not know: {', '.join(unknown)}"] if unknown else []) + other[:3]
    )
    return (
        f"this node's agent (forgeline {agent_version()}) cannot read the work the control plane "
        f"sent ({what}): the control plane runs a newer Forgeline. Upgrade Forgeline on this "
        "host and restart its agent; the node is out of service until then (upgrade agents "
        "first, then the control plane)"
    )


def agent_version() -> str:
    return forgeline_version() or "from an uninstalled checkout"


def _dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)
