"""A fresh virtual environment with a registered version's declared requirements and nothing
else: the honest test of a model that stands alone (tests/registry/test_standalone.py for the
built-in GPT, tests/e2e/test_user_code.py for a user's script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PIP_TIMEOUT_S = 900  # torch from the wheel on disk, the rest from the package index
FORGELINE_PACKAGES = ("dataprep", "registry", "worker", "activities", "workflows", "forgeline",
                      "trainer", "infra")  # fmt: skip

# Run by a Python that is not this one: load the model folder (argv[1]), continue the prompt
# (argv[2]) with the params (argv[3]), and say which files every loaded module came from, so
# the caller can tell where the code was found.
LOAD_AND_PREDICT = """
import json, sys
import mlflow.pyfunc
model = mlflow.pyfunc.load_model(sys.argv[1])
(text,) = model.predict([sys.argv[2]], params=json.loads(sys.argv[3]))
files = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
print(json.dumps({"text": text, "files": sorted(f for f in files if f)}))
"""


def without_pythonpath() -> dict[str, str]:
    hidden = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k not in hidden}


def fresh_python(requirements: str, root: Path) -> Path:
    """A new venv under `root` with torch (this one's version, the CPU wheel on disk) and the
    requirements file; its python."""
    venv = root / "venv"
    env = without_pythonpath()
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    # torch first, alone: pinned to the CPU wheel on disk, so no resolver ever picks a CUDA build.
    torch_pin = f"torch=={metadata.version('torch').split('+')[0]}"
    for args in ([torch_pin], ["-r", requirements]):
        subprocess.run([*pip, *args], check=True, env=env, timeout=PIP_TIMEOUT_S)
    print(f"fresh venv built in {time.monotonic() - started:.0f} s")
    return venv / "bin" / "python"


def forgeline_found(python: Path, cwd: Path) -> list[str]:
    """The packages of Forgeline's that `python` can import (none, in a fresh venv)."""
    check = (
        "import importlib.util as u, json; "
        f"print(json.dumps([n for n in {FORGELINE_PACKAGES!r} if u.find_spec(n)]))"
    )
    found = subprocess.run(
        [str(python), "-c", check], cwd=cwd, env=without_pythonpath(), capture_output=True
    )
    assert found.returncode == 0, found.stderr[-2000:]
    return json.loads(found.stdout)


def load_and_predict(python: list[str], folder: Path, cwd: Path, prompt: str, params: dict) -> dict:
    """{"text": the continuation, "files": every module file loaded} from another Python."""
    done = subprocess.run(
        [*python, "-c", LOAD_AND_PREDICT, str(folder), prompt, json.dumps(params)],
        cwd=cwd,
        env=without_pythonpath(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
