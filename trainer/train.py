"""The built-in GPT trainer: one user of the training SDK, with nothing a user script lacks.

    python -m torch.distributed.run ... -m trainer.train JOB.json

It reads top to bottom like nanoGPT's train.py: the model, split as the spec's layout says;
the optimizer; resume; then the steps. Checkpoints, stop requests, health signals and progress
are the SDK's (`forgeline.init()`, `run.restore()`, `run.steps()`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model as load_safetensors

import forgeline
from trainer.checkpoint import load_model_weights
from trainer.evaluate import held_out_loss_while_training
from trainer.gpt_stages import StagedGPT, StagesInOrder, build_stages, stage_loss, stage_model
from trainer.metrics import flops_per_token
from trainer.model import GPT, GPTConfig, adamw
from trainer.parallel import blocks_of, build, parallelize, precision_for
from trainer.pipeline import Pipeline
from trainer.schedule import learning_rate


def fine_tuned(
    config: GPTConfig, init_from: Path, run: forgeline.Run
) -> tuple[GPT, torch.nn.Module]:
    """Another model's weights, for a fresh optimizer. Still built whole on the host, then
    loaded and split: the loaders fill whole tensors, not this rank's shards, so fine-tuning a
    model too large for one host's memory is not supported yet."""
    torch.manual_seed(run.settings.seed)
    model = GPT(config)
    _load_start(model, init_from)
    model.to(run.device)
    return model, parallelize(model, run.layout, run.placement)


def _load_start(model: GPT, init_from: Path) -> None:
    if init_from.is_dir():
        load_model_weights(model, init_from)  # a verified checkpoint folder
    else:
        load_safetensors(model, str(init_from))  # a registered model's weights


def main() -> None:
    run = forgeline.init()
    cfg = run.settings

    # Model: the same initial weights on every rank, split as the layout says.
    config = GPTConfig(**run.model_shape)
    pipeline: Pipeline | None = None
    if run.pipeline_settings.on:
        # This rank's stages only; each its own module for the schedule, one for checkpoints.
        staged = pipelined(config, run)
        model, wrapped = staged.module, staged.module
        run.recompute_activations(blocks_of(model))
        pipeline = run.pipeline(staged.parts, stage_loss, tied=staged.tied)
    else:
        if run.init_from is None:
            # Built on the meta device and filled after sharding: no rank ever holds the whole
            # model on the host, and the weights are bitwise the eager build's (trainer.parallel).
            model, wrapped = build(config, cfg.seed, run.layout, run.placement, run.device)
        else:
            model, wrapped = fine_tuned(config, run.init_from, run)
        # Blocks whose activations are computed again in backward, where the spec asks for it.
        run.recompute_activations(model.blocks)
    optimizer = adamw(
        model, cfg.learning_rate, cfg.weight_decay, fused=precision_for(run.device.type).fused_adamw
    )
    with torch.device("meta"):  # the whole model's size, for MFU, whatever this rank holds
        whole = GPT(config).num_params()
    run.restore(
        wrapped,  # DDP's wrapper: the SDK watches its reduction (own gradients, exact resume)
        optimizer,
        model_config=config.to_dict(),
        flops_per_token=flops_per_token(config, whole),
    )
    if run.device.type == "cuda" and pipeline is None:
        wrapped = torch.compile(wrapped)

    # Data: each data-parallel rank reads its slice of every global batch.
    run.dataset(config.block_size)
    val = run.validation(config.block_size)
    micro = cfg.grad_accum_steps
    if pipeline is None:
        # What one micro-batch's backward starts from, for the shadow checks to compute again.
        run.recompute_with(lambda module, x, y: module(x, y)[1] / micro)

    for step in run.steps():
        loss_sum = torch.zeros((), device=run.device)
        for x, y in step.micro_batches():  # x, y: (batch / ranks / micro, block_size)
            if pipeline is not None:  # every micro-batch of the pipeline's, there and back
                with step.forward():
                    loss = pipeline.step(x, y)
            else:
                with step.forward():
                    _, loss = wrapped(x, y)
                (loss / micro).backward()
            loss_sum += loss.detach() / micro
        step.gradients(wrapped, max_norm=cfg.grad_clip)  # health signals, then clipping
        lr = learning_rate(step.number - 1, cfg.learning_rate, cfg.min_lr, cfg.warmup_steps,
                           cfg.steps)  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.report(loss_sum, lr=lr)

        if val is not None and run.eval_due(step):
            scored = wrapped if pipeline is None else StagesInOrder(staged, pipeline)
            with run.evaluating():  # eager, under the steps' autocast: no recompile
                val_loss, val_tokens = held_out_loss_while_training(
                    scored, val, cfg.batch_size // run.placement.dp_size, cfg.eval_batches,
                    (run.placement.dp_rank, run.placement.dp_size), run.autocast,
                )  # fmt: skip
            run.report_eval(step, val_loss, val_tokens)

    run.finish()


def pipelined(config: GPTConfig, run: forgeline.Run) -> StagedGPT:
    """This rank's stages: built on the meta device, or cut from a fine-tuned start's whole
    model (which is built whole on the host first, as `fine_tuned` says)."""
    settings = run.pipeline_settings
    if run.init_from is None:
        return build_stages(config, run.settings.seed, run.layout, run.placement, run.device,
                            settings)  # fmt: skip
    torch.manual_seed(run.settings.seed)
    model = GPT(config)
    _load_start(model, run.init_from)
    return stage_model(model.to(run.device), run.layout, run.placement, settings)


if __name__ == "__main__":
    main()
