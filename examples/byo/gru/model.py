"""The model of the GRU example: torch only, so training (train.py) and serving (serve.py) share
it, and the registered version loads it where only torch and tokenizers are installed."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class CharGRU(nn.Module):
    """Embedding → stacked GRU → a linear readout of the next character."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(x))  # (batch, time, width)
        return self.head(hidden)  # (batch, time, vocab)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())
