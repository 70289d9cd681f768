"""Your own training code, end to end through the CLI: a script Forgeline has never seen trains
on the real stack, survives a SIGKILLed node agent with the weights of a fault-free run, and is
registered with its code snapshot as lineage (and its version predicts in a fresh virtual
environment); a script that cannot start, or never reports, fails the run at once, with its
line, spending no restart and draining no node."""

from __future__ import annotations

import random
import re
import shutil
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from tests.e2e.conftest import Stack, final_checkpoint
from tests.e2e.faults import kill_a_node_of
from tests.fresh_env import PIP_TIMEOUT_S, forgeline_found, fresh_python, load_and_predict
from trainer.checkpoint import load_model_state
from trainer.manifest import find_latest

pytestmark = pytest.mark.e2e

BYO = REPO / "examples" / "byo"


def byo_spec(tmp_path: Path, name: str, code: Path, example: str = "gru.toml", **keys: int) -> Path:
    """examples/byo/<example> under another name, its code and data at absolute paths, and
    each of `keys` (a key of any table) set to its value."""
    text = (BYO / example).read_text()
    text = re.sub(r'^name = ".*"$', f'name = "{name}"', text, count=1, flags=re.M)
    text = text.replace('"../data/tinyshakespeare.txt"',
                        f'"{REPO / "examples" / "data" / "tinyshakespeare.txt"}"')  # fmt: skip
    text = re.sub(r'^code = "[^"]*"', f'code = "{code}"', text, count=1, flags=re.M)
    for key, value in keys.items():
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert found == 1, f"{example} has {found} lines setting {key}"
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def weights_of(stack: Stack, run: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The model weights of the run's last committed checkpoint, without the script's class."""
    folder, _manifest = final_checkpoint(stack, run, scratch)
    return load_model_state(folder)


def registered_with_its_code(stack: Stack, model: str, metric: str, servable: bool) -> None:
    """The candidate version holds weights, with the code as lineage and the script's own
    held-out evaluation; the script's own `metric` reached MLflow."""
    client = MlflowClient(tracking_uri=stack.settings.mlflow_uri)
    version = client.get_model_version_by_alias(model, "candidate")
    tags = version.tags
    assert tags["forgeline.entrypoint"] == "train.py"
    assert re.fullmatch(r"[0-9a-f]{32}", tags["forgeline.code_snapshot"])
    assert tags["forgeline.eval_measured_on"] == "held-out"
    assert tags["forgeline.eval_source"] == "script"  # self-reported: the gate says so
    assert tags["forgeline.servable"] == str(servable).lower()
    assert client.get_metric_history(version.run_id, f"train/{metric}")
    if servable:  # a pyfunc model: the user's code and the weights among its artifacts
        # Over REST the version's model_id is not filled in; its source is models:/<model id>.
        model_id = version.model_id or version.source.removeprefix("models:/")
        files = {f.path for f in client.list_logged_model_artifacts(model_id, "code")}
        assert {"code/serve.py", "code/model.py"} <= files, files
        files = {f.path for f in client.list_logged_model_artifacts(model_id, "artifacts")}
        assert "artifacts/model.safetensors" in files, files
    else:  # weights and lineage: files of the run
        files = {f.path for f in client.list_artifacts(version.run_id, "model")}
        assert "model/model.safetensors" in files, files


# With the slow tests (make test's 15 minutes): its parts run in the default suite, on real
# ranks and the real stack: tests/trainer/test_user_code.py (a user script's errors; the user
# scripts' exact resumes are slow tests too), test_cli_end_to_end.py and test_api.py (a run
# through to a registered version) and tests/e2e/test_failures.py's SIGKILLs (a dead node's gang
# recovers from the last committed manifest).
@pytest.mark.slow
def test_your_own_script_recovers_from_a_dead_node_and_is_registered(
    stack: Stack, tmp_path: Path
) -> None:
    reference = byo_spec(tmp_path, "byo-ref", BYO / "gru")
    stack.cli("run", str(reference), "--detach")
    faulted = byo_spec(tmp_path, "byo-gru", BYO / "gru", heartbeat_timeout_s=5)
    submitted = stack.cli("run", str(faulted), "--detach").stdout
    assert "submitted run byo-gru" in submitted
    kill_a_node_of(stack, "byo-gru", 0, random.Random(14))
    stack.cli("up", "--nodes", "3")  # the node comes back

    for spec in (faulted, reference):
        followed = stack.cli("run", str(spec), timeout=300).stdout
        assert "AWAITING_APPROVAL" in followed, followed
    status = stack.cli("status", "byo-gru").stdout
    assert re.search(r"attempts +1 restart", status), status

    store = stack.store()
    final = find_latest(store, "byo-gru", max_generation=10**9)
    expected = find_latest(store, "byo-ref", max_generation=10**9)
    assert final is not None and expected is not None and final.generation >= 2
    assert final.manifest.loss_history == expected.manifest.loss_history
    ours, theirs = weights_of(stack, "byo-gru", tmp_path), weights_of(stack, "byo-ref", tmp_path)
    assert ours.keys() == theirs.keys() and "rnn.weight_ih_l0" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)

    registered_with_its_code(stack, "byo-gru", "perplexity", servable=True)
    traced = stack.cli("lineage", "byo-gru", "@candidate").stdout
    code_line = r"^user code +snapshot [0-9a-f]{32}: \d+ files, entrypoint train\.py  \[verified\]"
    assert re.search(code_line, traced, re.M), traced
    # The script said how its model is served (serve.py): the version answers prompts, through
    # the user's own load() and predict(), shipped in the version with the code snapshot.
    text = stack.cli("generate", "byo-gru@candidate", "ROMEO:", "--max-new-tokens", "40").stdout
    assert text.strip().startswith("ROMEO:") and len(text.strip()) > len("ROMEO:") + 20, text


