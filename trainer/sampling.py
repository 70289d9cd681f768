"""Text from a GPT: the one sampling routine that evaluation and serving share.

It imports only torch, tokenizers and trainer.model, because a registered version ships this file
with the model (trainer/serving.py's SHIPPED_MODULES) and must load where Forgeline is absent.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from trainer.model import GPT


def default_device() -> torch.device:
    """Where serving and evaluation run: this process's GPU when it sees one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sample_text(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int = 0
) -> str:
    """The prompt continued by `max_new_tokens` sampled tokens, drawn on the model's device:
    the prompt's ids and the seeded generator live there (torch.multinomial refuses a
    generator of another device). On CPU the same seed gives what it always gave."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt).ids or [0]  # an empty prompt starts from end-of-document
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, generator=generator)
    # Keep special tokens: a visible <|endoftext|> shows where the model ended a document.
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)
