"""Evaluation and sampling on the run's device (finding 17), shown on CPU through the code a GPU
runs: sampling draws on the model's device and gives, on CPU, what it gave before; the loop's
evaluation runs the uncompiled module under the steps' autocast, so neither eval mode nor the
short last batch recompiles the compiled model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dataprep.tokenizer import char_tokenizer
from trainer.data import TokenStream
from trainer.evaluate import autocast_on, held_out_loss, held_out_loss_while_training
from trainer.model import GPT, GPTConfig
from trainer.sampling import default_device, sample_text
from trainer.serving import TextGenerator, export_model

PROMPT = "ROMEO:"
# What sample_text gave for this model, prompt and seed before it drew on the model's device
# (CPU generator, CPU indices): the CPU's seeded output must not change.
BEFORE = "ROMEO:e!!Ei<|endoftext|>k<|endoftext|><|endoftext|>!r:io!?rR?n?!hu"


def tiny_gpt(vocab_size: int, dropout: float = 0.0) -> GPT:
    torch.manual_seed(3)
    return GPT(
        GPTConfig(vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, block_size=16,
                  rope=True, swiglu=True, fused_qkv=True, bias=False, dropout=dropout)
    )  # fmt: skip


@pytest.fixture
def tokenizer():
    return char_tokenizer(["ROMEO: But, soft! what light through yonder window breaks?"])


def test_sampling_on_cpu_gives_what_it_gave_before(tokenizer) -> None:
    model = tiny_gpt(tokenizer.get_vocab_size()).eval()
    # 24 new tokens past a block of 16: the context is cropped as well.
    assert sample_text(model, tokenizer, PROMPT, 24, seed=11) == BEFORE


def test_a_served_version_generates_on_the_default_device(tokenizer, tmp_path: Path) -> None:
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    files = export_model(
        tiny_gpt(tokenizer.get_vocab_size()), tmp_path / "tokenizer.json", tmp_path / "model"
    )
    served = TextGenerator(Path(files["weights"]), Path(files["config"]), Path(files["tokenizer"]))
    assert next(served.model.parameters()).device.type == default_device().type
    assert served.model.lm_head.weight is served.model.wte.weight  # still tied after the move
    assert served.generate(PROMPT, 24, seed=11) == BEFORE


@pytest.fixture
def val_stream(tmp_path: Path) -> TokenStream:
    """11 samples of 16 tokens: batches of 4 leave a short last batch of 3."""
    tokens = np.random.default_rng(0).integers(0, 40, size=11 * 16 + 1).astype(np.uint16)
    tokens.tofile(tmp_path / "val.bin")
    return TokenStream([tmp_path / "val.bin"], "uint16", 16)


def test_the_loop_s_evaluation_does_not_recompile_the_compiled_model(
    val_stream: TokenStream,
) -> None:
    model = tiny_gpt(40, dropout=0.1)  # dropout: eval mode is a different graph
    graphs: list[torch.fx.GraphModule] = []

    def counting(graph: torch.fx.GraphModule, _inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(model, backend=counting)
    x, y = val_stream.batch(np.arange(4))
    compiled(x, y)[1].backward()  # a training step's forward: compiled once
    compiled_for_training = len(graphs)

    loss, tokens = held_out_loss_while_training(
        compiled, val_stream, 4, 10, (0, 1), autocast_on(torch.device("cpu"))
    )

    assert len(graphs) == compiled_for_training  # neither eval mode nor the batch of 3 compiled
    assert model.training  # back to training for the next step
    assert tokens == 11 * 16  # the short batch scored, nothing dropped
    model.eval()
    assert (loss, tokens) == held_out_loss(model, val_stream, 4, 10)  # the plain module's loss
    # What it avoided: the compiled model, in eval mode, compiles again.
    compiled(x[:3], y[:3])
    assert len(graphs) > compiled_for_training


def test_evaluation_runs_under_the_autocast_it_is_given(val_stream: TokenStream) -> None:
    model = tiny_gpt(40).eval()
    full, _ = held_out_loss(model, val_stream, 4, 10, autocast=autocast_on(torch.device("cpu")))
    assert full == held_out_loss(model, val_stream, 4, 10)[0]  # the CPU's precision: fp32

    def bf16() -> torch.autocast:  # what a GPU's runtime gives, here on the CPU's autocast
        return torch.autocast("cpu", dtype=torch.bfloat16)

    low, _ = held_out_loss(model, val_stream, 4, 10, autocast=bf16)
    assert low != full and low == pytest.approx(full, rel=2e-2)
