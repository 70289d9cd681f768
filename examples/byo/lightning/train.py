"""A character-level GRU trained from scratch with Lightning, on a text file.

Forgeline adds one callback (metrics, and a preemption turned into a save) and the folder the
`ModelCheckpoint` saves into, which it commits and restores:

    torchrun --nproc-per-node 2 train.py --out ckpt      # at home; run again to resume

Lightning's own checkpoint (`last.ckpt`: module, optimizer, loop position) is what a restart
resumes from.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from forgeline.integrations.lightning import ForgelineCallback, last_checkpoint


class CharWindows(Dataset):
    """`count` windows of `block` + 1 characters from `ids`, at seeded positions."""

    def __init__(self, ids: torch.Tensor, block: int, count: int, seed: int) -> None:
        draws = torch.Generator().manual_seed(seed)
        self.ids, self.block = ids, block
        self.starts = torch.randint(len(ids) - block - 1, (count,), generator=draws).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[self.starts[index] : self.starts[index] + self.block + 1]
        return window[:-1], window[1:]


class CharGRU(pl.LightningModule):
    def __init__(self, vocab: int, width: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(x))
        return self.head(hidden)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the checkpoints are saved")
    parser.add_argument("--data", default=str(Path(__file__).with_name("input.txt")))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    text = Path(args.data).read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    held_out = len(ids) * 9 // 10
    train = CharWindows(ids[:held_out], args.block, 1_000_000, seed=1)
    val = CharWindows(ids[held_out:], args.block, 256, seed=2)

    pl.seed_everything(0)
    # last.ckpt, overwritten at each save, is what a restart resumes from.
    saves = ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every,
                            save_last=True, enable_version_counter=False)  # fmt: skip
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="auto",
        devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node,
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        max_steps=args.steps,
        val_check_interval=args.save_every,
        check_val_every_n_epoch=None,
        limit_val_batches=4,
        log_every_n_steps=10,
        callbacks=[saves, ForgelineCallback(saves)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        CharGRU(len(vocab), args.width, lr=3e-3),
        DataLoader(train, batch_size=args.batch),
        DataLoader(val, batch_size=args.batch),
        ckpt_path=last_checkpoint(args.out),
    )
    if trainer.is_global_zero:  # what the version registers beside the checkpoint
        (Path(args.out) / "vocab.json").write_text(json.dumps(vocab))


if __name__ == "__main__":
    main()
