"""How the registered GRU answers prompts (train.py names this module: run.serve_with("serve")).

`forgeline serve` and `forgeline generate` load the version through it: load() gets the trained
weights, the model_config train.py gave run.restore() and the dataset's tokenizer; predict()
continues each prompt. It imports no Forgeline code: the version loads in an environment that
holds only its declared requirements.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from model import CharGRU


def load(weights: dict[str, torch.Tensor], config: dict, tokenizer: Tokenizer) -> tuple:
    model = CharGRU(config["vocab"], config["width"], config["layers"])
    model.load_state_dict(weights)
    return model.eval(), tokenizer


def predict(loaded: tuple, prompts: list[str], params: dict) -> list[str]:
    model, tokenizer = loaded
    steps, seed = int(params.get("max_new_tokens", 100)), int(params.get("seed", 0))
    generator = torch.Generator().manual_seed(seed)
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids or [0]])
        logits, state = _step(model, ids, None)
        for _ in range(steps):
            nxt = torch.multinomial(torch.softmax(logits[:, -1], -1), 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
            logits, state = _step(model, nxt, state)
        out.append(tokenizer.decode(ids[0].tolist(), skip_special_tokens=False))
    return out


def _step(model: CharGRU, ids: torch.Tensor, state: torch.Tensor | None) -> tuple:
    """One stretch of the recurrence, carrying the hidden state: O(1) work per new character."""
    hidden, state = model.rnn(model.embed(ids), state)
    return model.head(hidden), state
