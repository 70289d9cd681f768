"""The baseline of bench/trainer.py: the plainest single-process PyTorch loop of the same model,
batch and data. No process group, no checkpoints, no progress file, no health signals.

    python -m bench.bare_loop SHARD DTYPE MODEL_JSON BATCH STEPS THREADS

Prints one JSON line: {"tokens_per_s": ..., "measured_steps": ...}, timed after a warm-up.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from trainer.model import GPT, GPTConfig

WARMUP_STEPS = 5


def main(shard: str, dtype: str, model_json: str, batch: int, steps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPTConfig(**json.loads(model_json))
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = np.memmap(shard, dtype=np.dtype(dtype), mode="r")
    rng = np.random.default_rng(0)
    T = config.block_size
    started = 0.0
    for step in range(steps):
        if step == WARMUP_STEPS:
            started = time.perf_counter()
        starts = rng.integers(0, len(tokens) - T - 1, size=batch)
        rows = np.stack([tokens[s : s + T + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(rows)  # (B, T + 1)
        _, loss = model(window[:, :-1], window[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    measured = steps - WARMUP_STEPS
    elapsed = time.perf_counter() - started
    print(json.dumps({"tokens_per_s": measured * batch * T / elapsed, "measured_steps": measured}))


if __name__ == "__main__":
    shard_, dtype_, model_, batch_, steps_, threads_ = sys.argv[1:7]
    main(shard_, dtype_, model_, int(batch_), int(steps_), int(threads_))
