"""Where the scheduler decides: the policy as pure functions of the cluster's state and time.

`scheduler.schedule` is one pass (placement, quotas and fair share, preemption, backfill,
held reservations, yielding); `cluster_ops` holds the transitions the `Cluster` workflow
applies around a pass; `fleet/` replays weeks of a datacenter through the same functions.
"""
