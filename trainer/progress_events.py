"""The progress lines the node agent follows, typed. The ranks write them (trainer.progress), and
a rank runs the user's code: a script can write any line to the file. Each line the agent
follows is checked here once, so that what it heartbeats, signals and returns is always well
formed; a line that is not a JSON object with an "event" string, or whose fields are not what its
event needs, is an odd line (OddLine, naming what is wrong), which the agent passes over with a
warning, never a crash of its activity."""

from __future__ import annotations

import json
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# The latest time datetime.fromtimestamp can hold (9999-12-31): a health line's time becomes one.
_LATEST_TIME = 253402300799.0
# Finite, and a time datetime can hold; NaN fails both bounds.
_Time = Annotated[float, Field(ge=0, le=_LATEST_TIME)]
_Step = Annotated[int, Field(ge=0)]


class _Line(BaseModel):
    # The SDK writes more than the agent reads (tokens_seen, rank_step_s, ...): ignored here.
    model_config = ConfigDict(extra="ignore", frozen=True)

    time: _Time | None = None  # when the rank wrote it (trainer.progress stamps every line)


class StepLine(_Line):
    event: Literal["step"]
    step: _Step
    loss: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    checkpoint_step: _Step | None = None
    epoch: int | None = None


class CheckpointLine(_Line):
    event: Literal["checkpoint"]
    step: _Step


class EndLine(_Line):
    """The ranks are done, or stopped (checkpointed) early and say why."""

    event: Literal["done", "stopped"]
    step: _Step
    reason: str | None = None


class EvalLine(_Line):
    event: Literal["eval"]
    val_loss: float


class FailedLine(_Line):
    event: Literal["failed"]
    reason: str


class PeerSkippedLine(_Line):
    event: Literal["peer_skipped"]
    why: str


class UserErrorLine(_Line):
    event: Literal["user_error"]
    reason: str
    detail: str = ""


class CrashedLine(_Line):
    event: Literal["crashed"]
    reason: str
    # The error says the node's device or driver is broken (trainer.platform_faults).
    node_fault: bool = False


class HealthLine(_Line):
    """What the ranks found about a node (forgeline.findings). Its kind is one of the SDK's
    few: the agent signals a few of each kind to the run, so a free kind would be free signals."""

    event: Literal["health"]
    kind: Literal["straggler", "suspect", "spike", "corruption"]
    time: _Time
    step: _Step | None = None
    node_index: int | None = Field(None, ge=0)
    evidence: str = ""
    action: Literal["report", "swap", "quarantine"] = "report"


class SdkLine(_Line):
    """The SDK call the ranks are in or back from (trainer.start_watch)."""

    event: Literal["sdk"]
    call: str
    state: str


class ExitedLine(_Line):
    """A rank of a script that keeps its own checkpoints returned (trainer.entry): what it
    left in its checkpoint folder is whole, even if the gang was stopped by a signal
    (trainer.script_folder)."""

    event: Literal["exited"]
    rank: int = Field(ge=0)


class SavedLine(_Line):
    """A training library's save is complete (forgeline.integrations: the Trainer's
    `checkpoint-N`, Lightning's `.ckpt`): the folder holds a whole checkpoint of `step`, which
    the node agent commits at once instead of waiting for the folder to be quiet."""

    event: Literal["saved"]
    step: _Step


ProgressLine = (
    StepLine
    | CheckpointLine
    | SavedLine
    | EndLine
    | EvalLine
    | FailedLine
    | PeerSkippedLine
    | UserErrorLine
    | CrashedLine
    | HealthLine
    | SdkLine
    | ExitedLine
)
_LINE: TypeAdapter[ProgressLine] = TypeAdapter(
    Annotated[ProgressLine, Field(discriminator="event")]
)
# Every event name a model above takes.
FOLLOWED = frozenset(
    name
    for model in get_args(ProgressLine)
    for name in get_args(model.model_fields["event"].annotation)
)


class OddLine(ValueError):
    """A progress line the agent cannot follow; the message says what is wrong with it."""


def progress_line(raw: bytes) -> ProgressLine | None:
    """The line as the agent follows it; None for an event it does not follow (the SDK's own
    notes: started, shadow_check, peer_checkpoint, ...). Raises OddLine."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # RecursionError: "[[[[..." nested too deep
        raise OddLine(f"not JSON ({type(err).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("event"), str):
        raise OddLine('not a JSON object with an "event" string')
    if data["event"] not in FOLLOWED:
        return None
    try:
        return _LINE.validate_python(data)
    except ValidationError as err:
        wrong = ", ".join(".".join(map(str, e["loc"][1:])) or "?" for e in err.errors()[:3])
        what = f"a {data['event']!r} line with fields that are not what it needs: {wrong}"
        raise OddLine(what) from None