# With the slow tests, to keep `make test` within 15 minutes: a run through the CLI to a
# registered version runs in it with the built-in GPT (test_cli_end_to_end.py) and through the
# API (test_api.py); a user's script at rank level in tests/trainer/test_user_code.py.
@pytest.mark.slow
def test_the_fsdp_convnet_example_trains_to_approval_and_is_registered(
    stack: Stack, tmp_path: Path
) -> None:
    """examples/byo/convnet shards its model with FSDP2 over both nodes' ranks: the
    checkpoints record that layout, and their weights read back whole from the shards."""
    spec = byo_spec(tmp_path, "byo-convnet", BYO / "convnet", "convnet.toml", steps=12,
                    checkpoint_every=6, eval_every=6, eval_batches=2, block=32, width=32,
                    layers=2)  # fmt: skip
    followed = stack.cli("run", str(spec), timeout=300).stdout
    assert "AWAITING_APPROVAL" in followed, followed

    folder, manifest = final_checkpoint(stack, "byo-convnet", tmp_path)
    assert manifest.step == 12 and manifest.world_size == 2
    assert manifest.layout == {"replicate": 1, "shard": 2, "tensor": 1, "strategy": "fsdp",
                                  "world_size": 2}  # fmt: skip
    assert manifest.evaluation["step"] == 12
    weights = load_model_state(folder)
    assert weights["blocks.1.conv.weight"].shape == (32, 1, 4)  # whole, not a rank's half

    registered_with_its_code(stack, "byo-convnet", "grad_norm", servable=False)
    # It never said how to serve it: serve and generate say so, in one line.
    refused = stack.cli("serve", "byo-convnet@candidate", check=False)
    assert refused.returncode != 0 and "holds weights and lineage only" in refused.stdout


# A script's mistakes as edits of the GRU example: (name, what is replaced, by what, the line
# the user is shown, what the run's failure says before that line).
_LOOP = "    import time\n\n    while True:  # a loop of its own: no step reaches the platform\n"
MISTAKES = [
    ("typo", "optimizer = torch.optim.AdamW(model", "optimizer = torch.optim.AdamW(modle",
     "(modle", r"NameError: name 'modle' is not defined \(train\.py, line {line}\)"),
    ("quiet", "    for step in run.steps():\n",
     _LOOP + "        time.sleep(0.1)\n\n    for step in run.steps():\n", "time.sleep(0.1)",
     r"ran \d+ s after run\.restore\(\) without entering run\.steps\(\) "
     r"\(recovery\.start_limit_s = 8\), at train\.py, line {line}"),
]  # fmt: skip


