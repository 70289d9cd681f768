"""The trained model as something that answers prompts, and the registered version that carries it.

A version loads without Forgeline: its weights are safetensors (no pickle), its model config and
tokenizer are JSON, and its code is this file and the modules it needs (SHIPPED_MODULES), copied
into the version at their package paths and run by an MLflow models-from-code entry
(trainer/serving_entry.py) instead of a cloudpickled object. Its requirements name only what that
code imports. `mlflow models serve` and `forgeline generate` load it the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlflow.pyfunc
import torch
from mlflow.models import ModelSignature, infer_signature
from safetensors.torch import load_model, save_model
from tokenizers import Tokenizer

from trainer.model import GPT, GPTConfig
from trainer.sampling import default_device, sample_text

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer.json"

# The code a version ships: the GPT with everything it imports from the project (mlp_hidden lives
# in infra/capacity.py, stdlib only), and what serves it. Each file keeps its package path
# (code/trainer/model.py, code/infra/capacity.py), the layout MLflow's own `infer_code_paths`
# makes: MLflow puts code/ first on sys.path when it loads the version, so `from trainer.model
# import GPT` means the same in the repository and in the version, and the files travel as they
# are, with no second copy of the model to keep in step. tests/registry/test_standalone.py checks
# that these modules import nothing else from the project.
SHIPPED_MODULES = ("trainer.model", "trainer.sampling", "trainer.serving", "infra.capacity")
ENTRY = Path(__file__).with_name("serving_entry.py")

# What the shipped code imports, each pinned to the release installed here. mlflow-skinny rather
# than mlflow: pyfunc and its scoring server without the tracking server's dependencies; skinny
# does not declare numpy and pandas, which mlflow.pyfunc imports, so they are named here.
SERVING_DISTRIBUTIONS = ("torch", "safetensors", "tokenizers", "mlflow-skinny", "numpy", "pandas")


def export_model(model: GPT, tokenizer_file: Path, dest: Path) -> dict[str, str]:
    """Write the three artifacts; returns them by name for `mlflow.pyfunc.log_model`."""
    dest.mkdir(parents=True, exist_ok=True)
    # save_model (not save_file) handles the tied embedding: shared tensors are stored once.
    save_model(model, str(dest / WEIGHTS_FILE))
    return write_artifacts(dest, model.config.to_dict(), tokenizer_file)


def write_artifacts(dest: Path, config: dict, tokenizer_file: Path) -> dict[str, str]:
    """Beside the weights already in `dest`: the model config and the tokenizer. Returns the
    three by name, as `mlflow.pyfunc.log_model` takes them (and as a version of any kind holds
    them)."""
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (dest / TOKENIZER_FILE).write_bytes(tokenizer_file.read_bytes())
    return {
        "weights": str(dest / WEIGHTS_FILE),
        "config": str(dest / CONFIG_FILE),
        "tokenizer": str(dest / TOKENIZER_FILE),
    }


def pip_requirements() -> list[str]:
    """`name==version` for each of SERVING_DISTRIBUTIONS as installed here."""
    # The public version only: the CPU wheel's `2.13.0+cpu` is no release on the package index,
    # and `torch==2.13.0` is met by it (a pin without a local label ignores the label).
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in SERVING_DISTRIBUTIONS]


@dataclass(frozen=True)
class ServedCode:
    """How a version is built and what it needs, for `mlflow.pyfunc.log_model`."""

    entry: str  # the models-from-code file
    modules: tuple[str, ...]
    pip_requirements: list[str]
    signature: ModelSignature
    files: tuple[str, ...] = ()  # shipped as they are (a user's code: its top-level entries)
    config: dict | None = None  # the entry's model_config (a user's serving module)


def served_code() -> ServedCode:
    return ServedCode(str(ENTRY), SHIPPED_MODULES, pip_requirements(), signature())


class TextGenerator:
    """A version's model on `device` (default: the GPU when this process sees one, else the
    CPU), answering prompts."""

    def __init__(
        self, weights: Path, config: Path, tokenizer: Path, device: torch.device | None = None
    ) -> None:
        self.model = GPT(GPTConfig(**json.loads(config.read_text())))
        load_model(self.model, str(weights))
        # Moved after loading: .to() keeps the tied embedding one tensor on the device.
        self.model.to(device or default_device()).eval()
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
    """pyfunc: a list of prompts in, a list of continuations (prompt included) out.

    Versions registered before the models-from-code entry hold this class cloudpickled by
    reference (trainer.serving.GPTTextModel): keep its name, module and state (none until
    load_context) so they still load where Forgeline is installed.
    """

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
