"""The models-from-code entry of a version trained by a user's script that serves itself.

MLflow runs this file when it loads the version, after putting the version's code/ folder (the
user's code snapshot, top-level files and folders as they were) first on sys.path. The user's
serving module, named by the script through the SDK (`run.serve_with("serve")`) and recorded in
the version's model config, defines:

    load(weights: dict[str, torch.Tensor], config: dict, tokenizer: tokenizers.Tokenizer) -> model
    predict(model, prompts: list[str], params: dict) -> list[str]

This file imports nothing of Forgeline's: the version loads where only its declared
requirements are installed. Nothing is unpickled; the weights are safetensors.
"""

import importlib
import json
from pathlib import Path

import mlflow.pyfunc
import torch
from mlflow.models import set_model
from safetensors.torch import load_file
from tokenizers import Tokenizer


class UserServedModel(mlflow.pyfunc.PythonModel):
    """pyfunc: prompts in, the user's predict() out."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        module = importlib.import_module(context.model_config["serving_module"])
        artifacts = context.artifacts
        config = json.loads(Path(artifacts["config"]).read_text())
        tokenizer = Tokenizer.from_file(artifacts["tokenizer"])
        self.predictor = module.predict
        self.model = module.load(load_file(artifacts["weights"]), config, tokenizer)

    # No type hints on model_input and the result: MLflow would derive a signature from them
    # and drop the request parameters the registered signature declares.
    def predict(self, context, model_input, params: dict | None = None):
        prompts = model_input.iloc[:, 0].tolist() if hasattr(model_input, "iloc") else model_input
        if isinstance(prompts, str):
            prompts = [prompts]
        with torch.no_grad():
            return list(self.predictor(self.model, [str(p) for p in prompts], dict(params or {})))


set_model(UserServedModel())
