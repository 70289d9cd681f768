"""A user's trained model as a registered version: its weights as safetensors, the model config
its script recorded, and the dataset's tokenizer. No code of Forgeline's serves it: the script's
own model class is what reads these weights."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from trainer.checkpoint import load_model_state
from trainer.serving import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE


def export_weights(
    checkpoint_folder: Path, manifest: dict, tokenizer_file: Path, dest: Path
) -> dict[str, str]:
    """The artifacts of a weights-only version, by name; the file names match the built-in
    GPT's, so a version of either kind holds its weights at the same place."""
    dest.mkdir(parents=True, exist_ok=True)
    # DCP loads every tensor into memory of its own: nothing is shared, save_file is enough.
    state = {k: v.contiguous() for k, v in load_model_state(checkpoint_folder).items()}
    save_file(state, str(dest / WEIGHTS_FILE))
    (dest / CONFIG_FILE).write_text(json.dumps(manifest.get("model_config", {}), indent=2))
    (dest / TOKENIZER_FILE).write_bytes(tokenizer_file.read_bytes())
    return {
        "weights": str(dest / WEIGHTS_FILE),
        "config": str(dest / CONFIG_FILE),
        "tokenizer": str(dest / TOKENIZER_FILE),
    }
