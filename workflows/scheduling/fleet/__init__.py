"""A datacenter-scale discrete-event simulation that drives the real scheduling policy.

`config` declares the fleet, the workload and the policy; `workload` draws the jobs and the
node failures from one seed; `progress` is a job's checkpoint arithmetic; `engine` plays the
runs' side against `workflows.scheduling.cluster_ops` (the functions the `Cluster` workflow
applies); `report` turns what happened into the figures `forgeline simulate` prints. Pure and
seeded: no I/O, no clock, `random.Random(seed)` only, so the same inputs give the same report.
"""
