"""A code folder's own `trainer.py`, `registry.py`, `workflows.py`, `infra/`, `worker.py`,
`model.py`, `data/` and `utils.py` are the script's own in its ranks, though Forgeline's rank
entry and SDK live in packages of those names (trainer.user_module_names)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.test_import_rules import PROJECT
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import resume_point
from tests.trainer.test_user_code import GRU, user_job, user_train
from trainer.manifest import find_latest

# Every name the issue lists, as a module, a package, or a folder without __init__.py.
OWN_MODULES = {
    "trainer.py": "OWNER = 'user'\n",
    "registry.py": "OWNER = 'user'\n",
    "workflows.py": "OWNER = 'user'\n",
    "worker.py": "OWNER = 'user'\n",
    "utils.py": "OWNER = 'user'\n",
    "infra/__init__.py": "",
    "infra/settings.py": "OWNER = 'user'\n",
    "data/loader.py": "OWNER = 'user'\n",  # a namespace package, as many folders are
}
CHECKS = """
import data.loader
import infra.settings
import registry
import trainer
import utils
import worker
import workflows

import model
import forgeline

for own in (data.loader, infra.settings, registry, trainer, utils, worker, workflows):
    assert getattr(own, "OWNER", None) == "user", f"{own.__name__} is {own.__file__}"
assert model.__file__.startswith(__file__.rsplit("/", 1)[0]), model.__file__
assert callable(forgeline.sharded_draws)
"""


def code_with_every_name(tmp_path: Path) -> Path:
    """The GRU example (its own model.py already) with the modules above beside it."""
    code = tmp_path / "own-names"
    shutil.copytree(GRU, code, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in OWN_MODULES.items():
        (code / name).parent.mkdir(exist_ok=True)
        (code / name).write_text(text)
    (code / "own_checks.py").write_text(CHECKS)
    script = code / "train.py"
    script.write_text(
        script.read_text().replace("import forgeline\n", "import forgeline\nimport own_checks\n", 1)
    )
    return code


def test_a_script_imports_its_own_modules_under_forgeline_s_names(
    trainer: Trainer, tmp_path: Path
) -> None:
    """It trains, commits, and resumes from its commit (the SDK's restore and saves run with
    the names given to the script), importing its own modules on every rank."""
    code = code_with_every_name(tmp_path)
    first = user_train(code, steps=10, checkpoint_every=10, eval_every=10)
    trainer.run(user_job(trainer, "own-names", code, first), ranks=2)
    committed = find_latest(trainer.store, "own-names", max_generation=1)
    assert committed is not None and committed.step == 10

    resume = resume_point(trainer, committed.manifest, "own-names", committed.key)
    more = user_train(code, steps=20, checkpoint_every=10, eval_every=10)
    trainer.run(user_job(trainer, "own-names", code, more, resume=resume, generation=2), ranks=2)
    final = find_latest(trainer.store, "own-names", max_generation=2)
    assert final is not None and final.step == 20 and final.manifest.evaluation["step"] == 20


# The modules a rank has loaded when the user's script starts: a warm standby's imports, then
# what trainer.user_module_names imports before it hands the names over.
_LOADED = """
import importlib, json, sys, tempfile
from pathlib import Path
from trainer import warm_launch
from trainer.user_module_names import make_way_for
for module in warm_launch.RANK_IMPORTS:
    importlib.import_module(module)
code = Path(tempfile.mkdtemp())
(code / "trainer.py").write_text("")
make_way_for(code, "file:///nowhere")
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items()
                        if n.split(".")[0] in sys.argv[1:] and getattr(m, "__file__", None))))
"""
# The one import of a project module inside a function that a rank may run: the S3 store's
# class, which make_way_for imports first (infra.store.factory.preload).
ALLOWED = {("infra/store/factory.py", "infra.store.s3")}


def imports_inside_functions(path: Path) -> set[str]:
    """The project modules a module imports inside a function (when the function runs)."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                found.add("." * node.level + (node.module or ""))
    return {name for name in found if name.startswith(".") or name.split(".")[0] in PROJECT}


def test_no_module_a_rank_loads_imports_the_project_inside_a_function() -> None:
    """Such an import, run after the script took the name, would find the script's module."""
    loaded = subprocess.run(
        [sys.executable, "-c", _LOADED, *sorted(PROJECT)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    files = [Path(f) for f in json.loads(loaded.stdout)]
    assert any(f.name == "training.py" for f in files)  # the SDK is among them
    late = {(str(f.relative_to(REPO)), name) for f in files for name in imports_inside_functions(f)}
    assert late <= ALLOWED, f"imported inside a function by a module a rank loads: {late - ALLOWED}"
