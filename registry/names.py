"""The names Forgeline gives things in MLflow: its experiment, its aliases, its tags.

Their own module, light on purpose: every `forgeline` command imports some of them, and
importing registry.tracking imports MLflow (1.4 s of a 2.3 s command's start-up here).
"""

from __future__ import annotations

EXPERIMENT = "forgeline"
CANDIDATE = "candidate"
PRODUCTION = "production"
IDEMPOTENCY_TAG = "forgeline.temporal_run_id"
CHECKPOINT_TAG = "forgeline.checkpoint_manifest_key"
# "false" on a version that holds weights and lineage only (a user's script gave no way to
# serve it): `forgeline serve` and `generate` say so instead of failing inside MLflow.
SERVABLE_TAG = "forgeline.servable"
# On a version: Forgeline's approval gate's decision (approved, rejected, expired).
DECISION_TAG = "forgeline.decision"
# On a registered model: the team whose runs registered it first, and only they since.
TEAM_TAG = "forgeline.team"
# On a version: JSON {path in the version's model folder: sha256} of the files Forgeline put
# there (weights, tokenizer, config), taken as they were registered. All that versions from
# before MODEL_FILES_TAG carry: `serve` and `generate` check those three and say the rest is not.
ARTIFACTS_TAG = "forgeline.artifacts_sha256"
# On a version: the sha256 of its run's model_files.json, the record of every file of its model
# folder (registry.model_files): `serve` and `generate` load a folder only when it matches whole.
MODEL_FILES_TAG = "forgeline.model_files_sha256"
