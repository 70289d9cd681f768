"""A user's trained model as a registered version: its weights as safetensors, the model config
its script recorded, and the dataset's tokenizer. No code of Forgeline's serves it: the script's
own model class is what reads these weights."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from safetensors.torch import save_file

from infra.requirements import declared
from trainer.checkpoint import load_model_state
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.serving import (
    WEIGHTS_FILE,
    ServedCode,
    pip_requirements,
    signature,
    write_artifacts,
)

USER_ENTRY = Path(__file__).with_name("user_serving_entry.py")


def export_weights(
    checkpoint_folder: Path, manifest: CheckpointManifest, tokenizer_file: Path, dest: Path
) -> dict[str, str]:
    """The artifacts of a weights-only version, by name; the file names match the built-in
    GPT's, so a version of either kind holds its weights at the same place."""
    dest.mkdir(parents=True, exist_ok=True)
    # DCP loads every tensor into memory of its own: nothing is shared, save_file is enough.
    state = {k: v.contiguous() for k, v in load_model_state(checkpoint_folder).items()}
    save_file(state, str(dest / WEIGHTS_FILE))
    return write_artifacts(dest, manifest.network, tokenizer_file)


def user_served_code(code_folder: Path, serving: dict) -> ServedCode:
    """How a user's version is built: Forgeline's small entry (trainer/user_serving_entry.py),
    the user's whole code snapshot at the top of its code/ folder (so `import serve` finds the
    user's module as it did at home), the serving pins plus the user's requirements.txt."""
    wanted = [line for _number, line in declared(code_folder)]
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
