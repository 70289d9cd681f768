"""The trained model as something that answers prompts: safetensors weights + tokenizer +
config, wrapped as an MLflow pyfunc so `mlflow models serve` and `forgeline` can load it."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import torch
from mlflow.models import ModelSignature, infer_signature
from safetensors.torch import load_model, save_model
from tokenizers import Tokenizer

from trainer.evaluate import sample_text
from trainer.model import GPT, GPTConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"


def export_model(model: GPT, tokenizer_file: Path, dest: Path) -> dict[str, str]:
    """Write the three artifacts; returns them by name for `mlflow.pyfunc.log_model`."""
    dest.mkdir(parents=True, exist_ok=True)
    # save_model (not save_file) handles the tied embedding: shared tensors are stored once.
    save_model(model, str(dest / WEIGHTS_FILE))
    (dest / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
    (dest / TOKENIZER_FILE).write_bytes(tokenizer_file.read_bytes())
    return {
        "weights": str(dest / WEIGHTS_FILE),
        "config": str(dest / CONFIG_FILE),
        "tokenizer": str(dest / TOKENIZER_FILE),
    }


class TextGenerator:
    def __init__(self, weights: Path, config: Path, tokenizer: Path) -> None:
        self.model = GPT(GPTConfig(**json.loads(config.read_text())))
        load_model(self.model, str(weights))
        self.model.eval()
        self.tokenizer = Tokenizer.from_file(str(tokenizer))

    def generate(self, prompt: str, max_new_tokens: int = 200, seed: int = 0) -> str:
        return sample_text(self.model, self.tokenizer, prompt, max_new_tokens, seed)


def signature() -> ModelSignature:
    """Prompts in, continuations out; `max_new_tokens` and `seed` as request parameters."""
    return infer_signature(
        model_input=["ROMEO:"],
        model_output=["ROMEO: ..."],
        params={"max_new_tokens": 200, "seed": 0},
    )


class GPTTextModel(mlflow.pyfunc.PythonModel):
    """pyfunc: a list of prompts in, a list of continuations (prompt included) out."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        artifacts = context.artifacts
        self.generator = TextGenerator(
            Path(artifacts["weights"]), Path(artifacts["config"]), Path(artifacts["tokenizer"])
        )

    # No type hints on model_input and the result: MLflow would derive a signature from them
    # and drop `signature()`'s request parameters (max_new_tokens, seed).
    def predict(self, context, model_input, params: dict | None = None):
        # MLflow hands over what the signature declares as a one-column DataFrame.
        prompts = model_input.iloc[:, 0].tolist() if hasattr(model_input, "iloc") else model_input
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or {}
        max_new_tokens = int(params.get("max_new_tokens", 200))
        seed = int(params.get("seed", 0))
        with torch.no_grad():
            return [self.generator.generate(str(p), max_new_tokens, seed) for p in prompts]
