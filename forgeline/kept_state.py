"""What a rank script keeps beside its model and optimizer: `run.restore(..., state={...})`.

Any object with `state_dict()` and `load_state_dict()` (an LR scheduler, an EMA of the weights,
a GradScaler, its own data loader's position, a class of the script's own) goes into every
checkpoint under its name and is loaded back on resume, in the same torch.distributed.checkpoint
save and load as the model (`trainer.checkpoint`, under the key `state.<name>`):

- its tensors (an EMA's weights) are written as the model's are: a DTensor of a sharded layout
  as its shards, a data-parallel gang's plain tensors split over the ranks; DCP reshards them
  when the next gang has another world size;
- everything else must be plain typed data: bool, int, float, str, None, and lists, tuples and
  string-keyed dicts of these. It is written as DCP's non-tensor items, one copy for the gang
  (the state is every rank's alike: a step count, a schedule, a loader's global position), and
  read back by torch's weights-only unpickler (`trainer.safe_load`), which builds such data and
  never calls what a file names. An object of any other type would only be loadable by the
  ordinary unpickler, the door the platform keeps shut: it is refused when it is handed over.

Everything a script could get wrong here is refused by `run.restore()`, before the first step,
saying what to do instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from forgeline.errors import SDKUsageError

# A name is one part of the checkpoint's keys (`state.<name>.…`): no dots, nothing odd.
STATE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_PLAIN = (bool, int, float, str, type(None))
_TYPED_DATA = (
    "tensors and plain data (bool, int, float, str, None, and lists, tuples and dicts with str "
    "keys of these)"
)


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


class KeptState:
    """The script's named objects, checked once when handed over."""

    def __init__(self, state: object) -> None:
        if not isinstance(state, Mapping):
            raise SDKUsageError(
                f"run.restore(state=...) takes a dict of name → object, not a "
                f"{type(state).__name__}: e.g. state={{'scheduler': scheduler, 'ema': ema}}"
            )
        for name, kept in state.items():
            _check_name(name)
            _check_methods(name, kept)
        self.objects: dict[str, Stateful] = dict(state)
        self.capture()  # what a checkpoint would hold, checked now rather than at a save

    def capture(self) -> dict[str, dict[str, Any]]:
        """Every object's state now, as the checkpoint stores it: its tensors as they are (a
        save stages its own copy of them) and fresh containers around its other values, so
        the object may change while the save is on its way."""
        return {
            name: _typed(_state_dict_of(name, kept), f"{name}.state_dict()")
            for name, kept in self.objects.items()
        }

    def load(self, loaded: dict[str, dict[str, Any]]) -> None:
        """Hand each object its state as a checkpoint held it (what `capture` made, filled
        by the load)."""
        for name, kept in self.objects.items():
            kept.load_state_dict(loaded[name])


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not STATE_NAME.fullmatch(name):
        raise SDKUsageError(
            f"run.restore(state={{{name!r}: ...}}): a name is 1-64 letters, digits or '_', "
            "starting with a letter (it names the state in every checkpoint), e.g. 'scheduler'"
        )


def _check_methods(name: str, kept: object) -> None:
    lacking = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(kept, m, None))]
    if lacking:
        raise SDKUsageError(
            f"run.restore(state={{{name!r}: ...}}): a {type(kept).__name__} has no "
            f"{' or '.join(f'{m}()' for m in lacking)}; pass an object with both (an LR "
            "scheduler, torch.optim.swa_utils.AveragedModel, a GradScaler, a class of yours), "
            "or wrap what you keep in a class that has them"
        )


def _state_dict_of(name: str, kept: Stateful) -> Mapping[str, Any]:
    state = kept.state_dict()
    if not isinstance(state, Mapping):
        raise SDKUsageError(
            f"run.restore(state={{{name!r}: ...}}): its state_dict() returned a "
            f"{type(state).__name__}; it must return a dict"
        )
    return state


def _typed(value: Any, where: str) -> Any:
    """`value` rebuilt from fresh containers, or SDKUsageError naming the first part of it
    that a checkpoint cannot hold (and why: the loader would have to unpickle it)."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value
    if isinstance(value, Mapping):
        for key in value:
            # DCP names every value by its path of str keys: an int key would come back a str.
            if not isinstance(key, str):
                raise SDKUsageError(
                    f"{where} has the {type(key).__name__} key {key!r}: a checkpoint keeps "
                    f"dicts with str keys; use str({key!r}) in state_dict() and back in "
                    "load_state_dict()"
                )
        return {key: _typed(item, f"{where}[{key!r}]") for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_typed(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise SDKUsageError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}: a checkpoint "
        f"keeps {_TYPED_DATA}, and loads nothing else (it would have to unpickle it, which "
        "can run code); turn it into one of those in state_dict() and back in load_state_dict()"
    )
