"""A causal convolutional language model, sharded with FSDP2, trained through Forgeline's SDK.

No attention and no recurrence: each block mixes time with a depthwise convolution that sees
only the past (dilations 1, 2, 4, ... widen what a position sees, as in WaveNet), then mixes
channels with a pointwise MLP. Every block is its own FSDP2 unit, so parameters, gradients
and AdamW moments are split over all ranks and a block's full weights exist only while it
runs. The SDK checkpoints the shards and reshards them when the next gang has another size.

    torchrun ranks ──► forgeline.init() ──► fully_shard ──► restore ──► for step in run.steps()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import forgeline


class CausalConvBlock(nn.Module):
    """x + conv(norm(x)), then x + mlp(norm(x)); the convolution is left-padded so that
    position t sees positions t - (kernel - 1) * dilation .. t and nothing later."""

    def __init__(self, width: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.pad = (kernel - 1) * dilation
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, width, kernel, dilation=dilation, groups=width)
        hidden = 4 * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time, width)
        h = self.norm1(x).transpose(1, 2)  # Conv1d wants (batch, channels, time)
        x = x + self.conv(F.pad(h, (self.pad, 0))).transpose(1, 2)
        return x + self.mlp(self.norm2(x))


class ConvLM(nn.Module):
    """Embedding → residual causal-convolution blocks → a linear readout of the next token."""

    def __init__(self, vocab: int, width: int, layers: int, kernel: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(CausalConvBlock(width, kernel, 2**i) for i in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (batch, time, vocab)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def held_out(model: nn.Module, run: forgeline.Run, block: int, batches: int) -> tuple[float, int]:
    """Mean loss over the first `batches` × 8 validation windows, shared out: each rank runs
    its part in one forward (every rank must run as many as the others: each all-gathers the
    blocks' weights), then the sums meet in one all-reduce, so every rank returns the same."""
    stream = run.validation(block)
    mine = torch.arange(min(stream.samples, batches * 8)).tensor_split(run.world)[run.rank]
    x, y = stream.batch(mine.numpy())
    model.eval()
    logits = model(x.to(run.device)).flatten(0, 1)
    loss = F.cross_entropy(logits, y.to(run.device).flatten(), reduction="sum")
    model.train()
    sums = torch.stack([loss.double(), torch.tensor(y.numel(), device=run.device).double()])
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item(), int(sums[1].item())


def main() -> None:
    run = forgeline.init()
    args = run.args  # the spec's [train.args], as written
    block, width = int(args.get("block", 64)), int(args.get("width", 128))
    layers, kernel = int(args.get("layers", 4)), int(args.get("kernel", 4))
    # The model is sharded over every rank, and gradients are averaged over all of them: so
    # every rank must read its own slice of the batch (no tensor-parallel ranks sharing one).
    if run.placement.dp_size != run.world:
        raise ValueError(f"this script shards over all {run.world} ranks: set parallel.tensor = 1")

    torch.manual_seed(run.settings.seed)  # the same initial weights on every rank
    model = ConvLM(run.vocab_size, width, layers, kernel).to(run.device)
    # Which blocks may compute their activations again in backward: the spec's
    # [parallel] activation_checkpointing says whether they do ("none" by default).
    run.recompute_activations(model.blocks)
    mesh = init_device_mesh(run.device.type, (run.world,))
    for unit in model.blocks:  # one unit per block, then the root: embedding, norm and head
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.settings.learning_rate)
    config = {"width": width, "layers": layers, "kernel": kernel, "block": block}
    run.restore(model, optimizer, model_config=config)
    run.dataset(block)

    for step in run.steps():
        for x, y in step.micro_batches():  # this rank's share of the global batch
            with step.forward():
                loss = loss_of(model, x, y)
            loss.backward()  # FSDP2 reduce-scatters each block's gradients as it goes
        step.gradients(model)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over every rank's shards
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.report(loss, grad_norm=norm.full_tensor().item())
        if run.eval_due(step) or step.number == run.settings.steps:
            with run.evaluating():
                val_loss, tokens = held_out(model, run, block, run.settings.eval_batches)
            run.report_eval(step, val_loss, tokens)

    run.finish()


if __name__ == "__main__":
    main()
