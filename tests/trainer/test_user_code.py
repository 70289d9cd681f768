"""A user's own rank script through the SDK, in real torchrun ranks: it trains, resumes exactly
after a SIGKILL (a DDP script bitwise; an FSDP2 one bitwise on as many ranks, resharded onto
one), and a script that cannot start fails as the user's error, with its line."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from tests.conftest import REPO
from tests.trainer.conftest import Trainer
from tests.trainer.test_distributed_training import job_processes, resume_point
from trainer.checkpoint import fetch_checkpoint, load_model_weights
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.device_env import GrantedDevices
from trainer.errors import NodeFault, RanksFailed, UserCodeFailed
from trainer.job import ResumePoint, TrainJob
from trainer.manifest import find_latest
from workflows.contracts.spec import RecoverySpec, TrainSpec

GRU = REPO / "examples" / "byo" / "gru"
ARGS = {"block": 32, "width": 32, "layers": 1}
CONVNET = REPO / "examples" / "byo" / "convnet"
CONV_ARGS = {"block": 32, "width": 32, "layers": 2, "kernel": 4}
FSDP = {"replicate": 1, "shard": 2, "tensor": 1}  # what convnet.toml's `[parallel] shard = 2` gives


def user_train(
    code: Path, entrypoint: str = "train.py", args: dict = ARGS, **train: object
) -> TrainSpec:
    settings = {"steps": 40, "batch_size": 8, "learning_rate": 3e-3, "log_every": 5,
                "checkpoint_every": 10, "keep_checkpoints": 10, "eval_every": 20,
                "eval_batches": 4, "seed": 5, **train}  # fmt: skip
    return TrainSpec(code=str(code), entrypoint=entrypoint, args=args, **settings)


def user_job(trainer: Trainer, run_id: str, code: Path, train: TrainSpec, **fields) -> TrainJob:
    val = [str(trainer.store.root / s.key) for s in trainer.snapshot.manifest.splits["val"].shards]
    return trainer.job(run_id, train, code_dir=str(code), val_shards=val, **fields)


def script(code: Path) -> ModuleType:
    """The example's module that holds its model class (model.py, else train.py)."""
    source = code / "model.py" if (code / "model.py").exists() else code / "train.py"
    spec = importlib.util.spec_from_file_location(f"byo_{code.name}", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights_in(
    trainer: Trainer, model: nn.Module, manifest: CheckpointManifest, tag: str
) -> dict[str, torch.Tensor]:
    """The checkpoint's weights loaded into the script's own (plain, unsharded) class."""
    load_model_weights(model, fetch_checkpoint(trainer.store, manifest, trainer.root / tag))
    return model.state_dict()


def vocab(trainer: Trainer) -> int:
    return trainer.snapshot.manifest.tokenizer.vocab_size


def gru_weights(
    trainer: Trainer, manifest: CheckpointManifest, tag: str
) -> dict[str, torch.Tensor]:
    model = script(GRU).CharGRU(vocab(trainer), ARGS["width"], ARGS["layers"])
    return weights_in(trainer, model, manifest, tag)


def convnet_weights(
    trainer: Trainer, manifest: CheckpointManifest, tag: str
) -> dict[str, torch.Tensor]:
    args = CONV_ARGS
    model = script(CONVNET).ConvLM(vocab(trainer), args["width"], args["layers"], args["kernel"])
    return weights_in(trainer, model, manifest, tag)


def kill_after_first_commit(trainer: Trainer, job: TrainJob, ranks: int) -> ResumePoint:
    """Start the job, SIGKILL its torchrun and every rank once a checkpoint has committed,
    and return where the run resumes from (a step before the last)."""

    async def kill() -> None:
        task = await trainer.start_until_committed(job, ranks=ranks)
        for pid in job_processes(Path(job.progress_file).parent / "job.json", launcher=True):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(RanksFailed):
            await task

    asyncio.run(kill())
    found = find_latest(trainer.store, job.run_id, max_generation=job.generation)
    steps = TrainSpec.model_validate(job.train).steps
    assert found is not None and found.step < steps
    return resume_point(trainer, found.manifest, job.run_id, found.key)


# With the slow tests, to keep `make test` within 15 minutes: exact resume through the SDK runs
# in it with the built-in GPT (tests/trainer/test_distributed_training.py, every layout in
# test_layouts.py) and through the whole stack in tests/e2e/test_failures.py.
@pytest.mark.slow
def test_a_user_script_resumes_exactly_after_a_sigkill(trainer: Trainer) -> None:
    train = user_train(GRU)
    trainer.run(user_job(trainer, "gru-ref", GRU, train), ranks=2)
    reference = find_latest(trainer.store, "gru-ref", max_generation=1)
    assert reference is not None and reference.step == 40
    assert reference.manifest.evaluation["step"] == 40  # the script's own held-out loss
    assert reference.manifest.evaluation["val_loss"] < reference.manifest.loss_history[0][1]

    resume = kill_after_first_commit(trainer, user_job(trainer, "gru-killed", GRU, train), 2)
    trainer.run(user_job(trainer, "gru-killed", GRU, train, resume=resume, generation=2), ranks=2)
    final = find_latest(trainer.store, "gru-killed", max_generation=2)
    assert final is not None and final.step == 40
    assert final.manifest.loss_history == reference.manifest.loss_history
    ours, theirs = (
        gru_weights(trainer, final.manifest, "a"),
        gru_weights(trainer, reference.manifest, "b"),
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.fixture(scope="module")
def convnet_reference(trainer: Trainer) -> CheckpointManifest:
    """The FSDP2 example, fault-free on 2 ranks: its final manifest."""
    train = user_train(CONVNET, args=CONV_ARGS)
    trainer.run(user_job(trainer, "conv-ref", CONVNET, train, layout=FSDP), ranks=2)
    found = find_latest(trainer.store, "conv-ref", max_generation=1)
    assert found is not None and found.step == 40
    assert found.manifest.layout["strategy"] == "fsdp" and found.manifest.world_size == 2
    assert found.manifest.evaluation["step"] == 40
    return found.manifest


@pytest.fixture(scope="module")
def convnet_killed(trainer: Trainer) -> ResumePoint:
    """The same run on 2 ranks, SIGKILLed after its first commit: where it resumes from."""
    job = user_job(
        trainer, "conv-killed", CONVNET, user_train(CONVNET, args=CONV_ARGS), layout=FSDP
    )
    return kill_after_first_commit(trainer, job, 2)


# With the slow tests, as the one above.
@pytest.mark.slow
def test_an_fsdp_script_resumes_bitwise_on_as_many_ranks(
    trainer: Trainer, convnet_reference: CheckpointManifest, convnet_killed: ResumePoint
) -> None:
    train = user_train(CONVNET, args=CONV_ARGS)
    job = user_job(
        trainer, "conv-killed", CONVNET, train, resume=convnet_killed, generation=2, layout=FSDP
    )
    trainer.run(job, ranks=2)
    final = find_latest(trainer.store, "conv-killed", max_generation=2)
    assert final is not None and final.step == 40 and final.generation == 2
    assert final.manifest.loss_history == convnet_reference.loss_history
    assert final.manifest.evaluation == convnet_reference.evaluation
    ours = convnet_weights(trainer, final.manifest, "conv-a")
    theirs = convnet_weights(trainer, convnet_reference, "conv-b")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# With the slow tests, as the one above.
@pytest.mark.slow
def test_an_fsdp_script_resumes_resharded_onto_one_rank(
    trainer: Trainer, convnet_reference: CheckpointManifest, convnet_killed: ResumePoint
) -> None:
    """The 2-rank shards load into one rank (DCP reshards them) and train on to the end."""
    train = user_train(CONVNET, args=CONV_ARGS)
    job = user_job(trainer, "conv-one", CONVNET, train, resume=convnet_killed, generation=2)
    trainer.run(job, ranks=1)
    final = find_latest(trainer.store, "conv-one", max_generation=2)
    assert final is not None and final.step == 40
    assert final.manifest.world_size == 1
    ours, theirs = final.manifest.loss_history, convnet_reference.loss_history
    assert [s for s, _ in ours] == [s for s, _ in theirs]
    for (step, loss), (_, reference) in zip(ours, theirs, strict=True):
        # On one rank a gradient is one mean, not two reduce-scattered halves: only rounding
        # differs (2.4e-7 measured; test_layouts allows the GPT's layouts 1e-4).
        assert loss == pytest.approx(reference, abs=1e-5), step
    val_loss = convnet_reference.evaluation["val_loss"]
    assert final.manifest.evaluation["val_loss"] == pytest.approx(val_loss, abs=1e-5)


# With the slow tests, as the ones above.
@pytest.mark.slow
def test_a_script_s_blocks_recomputed_train_bitwise(
    trainer: Trainer, convnet_reference: CheckpointManifest
) -> None:
    """The spec's activation checkpointing on the blocks the script names: the same run, bit
    for bit, as the one that kept its activations."""
    layout = {**FSDP, "activation_checkpointing": "selective"}
    job = user_job(trainer, "conv-recomputed", CONVNET, user_train(CONVNET, args=CONV_ARGS),
                   layout=layout)  # fmt: skip
    trainer.run(job, ranks=2)
    final = find_latest(trainer.store, "conv-recomputed", max_generation=1)
    assert final is not None and final.step == 40
    assert final.manifest.loss_history == convnet_reference.loss_history
    ours = convnet_weights(trainer, final.manifest, "conv-recomputed")
    theirs = convnet_weights(trainer, convnet_reference, "conv-c")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(
    ("name", "layout", "said"),
    [
        (
            "recompute",
            {"replicate": 2, "shard": 1, "tensor": 1, "activation_checkpointing": "full"},
            r'the spec asks for parallel\.activation_checkpointing = "full", but the script '
            r"named no blocks to recompute: call run\.recompute_activations\(model\.blocks\)",
        ),
        (
            "pipeline",
            {"replicate": 1, "shard": 1, "tensor": 1, "pipeline": 2, "schedule": "1F1B",
             "stages_per_rank": 1, "microbatches": 2},
            r"the spec splits the model into a pipeline of 2 stages \(parallel\.pipeline\), "
            r"but the script declared none: build a module for each of run\.stages and hand "
            r"them to run\.pipeline\(\)",
        ),
    ],
    ids=["recompute-without-blocks", "pipeline-without-stages"],
)  # fmt: skip
def test_what_the_spec_asks_of_a_script_that_does_not_declare_it_is_refused(
    trainer: Trainer, name: str, layout: dict, said: str
) -> None:
    job = user_job(trainer, f"gru-{name}", GRU, user_train(GRU), layout=layout)
    with pytest.raises(UserCodeFailed, match=f"before its first step: SDKUsageError: {said}"):
        trainer.run(job, ranks=2)


def broken_script(tmp_path: Path, name: str, text: str) -> Path:
    """The GRU example's folder with another train.py."""
    code = tmp_path / name
    shutil.copytree(GRU, code, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "train.py").write_text(text)
    return code


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("typo", "import forgeline\nrun = forgeline.init()\nmodle.train()\n",
         r"before its first step: NameError: name 'modle' is not defined \(train\.py, line 3\)"),
        ("missing", "import forgeline\nimport surely_not_installed_anywhere\n",
         r"ModuleNotFoundError: No module named 'surely_not_install\w+' \(train\.py, line 2\)"),
        ("syntax", "def main(:\n    pass\n", r"SyntaxError: .*\(train\.py, line 1\)"),
        ("idle", "import forgeline\nrun = forgeline.init()\nrun.finish()\n",
         r"returned without training: it must call run\.steps\(\)"),
    ],
)  # fmt: skip
def test_a_script_that_cannot_start_is_the_users_error(
    trainer: Trainer, tmp_path: Path, name: str, text: str, said: str
) -> None:
    code = broken_script(tmp_path, name, text)
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(user_job(trainer, f"broken-{name}", code, user_train(code)), ranks=2)


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("never-init", "import time\n\nwhile True:\n    time.sleep(0.05)\n",
         r"train\.py ran \d+ s without calling forgeline\.init\(\) \(recovery\.start_limit_s "
         r"= 4\), at train\.py, line 4: a script trains inside `for step in run\.steps\(\):`"),
        ("never-steps", "import time\nimport forgeline\n\nrun = forgeline.init()\n"
         "def my_own_loop():\n    while True:\n        time.sleep(0.05)\n\nmy_own_loop()\n",
         r"ran \d+ s after forgeline\.init\(\) without calling run\.restore\(model, "
         r"optimizer\) \(recovery\.start_limit_s = 4\), at train\.py, line 7"),
    ],
    ids=["never-init", "never-steps"],
)  # fmt: skip
def test_a_script_that_never_reports_is_the_users_error(
    trainer: Trainer, tmp_path: Path, name: str, text: str, said: str
) -> None:
    """It loops in its own code and never reaches run.steps(): failed, with the line it
    loops on, once a stretch of its own code runs past the limit."""
    code = broken_script(tmp_path, name, text)
    job = user_job(trainer, f"quiet-{name}", code, user_train(code))
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(job, ranks=2, timeout_s=90, start_limit_s=4)


