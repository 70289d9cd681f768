"""Random draws that a script makes the same on every rank that shares its data: the SDK's name
for `trainer.rng_streams.sharded_draws`. A module of the SDK's own, imported before the script
runs (trainer.user_module_names), so that `forgeline.sharded_draws` still resolves when the
script's folder has a `trainer.py` of its own."""

from __future__ import annotations

from trainer.rng_streams import sharded_draws

__all__ = ["sharded_draws"]
