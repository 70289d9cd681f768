"""A character-level language model under DDP, written as a plain torchrun script.

It never imports Forgeline. It sets up its own process group, reads its own text file, saves
with `torch.save` into the folder that `--out` names, and continues from that folder when it
is given `--resume`. It runs the same way at home:

    torchrun --nproc-per-node 2 train.py --out ckpt            # then, to continue: --resume

Every batch is drawn from (step, rank), so a run resumed from step N trains on exactly the
batches an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class CharModel(nn.Module):
    """Embeddings, one GRU layer, a linear head: small enough for a CPU."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(x))
        return self.head(hidden)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the folder checkpoints go to")
    parser.add_argument("--resume", action="store_true", help="continue from --out/last.pt")
    parser.add_argument("--data", default=str(Path(__file__).with_name("input.txt")))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
    )

    text = Path(args.data).read_text()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = CharModel(len(vocab), args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp = DistributedDataParallel(model)

    step, last = 0, Path(args.out) / "last.pt"
    if args.resume and last.exists():
        saved = torch.load(last, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        print(f"rank {rank}: resumed at step {step}", flush=True)

    draws = torch.Generator()
    while step < args.steps:
        draws.manual_seed(1_000_003 * step + rank)
        starts = torch.randint(len(data) - args.block - 1, (args.batch,), generator=draws)
        x = torch.stack([data[s : s + args.block] for s in starts.tolist()]).to(device)
        y = torch.stack([data[s + 1 : s + 1 + args.block] for s in starts.tolist()]).to(device)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 0 and step % args.save_every == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "step": step}, last)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
