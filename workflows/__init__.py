"""Deterministic Temporal workflows, and what they decide with.

- The workflows, each beside the rules only it uses: `training_run` (one run, corpus to
  approval; its end in `run_end`), `cluster` (the gang scheduler as an entity workflow) and
  `dataset` (data preparation fanned out over chunks).
- `scheduling/`: the scheduling policy as pure functions (one pass in `scheduler`), the
  `Cluster` workflow's state transitions (`cluster_ops`), and the fleet simulator (`fleet/`).
- `contracts/`: what crosses a boundary: the run spec, the models on the wire (workflows and
  activities, the cluster's state, the HTTP API) and the names of workflows and task queues.

Nothing here does I/O or imports torch, mlflow, duckdb or boto3: workflow code is replayed.
"""