def test_a_device_fault_before_the_first_step_is_a_crash_not_the_user_s(
    trainer: Trainer, tmp_path: Path
) -> None:
    """What a GPU whose memory fails its ECC check raises at the script's first CUDA call:
    the node's fault (trainer.platform_faults), so the run restarts, and the node is broken:
    the agent takes it out of service (NodeFault); before, the run failed at once as the
    user's mistake."""
    text = (
        "import forgeline\nimport torch\nrun = forgeline.init()\n"
        "raise torch.AcceleratorError('CUDA error: uncorrectable ECC error encountered')\n"
    )
    code = broken_script(tmp_path, "ecc", text)
    with pytest.raises(RanksFailed) as failed:
        trainer.run(user_job(trainer, "device-fault", code, user_train(code)), ranks=2)
    assert isinstance(failed.value, NodeFault) and not isinstance(failed.value, UserCodeFailed)
    assert "AcceleratorError: CUDA error: uncorrectable ECC error encountered" in str(failed.value)


def test_a_rank_that_finds_no_gpu_on_a_gpu_node_fails_the_node_not_the_run(
    trainer: Trainer, tmp_path: Path
) -> None:
    """Its agent says the node's devices are GPUs; this rank sees none (a driver gone, a GPU
    fallen off the bus). Training on its CPU instead would run a hundred times slower and
    nobody would know: the node is taken out instead (NodeFault) and the run goes on."""
    code = broken_script(tmp_path, "no-gpu", (GRU / "train.py").read_text())
    with pytest.raises(NodeFault, match="no CUDA-capable device is visible to this rank"):
        trainer.run(
            user_job(trainer, "no-gpu", code, user_train(code)),
            ranks=2,
            devices=GrantedDevices([0, 1], cuda=True),
        )


