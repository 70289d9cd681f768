"""Forgeline's public API: the training SDK that a rank script imports.

    import forgeline

    run = forgeline.init()                       # rank, world, device, layout, settings
    model = MyModel().to(run.device)             # yours: any torch.nn.Module, wrapped as you like
    optimizer = torch.optim.AdamW(model.parameters())
    run.restore(model, optimizer)                # resume from the last committed checkpoint
    run.dataset(block_size=64)                   # the run's token shards, this rank's slice
    for step in run.steps():                     # stops, checkpoints, health: the platform's
        for x, y in step.micro_batches():
            with step.forward():
                loss = loss_of(model, x, y)
            loss.backward()
        step.gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        step.report(loss)
    run.finish()

Everything here is documented call by call in `forgeline.training` and `forgeline.step`.
`forgeline.Client` is the other half: the client of the HTTP API (`forgeline.client`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forgeline.client import ApiError, Client
    from forgeline.errors import SDKUsageError
    from forgeline.randomness import sharded_draws
    from forgeline.reporting import report
    from forgeline.step import Step
    from forgeline.training import Run, init

# Loaded when first used: a program that only calls the API (and the `forgeline` CLI, which
# is one) must not pay for importing torch, and a rank script does not load the client.
_WHERE = {
    "ApiError": "forgeline.client",
    "Client": "forgeline.client",
    "SDKUsageError": "forgeline.errors",
    "Step": "forgeline.step",
    "Run": "forgeline.training",
    "init": "forgeline.training",
    "report": "forgeline.reporting",
    "sharded_draws": "forgeline.randomness",
}
__all__ = [  # = _WHERE
    "ApiError", "Client", "Run", "SDKUsageError", "Step", "init", "report", "sharded_draws",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'forgeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
