"""A rank script that never starts training: the user's own set-up that does not end.

A script that loops in its own code before `for step in run.steps():` reports nothing and
fails nothing; its ranks stay alive and its node agent keeps heartbeating, so without a limit
the run would hold its gang for as long as the activity may run. The SDK marks where a rank
is (progress events `sdk`: a call of the platform's entered or returned), and the node agent
gives each stretch of the script's own code `limit_s`:

- from the script's first line to `forgeline.init()`, between `init()` and `run.restore()`,
  between `restore()` and `run.steps()`: only the script's code runs there, so running past
  the limit is the user's error, the same on every node and every attempt; the run fails at
  once;
- inside `init()` (the rendezvous, the process group) and `restore()` (reading a checkpoint):
  the platform's own calls, with their own timeouts; a peer that never arrives is a node's
  fault, never the user's;
- the first step, from `run.steps()` to the first step reported: a stuck collective looks like
  a slow step there, so past the limit it is a hang (restart, bounded), as the hang watch
  (trainer.hang) treats later steps.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a rank can be, by the newest `sdk` event ("" before any), and what the stretch after it is.
# Before "script:entered" (trainer.entry, right before the script's first line) the launch is
# the platform's: Python and torch importing, which takes seconds on a loaded host.
_USERS_STRETCH = {
    "script:entered": "without calling forgeline.init()",
    "init:returned": "after forgeline.init() without calling run.restore(model, optimizer)",
    "restore:returned": "after run.restore() without entering run.steps()",
}
_PLATFORMS_CALL = ("", "init:entered", "restore:entered")
FIRST_STEP = "steps:entered"


@dataclass
class Verdict:
    users: bool  # True: the script's own code ran past the limit; False: the first step hung
    what: str


class StartWatch:
    """Follows one launch of this node's ranks until their first step is reported."""

    def __init__(self, limit_s: float, started_at: float) -> None:
        self.limit_s = limit_s
        self._where = ""
        self._since = started_at  # when the rank got to where it is

    def observe(self, where: str, now: float) -> None:
        if where != self._where:
            self._where, self._since = where, now

    def verdict(self, now: float) -> Verdict | None:
        """What it means that no step has been reported yet, once that is past the limit."""
        idle = now - self._since
        if idle <= self.limit_s or self._where in _PLATFORMS_CALL:
            return None
        if self._where == FIRST_STEP:
            return Verdict(False, f"the first step did not finish in {idle:.0f} s")
        stretch = _USERS_STRETCH.get(self._where, f"after {self._where}")
        return Verdict(True, f"ran {idle:.0f} s {stretch}")