def test_a_crash_after_training_began_is_a_crash(trainer: Trainer, tmp_path: Path) -> None:
    """Restarted from the last checkpoint like a dead node, not failed as a mistake. One rank
    raises: the agent reports it by the rank's own word, with torchrun and every rank gone
    (stopped at once, not after torchrun's teardown)."""
    text = (
        (GRU / "train.py")
        .read_text()
        .replace(
            "        step.gradients(model)\n",
            "        step.gradients(model)\n"
            "        if step.number == 12 and __import__('os').environ['RANK'] == '1':\n"
            "            raise RuntimeError('out of memory at step 12')\n",
        )
    )
    code = broken_script(tmp_path, "late", text)
    job = user_job(trainer, "late-crash", code, user_train(code))
    with pytest.raises(RanksFailed) as failed:
        trainer.run(job, ranks=2)
    assert not isinstance(failed.value, UserCodeFailed)
    assert "failed: RuntimeError: out of memory at step 12; last lines of" in str(failed.value)
    job_file = Path(job.progress_file).parent / "job.json"
    assert job_processes(job_file) == [] and job_processes(job_file, launcher=True) == []
    assert find_latest(trainer.store, "late-crash", max_generation=1).step == 10


_SPY = (
    "import json, os, pathlib\n"
    "pathlib.Path(os.environ['SPY_OUT']).write_text(json.dumps(sorted(os.environ)))\n"
    "raise SystemExit('spied')\n"
)


