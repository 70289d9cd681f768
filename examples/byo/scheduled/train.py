"""A character model trained with a warm-up-then-cosine learning rate and an exponential moving
average of its weights, through Forgeline's SDK.

The schedule and the average are state of the script's own, beside the model and the
optimizer: `run.restore(..., state={"scheduler": ..., "ema": ...})` keeps both in every
checkpoint and loads them back on resume, so a run killed and resumed goes on with the same
learning rate and the same average, bit for bit (the EMA's weights resharded like the model's
when the next gang has another size). `train.args.break_at` stops the loop early, as early
stopping would: `run.finish()` then commits a checkpoint of the step it stopped at.

    torchrun ranks ──► forgeline.init() ──► restore(state=...) ──► for step in run.steps(): ...
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import forgeline


class CharMLP(nn.Module):
    """Each character's embedding → one hidden layer → the next character's logits."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.hidden(self.embed(x))))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def warmup_then_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The factor of the base learning rate after `done` steps: linear warm-up, then a cosine
    down to a tenth."""

    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        progress = min(1.0, (done - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return factor


def main() -> None:
    run = forgeline.init()
    args = run.args  # the spec's [train.args], as written
    block, width = int(args.get("block", 32)), int(args.get("width", 64))
    break_at = int(args.get("break_at", 0))  # > 0: leave the loop after this step

    torch.manual_seed(run.settings.seed)  # the same initial weights on every rank
    net = CharMLP(run.vocab_size, width).to(run.device)
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # a copy, not wrapped
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.settings.learning_rate)
    warmup = max(1, run.settings.steps // 5)
    scheduler = LambdaLR(optimizer, warmup_then_cosine(warmup, run.settings.steps))
    run.restore(
        model,
        optimizer,
        model_config={"vocab": run.vocab_size, "width": width, "block": block},
        state={"scheduler": scheduler, "ema": ema},  # checkpointed and restored with the model
    )
    run.dataset(block)  # what step.micro_batches() hands out
    run.recompute_with(loss_of)

    for step in run.steps():
        for x, y in step.micro_batches():  # this rank's share of the global batch
            with step.forward():
                loss = loss_of(model, x, y)
            loss.backward()
        step.gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ema.update_parameters(net)
        step.report(loss, lr=scheduler.get_last_lr()[0])
        if step.number == break_at:  # every rank the same step
            break

    run.finish()  # after a break: commits where the loop stopped


if __name__ == "__main__":
    main()
