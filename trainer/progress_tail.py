"""The progress file of one job's ranks as the node agent follows it (trainer.launch.run_ranks):
its newest step, checkpoint, health, losses and what the script said of itself."""

from __future__ import annotations

from pathlib import Path

from trainer.progress_events import (
    CheckpointLine,
    CrashedLine,
    EndLine,
    EvalLine,
    ExitedLine,
    FailedLine,
    HealthLine,
    OddLine,
    PeerSkippedLine,
    ProgressLine,
    SavedLine,
    SdkLine,
    StepLine,
    UserErrorLine,
    progress_line,
)
from trainer.rank_lines import BoundedLines, line_cap, read_to_end
from trainer.step_rate import StepRate

_STEP_FIELDS = {"step", "loss", "lr", "tokens_per_s", "mfu", "checkpoint_step", "epoch"}
# Health lines an attempt keeps in memory and returns: a node that flaps for a month writes
# thousands; the progress file on the node keeps them all.
HEALTH_KEPT = 20

LOSSES_KEPT = 1000  # a script's reported losses a commit's manifest carries, the newest


class ProgressTail:
    """Reads complete new lines of the progress file; keeps the newest step and checkpoint
    (the file itself stays on the node as the full record). The ranks write the file: it is
    read in bounded polls (trainer.rank_lines) and each line checked before it is followed
    (trainer.progress_events); an odd line is passed over with a warning."""

    def __init__(self, path: Path, start_step: int = 0, world: int = 1) -> None:
        self.path = path
        self.lines = BoundedLines(path, line_cap(world))
        self.latest: dict = {"step": start_step}
        self.sdk = ""  # the SDK call the ranks were last in or back from ("init:entered", ...)
        self.crash: str | None = None  # the first rank's uncaught exception (trainer.entry)
        self.node_fault: str | None = None  # the first that said the node is broken
        self.exited: set[int] = set()  # the ranks whose script returned (trainer.entry)
        # What the ranks reported of their steps (the SDK, or forgeline.report): the newest
        # step, the newest losses and the newest held-out loss with its step. A script that
        # keeps its own checkpoints has them put in its commits' manifests.
        self.reported_step: int | None = None
        self.losses: list[tuple[int, float]] = []
        self.evaluated: tuple[int, float] | None = None
        self.saved_step: int | None = None  # the newest save a library said is complete
        self._rate = StepRate()

    def poll(self) -> None:
        """Follow the lines of one bounded read (BoundedLines.max_read)."""
        for raw in self.lines.poll():
            try:
                line = progress_line(raw)
            except OddLine as odd:
                self.lines.odd(f"a line of {len(raw)} bytes", str(odd))
                continue
            if line is not None:
                self._follow(line)

    def drain(self) -> None:
        """Once the ranks are gone: the lines they left, to the file's end (bounded)."""
        read_to_end(self.poll, self.lines)

    def _follow(self, line: ProgressLine) -> None:
        match line:
            case CheckpointLine():
                self.latest["checkpoint_step"] = line.step
                if self.reported_step is None:  # a script that reports no steps: its commits
                    self.latest["step"] = line.step
            case EndLine():
                self.latest["step"] = line.step
                if line.reason is not None:
                    self.latest["stop_reason"] = line.reason
            case SavedLine():
                self.saved_step = line.step
            case EvalLine():
                self.latest["val_loss"] = line.val_loss
                self.evaluated = (self.reported_step or 0, line.val_loss)
            case FailedLine():
                self.latest["failure"] = line.reason
            case PeerSkippedLine():  # every rank says the same
                self.latest.setdefault("peer_skipped", line.why)
            case UserErrorLine():  # the first rank to say it is enough
                self.latest.setdefault("user_error", line.model_dump())
            case CrashedLine():
                self.crash = self.crash or line.reason
                if line.node_fault:
                    self.node_fault = self.node_fault or line.reason
            case HealthLine():  # the newest few, and how many in all
                kept = [*self.latest.get("health", []), line.model_dump()]
                self.latest["health"] = kept[-HEALTH_KEPT:]
                self.latest["health_seen"] = self.latest.get("health_seen", 0) + 1
            case SdkLine():
                self.sdk = f"{line.call}:{line.state}"
            case ExitedLine():
                self.exited.add(line.rank)
            case StepLine():
                self.reported_step = line.step
                if line.loss is not None:
                    self.losses = [*self.losses[-LOSSES_KEPT + 1 :], (line.step, line.loss)]
                # The fields the line has, as it has them (a None included).
                self.latest.update(line.model_dump(include=line.model_fields_set & _STEP_FIELDS))
                if line.time is not None:
                    self._rate.add(line.step, line.time)
                    self.latest["steps_per_s"] = self._rate.per_s
        # Only a step means training; a late checkpoint or eval line never undoes an end.
        if isinstance(line, (EndLine, StepLine)):
            self.latest["state"] = "training" if isinstance(line, StepLine) else line.event

    @property
    def stopped(self) -> bool:
        """The ranks agreed to stop, committed a checkpoint and said so."""
        return self.latest.get("state") == "stopped"

    @property
    def stepped(self) -> bool:
        """The ranks reported a step since they started (or are already done)."""
        return "state" in self.latest

    @property
    def training(self) -> bool:
        """The ranks are past their start: they reported a step, or (a script that reports
        none) a commit of its folder was made or its library said a save is complete."""
        committed = "checkpoint_step" in self.latest
        return (
            self.stepped
            or self.reported_step is not None
            or committed
            or (self.saved_step is not None)
        )

    @property
    def finished(self) -> bool:
        """The ranks said they are done or stopped: their work and its checkpoint are in."""
        return self.latest.get("state") in ("done", "stopped")
