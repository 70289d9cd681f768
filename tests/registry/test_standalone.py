"""A registered version stands alone: its code travels with it, nothing in it is a pickle, and it
loads and generates in a fresh virtual environment built from its declared requirements only.

The version is registered into a real tracking store (SQLite) the way activities/control.py's
register_model does it (tests/registry/test_tracking.py's `registration`: trainer.serving's
served_code, then registry.tracking.register).
"""

from __future__ import annotations

import ast
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from safetensors import safe_open

from dataprep.tokenizer import char_tokenizer
from registry.names import EXPERIMENT
from registry.tracking import register
from tests.fresh_env import PIP_TIMEOUT_S, forgeline_found, fresh_python, load_and_predict
from tests.registry.test_tracking import registration
from trainer.model import GPT, GPTConfig
from trainer.serving import (
    ENTRY,
    SHIPPED_MODULES,
    WEIGHTS_FILE,
    GPTTextModel,
    export_model,
    pip_requirements,
    signature,
)

REPO = Path(__file__).resolve().parents[2]
PROMPT = "ROMEO:"
PARAMS = {"max_new_tokens": 24, "seed": 11}


@dataclass(frozen=True)
class Version:
    uri: str  # models:/NAME/VERSION
    folder: Path  # the version's model folder, downloaded from the store
    text: str  # what it continues PROMPT with, loaded in this (Forgeline's) environment


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny GPT with RoPE and SwiGLU, so the shipped code takes its least plain paths."""
    root = tmp_path_factory.mktemp("standalone-export")
    tokenizer = char_tokenizer(["ROMEO: But, soft! what light through yonder window breaks?"])
    tokenizer.save(str(root / "tokenizer.json"))
    torch.manual_seed(3)
    config = GPTConfig(
        vocab_size=tokenizer.get_vocab_size(),
        n_layer=2,
        n_head=2,
        n_embd=32,
        block_size=32,
        rope=True,
        swiglu=True,
    )
    return export_model(GPT(config), root / "tokenizer.json", root / "model")


@pytest.fixture(scope="module")
def version(tmp_path_factory: pytest.TempPathFactory, artifacts: dict[str, str]) -> Version:
    root = tmp_path_factory.mktemp("standalone-registry")
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    # Created first so the run's artifacts land under tmp, not in ./mlruns of the working folder.
    MlflowClient(tracking_uri).create_experiment(EXPERIMENT, str(root / "artifacts"))
    registered = register(tracking_uri, registration(artifacts, "standalone-run"))
    uri = f"models:/{registered.model_name}/{registered.version}"
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_registry_uri(tracking_uri)
    folder = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(root / "download")))
    (text,) = mlflow.pyfunc.load_model(uri).predict([PROMPT], params=PARAMS)
    return Version(uri, folder, text)


def _in(file: str, version: Version) -> bool:
    return Path(file).is_relative_to(version.folder)


def _shipped_files(folder: Path) -> list[Path]:
    return sorted(p for p in (folder / "code").rglob("*.py"))


def test_a_version_holds_its_code_and_no_pickle(version: Version) -> None:
    files = sorted(str(p.relative_to(version.folder)) for p in version.folder.rglob("*"))
    pyfunc = yaml.safe_load((version.folder / "MLmodel").read_text())["flavors"]["python_function"]
    assert pyfunc["loader_module"] == "mlflow.pyfunc.loaders.code_model"  # models from code
    assert "python_model" not in pyfunc  # no python_model.pkl to unpickle
    weights = version.folder / "artifacts" / WEIGHTS_FILE
    with safe_open(str(weights), framework="pt") as tensors:  # safetensors, or this raises
        assert {"wte.weight", "lm_head.weight"} & set(tensors.keys())  # tied: stored once
    for path in (p for p in version.folder.rglob("*") if p.is_file() and p != weights):
        # Pickles of protocol 2 and up start with 0x80 and the protocol number.
        assert path.suffix not in (".pkl", ".pickle") and path.read_bytes()[:1] != b"\x80", path
    assert {"artifacts/model_config.json", "artifacts/tokenizer.json"} <= set(files)
    assert {ENTRY.name, "requirements.txt"} <= set(files)
    # The code is the repository's own files, byte for byte, at their package paths.
    shipped = {str(p.relative_to(version.folder / "code")) for p in _shipped_files(version.folder)}
    expected = {f"{m.replace('.', '/')}.py" for m in SHIPPED_MODULES}
    expected |= {f"{m.split('.')[0]}/__init__.py" for m in SHIPPED_MODULES}
    assert shipped == expected
    for name in shipped:
        assert (version.folder / "code" / name).read_bytes() == (REPO / name).read_bytes(), name
    assert (version.folder / ENTRY.name).read_bytes() == ENTRY.read_bytes()


def test_declared_requirements_are_what_the_code_needs_pinned_here(version: Version) -> None:
    declared = Path(mlflow.pyfunc.get_model_dependencies(version.uri)).read_text().split()
    names = [line.split("==")[0] for line in declared]
    assert names == ["torch", "safetensors", "tokenizers", "mlflow-skinny", "numpy", "pandas"]
    for line in declared:
        name, pinned = line.split("==")
        assert pinned == metadata.version(name).split("+")[0], line  # torch 2.13.0+cpu: 2.13.0
    # Every module the shipped files import is the standard library's, shipped, or a declared
    # distribution's (mlflow-skinny provides `mlflow`).
    providers = metadata.packages_distributions()
    shipped = {m.split(".")[0] for m in SHIPPED_MODULES}
    code = version.folder / "code"
    for path in [*_shipped_files(version.folder), version.folder / ENTRY.name]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                assert node.level == 0, f"{path}: relative import"
                imported = [node.module or ""]
            else:
                continue
            for module in imported:
                top = module.split(".")[0]
                if top in shipped:
                    module_path = code / module.replace(".", "/")
                    assert module_path.with_suffix(".py").is_file() or module_path.is_dir(), (
                        f"{path.name} imports {module}, which the version does not ship"
                    )
                elif top not in sys.stdlib_module_names:
                    owners = {d.lower().replace("_", "-") for d in providers.get(top, [])}
                    assert owners & set(names), f"{path.name} imports {module}: not declared"


def test_shipped_code_loads_with_nothing_from_the_repository(
    version: Version, tmp_path: Path
) -> None:
    # Isolated mode (-I: no PYTHONPATH, no user site, no working folder on sys.path), in this
    # environment, where Forgeline itself is installed too: what the loaded version runs must
    # come from its own folder, never from the repository's files.
    answer = load_and_predict([sys.executable, "-I"], version.folder, tmp_path, PROMPT, PARAMS)
    installed = Path(sys.prefix)  # the venv may sit inside the repository (.venv)
    repository = [f for f in answer["files"] if Path(f).is_relative_to(REPO)]
    assert [f for f in repository if not Path(f).is_relative_to(installed)] == []
    loaded = {str(Path(f).relative_to(version.folder)) for f in answer["files"] if _in(f, version)}
    assert {"code/trainer/model.py", "code/infra/capacity.py", ENTRY.name} <= loaded
    assert answer["text"] == version.text


def test_a_version_pickled_before_models_from_code_still_loads_here(
    version: Version, artifacts: dict[str, str], tmp_path: Path
) -> None:
    # Versions registered before trainer/serving_entry.py hold GPTTextModel cloudpickled.
    old = tmp_path / "old-version"
    mlflow.pyfunc.save_model(
        str(old),
        python_model=GPTTextModel(),
        artifacts=artifacts,
        signature=signature(),
        pip_requirements=pip_requirements(),  # none to infer: that would start a process
    )
    assert (old / "python_model.pkl").is_file()
    (text,) = mlflow.pyfunc.load_model(str(old)).predict([PROMPT], params=PARAMS)
    assert text == version.text


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, version: Version) -> Path:
    requirements = mlflow.pyfunc.get_model_dependencies(version.uri)
    return fresh_python(requirements, tmp_path_factory.mktemp("fresh"))


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + 300)
def test_a_version_loads_and_generates_in_a_fresh_environment(
    version: Version, fresh: Path, tmp_path: Path
) -> None:
    assert forgeline_found(fresh, tmp_path) == []  # nothing of Forgeline's is installed there
    started = time.monotonic()
    answer = load_and_predict([str(fresh)], version.folder, tmp_path, PROMPT, PARAMS)
    print(f"loaded and generated in {time.monotonic() - started:.1f} s")
    assert answer["text"] == version.text
    assert answer["text"].startswith(PROMPT) and len(answer["text"]) > len(PROMPT)
    served = [f for f in answer["files"] if "trainer" in Path(f).parts]
    assert served and all(Path(f).is_relative_to(version.folder) for f in served), served
