"""Well-known workflow ids and task queues shared by workflows, workers and the CLI."""

CLUSTER_WORKFLOW_ID = "forgeline-cluster"
# Signals the Cluster workflow sends to a run.
GANG_GRANTED_SIGNAL = "gang_granted"
PREEMPT_SIGNAL = "preempt"
# Node agents tell a run what its gang's health checks found.
HEALTH_SIGNAL = "health_event"
CONTROL_TASK_QUEUE = "forgeline-control"


def node_task_queue(node_id: str) -> str:
    """Each node agent polls its own queue, so an activity lands on exactly that node."""
    return f"forgeline-node-{node_id}"


# Data preparation fans out here: start more data workers for more throughput.
DATA_TASK_QUEUE = "forgeline-data"


def dataset_workflow_id(run_id: str) -> str:
    return f"{run_id}-dataset"
