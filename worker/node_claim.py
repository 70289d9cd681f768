"""Which agent is a node: the incarnation that this host's agent last joined as, kept in the
node's folder. Its successor on the same host (a restart, a crash, `forgeline up` again) names
it and takes the node over; a second agent elsewhere under a live node's id cannot name it and
is refused by the Cluster workflow (`join_node`); a second agent on this host while the first
runs is refused here, before it reaches Temporal."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from temporalio.client import Client, WorkflowUpdateFailedError

from infra.tokens import write_private
from worker.cli_common import CliError, ExitCode
from workflows.contracts.cluster_models import JoinRequest, Node, NodeInfo
from workflows.contracts.names import CLUSTER_WORKFLOW_ID

RECORD = "agent.json"


class NodeClaimed(CliError):
    """Another agent holds this node id; the message says which and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ExitCode.REFUSED)


def previous_incarnation(node_dir: Path, node_id: str) -> str | None:
    """The incarnation this host's last agent joined as (None: never joined from here).
    Refuses while that agent still runs."""
    try:
        record = json.loads((node_dir / RECORD).read_text())
        incarnation, pid = str(record["incarnation"]), int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no record, or one that cannot be read: a first join
    if pid != os.getpid() and _is_an_agent(pid):
        raise NodeClaimed(
            f"node {node_id}'s agent (pid {pid}) runs from this state folder: stop it first "
            "(`forgeline down`, or its service), or give this agent another --node-id"
        )
    return incarnation


def _is_an_agent(pid: int) -> bool:
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return b"--node-id" in argv  # `forgeline agent` and the local stack's `worker node`
    return False


async def join(client: Client, node_dir: Path, info: NodeInfo, previous: str | None) -> Node:
    """Join the cluster as `info` (again, when what it holds changed), and record the
    incarnation for this host's next agent. The Cluster workflow must be running
    (`ensure_cluster`, once at the agent's start)."""
    handle = client.get_workflow_handle(CLUSTER_WORKFLOW_ID)
    try:
        node = await handle.execute_update(
            "join_node", JoinRequest(info=info, previous_incarnation=previous), result_type=Node
        )
    except WorkflowUpdateFailedError as err:
        raise NodeClaimed(str(getattr(err.cause, "message", err.cause) or err)) from None
    node_dir.mkdir(parents=True, exist_ok=True)
    record = {"incarnation": info.incarnation, "pid": os.getpid()}
    write_private(node_dir / RECORD, json.dumps(record).encode())
    return node
