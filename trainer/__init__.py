"""Distributed training: the model, the torchrun loop, deterministic data, checkpoints, metrics."""
