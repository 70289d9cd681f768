"""Text from a GPT: the one sampling routine that evaluation and serving share.

It imports only torch, tokenizers and trainer.model, because a registered version ships this file
with the model (trainer/serving.py's SHIPPED_MODULES) and must load where Forgeline is absent.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from trainer.model import GPT


def sample_text(
    model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int = 0
) -> str:
    ids = tokenizer.encode(prompt).ids or [0]  # an empty prompt starts from end-of-document
    idx = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(idx, max_new_tokens, generator=generator)
    # Keep special tokens: a visible <|endoftext|> shows where the model ended a document.
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)
