"""A character-level GRU language model under DDP, trained through Forgeline's SDK.

Nothing here comes from Forgeline's own trainer: the model (model.py), the optimizer and the
loop are this folder's, and so is how the registered model answers prompts (serve.py). The SDK
(`import forgeline`) hands it the gang, the data and the checkpoints: the run resumes exactly
after a dead node, on however many ranks the next gang has.

    torchrun ranks ──► forgeline.init() ──► restore ──► for step in run.steps(): ...
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import forgeline

from model import CharGRU, loss_of  # this folder's own module (the code snapshot's root)


@torch.no_grad()
def held_out(model: nn.Module, run: forgeline.Run, block: int, batches: int) -> tuple[float, int]:
    """Mean loss over the first validation windows (the same on every rank), and tokens."""
    stream = run.validation(block)
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, min(stream.samples, batches * 8), 8):
        x, y = stream.batch(torch.arange(start, min(start + 8, stream.samples)).numpy())
        total += loss_of(model, x.to(run.device), y.to(run.device)).item() * y.numel()
        tokens += y.numel()
    model.train()
    return total / tokens, tokens


def main() -> None:
    run = forgeline.init()
    args = run.args  # the spec's [train.args], as written
    block, width, layers = (
        int(args.get("block", 64)),
        int(args.get("width", 128)),
        int(args.get("layers", 1)),
    )

    torch.manual_seed(run.settings.seed)  # the same initial weights on every rank
    model = CharGRU(run.vocab_size, width, layers)
    model = DistributedDataParallel(model.to(run.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.settings.learning_rate)
    run.restore(
        model,
        optimizer,
        model_config={"vocab": run.vocab_size, "width": width, "layers": layers, "block": block},
    )
    run.serve_with("serve")  # serve.py: how the registered version answers prompts
    run.dataset(block)
    # With `recovery.shadow_every`, another node computes a micro-batch of this rank's again
    # and compares the gradients: this is what one micro-batch's backward starts from.
    run.recompute_with(loss_of)

    for step in run.steps():
        for x, y in step.micro_batches():  # this rank's share of the global batch
            with step.forward():
                loss = loss_of(model, x, y)
            loss.backward()
        step.gradients(model)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.report(loss, perplexity=math.exp(min(loss.item(), 20)))
        if run.eval_due(step) or step.number == run.settings.steps:
            with run.evaluating():
                val_loss, tokens = held_out(model.module, run, block, run.settings.eval_batches)
            run.report_eval(step, val_loss, tokens)

    run.finish()


if __name__ == "__main__":
    main()
