"""Why the ranks stop, as the SDK's all-gather votes it (trainer.step_share) and as the node
agent says it for a script that keeps its own checkpoints (trainer.script_folder). Apart from
the all-gather, so that the agent side, which the CLI imports, never imports torch."""

from __future__ import annotations

# Why a rank wants to stop, in increasing precedence: the largest wins across the gang.
# A straggler verdict needs no vote: every rank reaches it from the same shared times.
KEEP_GOING, ASKED_TO_STOP, PREEMPTED, FENCED, NON_FINITE = 0, 1, 2, 3, 4
STRAGGLER = ASKED_TO_STOP
STOP_REASONS = {ASKED_TO_STOP: "asked to stop", PREEMPTED: "preempted", FENCED: "fenced"}
