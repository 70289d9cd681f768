"""A character-level language model split into pipeline stages through Forgeline's SDK.

The model is this folder's: an embedding, residual blocks that each mix a causal window of
positions (a left-padded depthwise convolution) and then channels (an MLP), a norm and a
readout. Under `[parallel] pipeline = P` each rank builds only the stages it holds, names their
layers with `run.stage_layers`, and hands them to `run.pipeline`, which runs the spec's schedule:
the first stage takes the inputs, the last computes the loss, and `pipeline.step(x, y)` returns
the step's mean loss on every rank. The checkpoints keep the whole model's parameter names, so
a run resumes on another pipeline degree, and the registered weights load into `LM` whole.

    torchrun ranks ──► forgeline.init() ──► run.stages ──► run.pipeline ──► restore ──► steps
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import forgeline


class Block(nn.Module):
    """x + mix(norm(x)) over a causal window of `kernel` positions, then x + mlp(norm(x))."""

    def __init__(self, width: int, kernel: int) -> None:
        super().__init__()
        self.pad = kernel - 1
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix = nn.Conv1d(width, width, kernel, groups=width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, width)
        h = self.norm1(x).transpose(1, 2)
        x = x + self.mix(F.pad(h, (self.pad, 0))).transpose(1, 2)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    """The whole model: what a registered version's weights load into."""

    def __init__(self, vocab: int, width: int, layers: int, kernel: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, kernel) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)


class Stage(nn.Module):
    """Some of the model's blocks under their own indices (`blocks.3` stays `blocks.3`), with
    the embedding on the first stage and the norm and head on the last: every parameter has the
    name it has in `LM`."""

    def __init__(self, model: LM, layers: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = model.embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    run = forgeline.init()
    args = run.args
    block, width = int(args.get("block", 64)), int(args.get("width", 64))
    layers, kernel = int(args.get("layers", 4)), int(args.get("kernel", 4))

    torch.manual_seed(run.settings.seed)  # the same whole model on every rank; each keeps its part
    model = LM(run.vocab_size, width, layers, kernel).to(run.device)
    last = run.pipeline_settings.stages - 1
    splits = [list(r) for r in run.stage_layers(layers)]  # the layers of each of run.stages
    stages = [
        Stage(model, held, s == 0, s == last) for s, held in zip(run.stages, splits, strict=True)
    ]
    pipeline = run.pipeline(stages, loss_fn)
    # One module holding every parameter this rank trains, for the optimizer and checkpoints.
    mine = Stage(model, [i for held in splits for i in held], 0 in run.stages, last in run.stages)
    del model  # the layers of other stages are dropped with it
    optimizer = torch.optim.AdamW(mine.parameters(), lr=run.settings.learning_rate)
    config = {"width": width, "layers": layers, "kernel": kernel, "block": block}
    run.restore(mine, optimizer, model_config=config)
    run.dataset(block)

    for step in run.steps():
        for x, y in step.micro_batches():  # this data-parallel rank's share of the batch
            with step.forward():
                loss = pipeline.step(x, y)  # every micro-batch there and back
        step.gradients(mine, max_norm=1.0)  # the norm over every stage's gradients
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.report(loss)

    run.finish()


if __name__ == "__main__":
    main()