def test_a_rank_gets_the_store_s_keys_but_none_of_the_agent_s(
    trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's script sees its environment: before, the agent's Temporal API key and MLflow
    password were in it."""
    held = {"FORGELINE_TEMPORAL_API_KEY": "temporal-key-123456", "FORGELINE_TOKEN": "flt_x",
            "MLFLOW_TRACKING_PASSWORD": "mlflow-pw-123456", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
            "SPY_OUT": str(tmp_path / "env.json")}  # fmt: skip
    for name, value in held.items():
        monkeypatch.setenv(name, value)
    code = broken_script(tmp_path, "spy", _SPY)
    with pytest.raises(UserCodeFailed):
        trainer.run(user_job(trainer, "spy", code, user_train(code)), ranks=1)
    seen = set(json.loads((tmp_path / "env.json").read_text()))
    assert {"AWS_ACCESS_KEY_ID", "FORGELINE_JOB", "SPY_OUT"} <= seen
    assert not seen & {"FORGELINE_TEMPORAL_API_KEY", "FORGELINE_TOKEN", "MLFLOW_TRACKING_PASSWORD"}


def test_a_user_script_passes_its_shadow_checks(trainer: Trainer) -> None:
    """The GRU example hands the SDK its loss (run.recompute_with): on three ranks, checked
    every 5 steps, its recomputes agree bit for bit with what its ranks computed."""
    job = user_job(trainer, "gru-shadow", GRU, user_train(GRU, steps=20, batch_size=12), nodes=3,
                   shadow=RecoverySpec(shadow_every=5).shadow_settings())  # fmt: skip
    trainer.run(job, ranks=3)
    lines = Path(job.progress_file).read_text().splitlines()
    assert [e for e in map(json.loads, lines) if e["event"] == "health"] == []
    found = find_latest(trainer.store, "gru-shadow", max_generation=1)
    assert found is not None and found.step == 20


def test_shadow_checks_without_a_recompute_are_the_users_error(
    trainer: Trainer, tmp_path: Path
) -> None:
    text = (GRU / "train.py").read_text()
    code = broken_script(tmp_path, "no-recompute", text.replace("run.recompute_with(loss_of)", ""))
    job = user_job(trainer, "gru-no-recompute", code, user_train(code),
                   shadow=RecoverySpec(shadow_every=5).shadow_settings())  # fmt: skip
    said = r"call run\.recompute_with\(loss_of\) before run\.steps\(\)"
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(job, ranks=2)


def test_shadow_checks_of_a_loop_that_accumulates_under_no_sync_are_refused(
    trainer: Trainer, tmp_path: Path
) -> None:
    """Its first all-reduce holds the sum of every micro-batch: compared with one micro-batch's
    recompute, every healthy rank would look wrong. Refused at the first step, with the fix."""
    text = (GRU / "train.py").read_text()
    loop = (
        "        for x, y in step.micro_batches():  # this rank's share of the global batch\n"
        "            with step.forward():\n"
        "                loss = loss_of(model, x, y)\n"
        "            loss.backward()\n"
    )
    assert loop in text
    accumulating = (
        "        micro = list(step.micro_batches())\n"
        "        for i, (x, y) in enumerate(micro):\n"
        "            last = i == len(micro) - 1\n"
        "            with contextlib.nullcontext() if last else model.no_sync():\n"
        "                with step.forward():\n"
        "                    loss = loss_of(model, x, y)\n"
        "                loss.backward()\n"
    )
    text = text.replace(loop, accumulating).replace(
        "import math\n", "import contextlib\nimport math\n"
    )
    code = broken_script(tmp_path, "no-sync", text)
    job = user_job(trainer, "gru-no-sync", code, user_train(code, grad_accum_steps=2),
                   shadow=RecoverySpec(shadow_every=5).shadow_settings())  # fmt: skip
    said = r"before its first step: SDKUsageError: .* first all-reduce came after micro-batch 2"
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(job, ranks=2)
