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

from forgeline.client import ApiError, Client
from forgeline.errors import SDKUsageError
from forgeline.step import Step
from forgeline.training import Run, init

__all__ = ["ApiError", "Client", "Run", "SDKUsageError", "Step", "init"]
