"""The baseline of bench/trainer.py: the plainest single-process PyTorch loop of the same model,
batch and data. No process group, no checkpoints, no progress file, no health signals.

    python -m bench.bare_loop SHARD DTYPE MODEL_JSON BATCH STEPS THREADS [--warmup N] [--arch A]

`--arch gpt` (the default) trains the built-in GPT as the model json lays it out (new runs:
one qkv with its rows grouped by head, no biases); `--arch fused` the same shape with a plain
fused qkv and no biases (bench/fused_gpt.py); `--arch separate` the built-in GPT in its former
layout (separate q, k and v, biases everywhere), so all three run in the same loop.
Prints one JSON line: {"tokens_per_s": ..., "measured_steps": ..., "window_tokens_per_s": [...]},
timed after the warm-up; the windows are `--warmup` steps each (the trainer's logging grid).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import numpy as np
import torch

from bench.fused_gpt import fused_gpt
from trainer.model import GPT, GPTConfig

ARCHS = {
    "gpt": GPT,
    "fused": fused_gpt,
    "separate": lambda config: GPT(dataclasses.replace(config, fused_qkv=False, bias=True)),
}


def main(
    shard: str, dtype: str, model_json: str, batch: int, steps: int, threads: int,
    warmup: int = 5, arch: str = "gpt",
) -> None:  # fmt: skip
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPTConfig(**json.loads(model_json))
    model = ARCHS[arch](config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    tokens = np.memmap(shard, dtype=np.dtype(dtype), mode="r")
    rng = np.random.default_rng(0)
    T = config.block_size
    started = 0.0
    marks: list[float] = []  # the clock every `warmup` steps once the warm-up is over
    for step in range(steps):
        if step >= warmup and (step - warmup) % warmup == 0:
            marks.append(time.perf_counter())
        if step == warmup:
            started = time.perf_counter()
        starts = rng.integers(0, len(tokens) - T - 1, size=batch)
        rows = np.stack([tokens[s : s + T + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(rows)  # (B, T + 1)
        _, loss = model(window[:, :-1], window[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    measured = steps - warmup
    elapsed = time.perf_counter() - started
    if (steps - warmup) % warmup == 0:
        marks.append(time.perf_counter())
    windows = [warmup * batch * T / (b - a) for a, b in itertools.pairwise(marks)]
    print(json.dumps({"tokens_per_s": measured * batch * T / elapsed, "measured_steps": measured,
                      "window_tokens_per_s": windows}))  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("shard", "dtype", "model_json"):
        parser.add_argument(name)
    for name in ("batch", "steps", "threads"):
        parser.add_argument(name, type=int)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="gpt")
    a = parser.parse_args()
    main(a.shard, a.dtype, a.model_json, a.batch, a.steps, a.threads, a.warmup, a.arch)
