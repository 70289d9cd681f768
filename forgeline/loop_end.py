"""How `run.steps()` ends when the script's loop leaves it early.

Python hands a generator the same GeneratorExit at its `yield` for a `break` (or `return`) in
the loop's body as for an exception raised there: inside `run.steps()` a script that stopped on
purpose and one that crashed look alike. So the loop only notes where it was left (`LeftLoop`),
and waits for nothing: a crashed rank's loop is also finalized at the interpreter's exit, where
waiting for a save whose peer is gone would hold the rank, and its gang's recovery, until the
collective times out. What to do waits for the script's next call to the SDK, `run.finish()`,
which can tell: called while an exception is being handled (a `finally:` or `except:` around
the loop) or after the SDK's own step work raised, it is a crash, which must stay one (it waits,
bounded, for the save in flight, saves nothing more, and the run restarts from the last
commit); called plainly, after a `break`, it finishes the step the script was in, commits a
checkpoint of where the loop stopped and writes the run's final record, as the loop's own end
would have.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from forgeline.step import Step


@dataclass
class LeftLoop:
    """Where the script left `run.steps()` before the loop ended."""

    step: Step | None  # the step handed out last (None: left before the first)
    # The SDK's own step work raised (a peer gone from a collective, a non-finite loss): a
    # crash, whatever the script does next.
    crashed: bool

    @property
    def step_finished(self) -> bool:
        """The script had done the step it left in: its optimizer changed the weights, or it
        reported the step's loss (a GradScaler may skip the optimizer on an overflow)."""
        return self.step is not None and (self.step.weights_changed or self.step.loss is not None)

    def on_purpose(self) -> bool:
        """At `run.finish()`: the script left the loop with `break` and goes on, rather than
        unwinding from an exception (what `sys.exc_info()` says in the finishing frame)."""
        return not self.crashed and sys.exc_info()[1] is None