# The messages are asserted on real ranks in tests/trainer/test_user_code.py; this repeats them
# through the CLI (no restart spent, no node blamed), out of `make test`'s 15 minutes.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "old", "new", "marks", "said"), MISTAKES, ids=[m[0] for m in MISTAKES]
)
def test_a_script_that_cannot_start_fails_the_run_at_once(
    stack: Stack, tmp_path: Path, name: str, old: str, new: str, marks: str, said: str
) -> None:
    """It raises before its first step, or loops in its own code and never reports one."""
    code = tmp_path / name
    shutil.copytree(BYO / "gru", code)
    text = (code / "train.py").read_text()
    assert old in text
    (code / "train.py").write_text(text.replace(old, new))
    line = next(
        n for n, text in enumerate((code / "train.py").read_text().splitlines(), 1) if marks in text
    )
    run = f"byo-{name}"
    spec = byo_spec(tmp_path, run, code)
    # The [recovery] table is last. A typo fails at once; a quiet script is cut off at the limit,
    # which the typo's run must not reach first on a busy machine.
    limit = 8 if name == "quiet" else 60
    spec.write_text(spec.read_text() + f"start_limit_s = {limit}\n")
    failed = stack.cli("run", str(spec), check=False, timeout=300)
    assert failed.returncode == 1, failed.stdout
    assert re.search(said.format(line=line), failed.stdout), failed.stdout
    status = stack.cli("status", run).stdout
    assert re.search(r"phase +FAILED", status) and re.search(r"attempts +0 restart", status)
    # No node took the blame: no failure recorded against one, none reported to the cluster.
    assert not re.search(r"^failure ", status, re.M), status
    nodes = stack.cli("nodes").stdout
    assert run not in nodes and "NameError" not in nodes, nodes


def test_a_missing_requirement_is_one_line_before_any_rank_starts(
    stack: Stack, tmp_path: Path
) -> None:
    code = tmp_path / "needs"
    shutil.copytree(BYO / "gru", code)
    (code / "requirements.txt").write_text("torch>=2.6\nsurely-not-a-package-forgeline>=1\n")
    failed = stack.cli("run", str(byo_spec(tmp_path, "byo-needs", code)), check=False, timeout=300)
    assert failed.returncode == 1, failed.stdout
    # The node agent's uv said it, once (infra.user_envs), before any rank started.
    assert re.search(r"surely-not-a-package-forgeline\s+was\s+not\s+found", failed.stdout), (
        failed.stdout
    )
    assert not list((stack.home / "nodes").glob("*/runs/byo-needs/gen-*/torchrun.log"))


@pytest.mark.slow
@pytest.mark.timeout(PIP_TIMEOUT_S * 2 + 600)
def test_a_script_s_registered_version_predicts_in_a_fresh_environment(
    stack: Stack, tmp_path: Path
) -> None:
    """The version a run of the GRU example registered, loaded where only its declared
    requirements are installed: the user's serve.py and model.py travel with it."""
    spec = byo_spec(tmp_path, "byo-alone", BYO / "gru", steps=20, checkpoint_every=10,
                    eval_every=10)  # fmt: skip
    followed = stack.cli("run", str(spec), timeout=300).stdout
    assert "AWAITING_APPROVAL" in followed, followed
    uri = stack.settings.mlflow_uri
    version = MlflowClient(tracking_uri=uri).get_model_version_by_alias("byo-alone", "candidate")
    model_uri = f"models:/byo-alone/{version.version}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    folder = Path(mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "dl")))
    params = {"max_new_tokens": 30, "seed": 4}
    # Here, in another process: the user's `model` and `serve` modules stay out of this one.
    here = load_and_predict([sys.executable, "-I"], folder, tmp_path, "ROMEO:", params)["text"]

    python = fresh_python(mlflow.pyfunc.get_model_dependencies(model_uri), tmp_path)
    assert forgeline_found(python, tmp_path) == []
    answer = load_and_predict([str(python)], folder, tmp_path, "ROMEO:", params)
    assert answer["text"] == here and len(here) > len("ROMEO:") + 20, answer["text"]
    shipped = {Path(f).name for f in answer["files"] if Path(f).is_relative_to(folder)}
    assert {"serve.py", "model.py"} <= shipped, shipped
