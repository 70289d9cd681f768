"""A user's trained model as a registered version: its weights as safetensors, the model config
its script recorded, and the dataset's tokenizer. No code of Forgeline's serves it: the script's
own model class is what reads these weights."""

from __future__ import annotations

import json
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from safetensors.torch import save_file

from infra.requirements import REQUIREMENTS_FILE
from trainer.checkpoint import load_model_state
from trainer.serving import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    ServedCode,
    pip_requirements,
    signature,
)

USER_ENTRY = Path(__file__).with_name("user_serving_entry.py")


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


def user_served_code(code_folder: Path, serving: dict) -> ServedCode:
    """How a user's version is built: Forgeline's small entry (trainer/user_serving_entry.py),
    the user's whole code snapshot at the top of its code/ folder (so `import serve` finds the
    user's module as it did at home), the serving pins plus the user's requirements.txt."""
    wanted = []
    requirements = code_folder / REQUIREMENTS_FILE
    if requirements.is_file():
        for raw in requirements.read_text(errors="replace").splitlines():
            line = raw.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                wanted.append(line)
    ours = pip_requirements()
    # Ours are pins of what is installed here, the user's are ranges it met: a pin wins.
    named = {canonicalize_name(Requirement(r).name) for r in ours}
    extra = [r for r in wanted if canonicalize_name(Requirement(r).name) not in named]
    return ServedCode(
        entry=str(USER_ENTRY),
        modules=(),
        pip_requirements=ours + extra,
        signature=signature(),
        files=tuple(sorted(str(p) for p in code_folder.iterdir() if p.name != "__pycache__")),
        config={"serving_module": serving["module"]},
    )
