"""A small GPT-2 trained from scratch with the Hugging Face `Trainer`, on a text file.

No model or tokenizer comes from a hub: the configuration is made here and the tokenizer is the
text's characters. Forgeline adds one callback (metrics, and a preemption turned into a save)
and the folder the Trainer saves into, which it commits and restores:

    torchrun --nproc-per-node 2 train.py --output-dir out     # at home; run again to resume

Every window of the text is drawn from a seeded permutation, and the Trainer's own checkpoint
(`checkpoint-N`: model, optimizer, scheduler, RNG states, the step) is what a restart resumes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from forgeline.integrations.transformers import ForgelineCallback, last_checkpoint


class CharWindows(torch.utils.data.Dataset):
    """`count` windows of `block` characters from `ids`, at seeded positions."""

    def __init__(self, ids: torch.Tensor, block: int, count: int, seed: int) -> None:
        starts = torch.randint(
            len(ids) - block, (count,), generator=torch.Generator().manual_seed(seed)
        )
        self.ids, self.block, self.starts = ids, block, starts.tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.ids[self.starts[index] : self.starts[index] + self.block]
        return {"input_ids": window, "labels": window}  # GPT-2 shifts the labels itself


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="where the Trainer saves")
    parser.add_argument("--data", default=str(Path(__file__).with_name("input.txt")))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    text = Path(args.data).read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    held_out = len(ids) * 9 // 10

    config = GPT2Config(vocab_size=len(vocab), n_positions=args.block, n_embd=args.width,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        learning_rate=3e-3,
        warmup_steps=20,
        logging_steps=10,
        save_steps=args.save_steps,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if torch.cuda.is_available() else "gloo",
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=CharWindows(ids[:held_out], args.block, 100_000, seed=1),
        eval_dataset=CharWindows(ids[held_out:], args.block, 64, seed=2),
        callbacks=[ForgelineCallback()],
    )
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))
    if trainer.is_world_process_zero():  # what the version registers beside the weights
        trainer.save_model(args.output_dir)
        (Path(args.output_dir) / "vocab.json").write_text(json.dumps(vocab))


if __name__ == "__main__":
    main()
