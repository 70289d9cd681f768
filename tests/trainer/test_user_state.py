"""What a user's script keeps beside its model and optimizer (`run.restore(state=...)`) and how
its loop ends, in real torchrun ranks over gloo: an LR scheduler and an EMA resume bitwise
after a SIGKILL, a loop that breaks early commits where it stopped, a crash in the loop stays a
crash, and a state the SDK cannot keep is refused before the first step; a checkpoint's state
loads without unpickling anything that could run code."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from forgeline.errors import SDKUsageError
from forgeline.kept_state import KeptState
from tests.conftest import REPO
from tests.trainer.conftest import Trainer
from tests.trainer.test_safe_loading import Payload, trained
from tests.trainer.test_user_code import (
    broken_script,
    kill_after_first_commit,
    script,
    user_job,
    user_train,
    weights_in,
)
from trainer.attempt_clock import read_ledger
from trainer.checkpoint import (
    KEPT_STATE,
    load_saved_tensors,
    load_training_state,
)
from trainer.checkpoint_manifest import CheckpointManifest
from trainer.errors import CheckpointError, RanksFailed, UserCodeFailed
from trainer.job import TrainJob
from trainer.manifest import committed_steps, find_latest
from trainer.safe_load import UnsafeCheckpoint
from workflows.contracts.spec import TrainSpec

SCHEDULED = REPO / "examples" / "byo" / "scheduled"
ARGS = {"block": 16, "width": 16}
STEPS = 16


def scheduled_train(**args: object) -> TrainSpec:
    """Few small steps, a checkpoint every 4: a run takes a few seconds."""
    return user_train(SCHEDULED, args={**ARGS, **args}, steps=STEPS, checkpoint_every=4,
                      eval_every=0, log_every=4)  # fmt: skip


def final(trainer: Trainer, run_id: str, generation: int = 1) -> CheckpointManifest:
    found = find_latest(trainer.store, run_id, max_generation=generation)
    assert found is not None
    return found.manifest


def weights_and_ema(
    trainer: Trainer, manifest: CheckpointManifest, tag: str
) -> dict[str, torch.Tensor]:
    """The model's weights, loaded into the script's own class, and the EMA's, by name."""
    model = script(SCHEDULED).CharMLP(trainer.snapshot.manifest.tokenizer.vocab_size, 16)
    weights = weights_in(trainer, model, manifest, tag)
    folder = trainer.root / tag  # fetched there by weights_in
    ema = load_saved_tensors(folder, f"{KEPT_STATE}.ema")
    return {**weights, **{f"ema.{name}": tensor for name, tensor in ema.items()}}


# With the slow tests, to keep `make test` within 15 minutes (15 s; it was 15 min 37 s on a
# clean clone): the kept state's round trip without a kill stays here.
@pytest.mark.slow
def test_a_scheduler_and_an_ema_resume_bitwise_after_a_sigkill(trainer: Trainer) -> None:
    train = scheduled_train()
    trainer.run(user_job(trainer, "sched-ref", SCHEDULED, train), ranks=2)
    reference = final(trainer, "sched-ref")
    assert reference.step == STEPS

    resume = kill_after_first_commit(
        trainer, user_job(trainer, "sched-killed", SCHEDULED, train), 2
    )
    job = user_job(trainer, "sched-killed", SCHEDULED, train, resume=resume, generation=2)
    trainer.run(job, ranks=2)
    resumed = final(trainer, "sched-killed", generation=2)
    assert resumed.step == STEPS and resumed.generation == 2
    assert resumed.loss_history == reference.loss_history
    ours, theirs = (
        weights_and_ema(trainer, resumed, "sched-a"),
        weights_and_ema(trainer, reference, "sched-b"),
    )
    assert ours.keys() == theirs.keys() and any(k.startswith("ema.module.") for k in ours)
    assert int(ours["ema.n_averaged"]) == STEPS
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), [
        k for k in theirs if not torch.equal(ours[k], theirs[k])
    ]
    # The learning rate went on from where it was, not from the warm-up's start.
    lrs = [e["lr"] for e in events(job) if e["event"] == "step"]
    assert lrs and lrs[-1] == pytest.approx(train.learning_rate * 0.1)


def events(job: TrainJob) -> list[dict]:
    return [json.loads(line) for line in Path(job.progress_file).read_text().splitlines()]


def test_a_loop_that_breaks_early_commits_where_it_stopped(trainer: Trainer) -> None:
    """The script breaks after step 7 (its own early stopping): run.finish() commits step 7
    (off the spec's every-4 grid) and the ranks end as done, not as a failure to retry."""
    job = user_job(trainer, "sched-break", SCHEDULED, scheduled_train(break_at=7))
    trainer.run(job, ranks=2)
    assert committed_steps(trainer.store, "sched-break") == [7, 4]
    kept = final(trainer, "sched-break")
    assert kept.step == 7 and kept.samples_seen == 7 * 8
    end = events(job)[-1]
    assert end["event"] == "done" and end["step"] == 7
    assert end["reason"] == f"the script's loop ended at step 7 of {STEPS}"
    ledger = read_ledger(trainer.store, "sched-break", 1)
    assert ledger is not None and ledger.ended == f"done: {end['reason']}"
    assert [m.step for m in ledger.commits][-1] == 7


def test_a_crash_in_the_loop_stays_a_crash_and_saves_nothing_more(
    trainer: Trainer, tmp_path: Path
) -> None:
    """Every rank raises in step 10, its loop inside `try: ... finally: run.finish()`: the
    save of step 8 commits, nothing is saved after it (the run restarts from step
    8), the attempt's ledger says how it ended, and the error is the crash it is."""
    text = (
        (SCHEDULED / "train.py")
        .read_text()
        .replace("    for step in run.steps():\n", "    try:\n      for step in run.steps():\n")
        .replace(
            "        step.gradients(model)\n",
            "        step.gradients(model)\n"
            "        if step.number == 10:\n"
            "            raise RuntimeError('out of memory at step 10')\n",
        )
        .replace("    run.finish()  #", "    finally:\n      run.finish()  #")
    )
    code = broken_script(tmp_path, "crash-in-loop", text)
    job = user_job(trainer, "sched-crash", code, scheduled_train())
    with pytest.raises(RanksFailed) as failed:
        trainer.run(job, ranks=2)
    assert not isinstance(failed.value, UserCodeFailed)
    assert "RuntimeError: out of memory at step 10" in str(failed.value)
    assert committed_steps(trainer.store, "sched-crash")[0] == 8
    assert not any(e["event"] in ("done", "stopped") for e in events(job))
    ledger = read_ledger(trainer.store, "sched-crash", 1)
    assert ledger is not None
    assert ledger.ended == (
        "failed: the loop was left at step 10 (RuntimeError: out of memory at step 10)"
    )


def test_a_state_the_sdk_cannot_keep_is_refused_before_the_first_step(
    trainer: Trainer, tmp_path: Path
) -> None:
    text = (SCHEDULED / "train.py").read_text()
    mistake = text.replace('state={"scheduler": scheduler, "ema": ema}',
                           'state={"scheduler": scheduler, "ema.weights": ema}')  # fmt: skip
    assert mistake != text
    code = broken_script(tmp_path, "bad-state", mistake)
    said = (
        r"before its first step: SDKUsageError: run\.restore\(state=\{'ema\.weights': \.\.\.\}\): "
        r"a name is 1-64 letters, digits or '_'"
    )
    with pytest.raises(UserCodeFailed, match=said):
        trainer.run(user_job(trainer, "sched-bad", code, scheduled_train()), ranks=2)


class Counter:
    """A state of the script's own: a position kept as plain data."""

    def __init__(self, value: object = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@pytest.mark.parametrize(
    ("state", "said"),
    [
        ([Counter()], r"takes a dict of name → object, not a list"),
        ({"": Counter()}, r"state=\{'': \.\.\.\}\): a name is 1-64 letters"),
        ({"lr": 0.1}, r"a float has no state_dict\(\) or load_state_dict\(\); pass an object"),
        ({"loader": Counter({1, 2})}, r"loader\.state_dict\(\)\['value'\] holds a builtins\.set"),
        ({"loader": Counter({3: 1})}, r"has the int key 3: a checkpoint keeps dicts with str"),
        ({"loader": Counter(Path("x"))}, r"holds a pathlib\.\w*PosixPath: a checkpoint keeps"),
    ],
    ids=["not-a-dict", "empty-name", "no-methods", "a-set", "an-int-key", "an-object"],
)  # fmt: skip
def test_what_cannot_be_kept_is_named_with_the_fix(state: object, said: str) -> None:
    with pytest.raises(SDKUsageError, match=said):
        KeptState(state)


def test_kept_state_round_trips_typed_data() -> None:
    """What a checkpoint would hold: fresh containers, the same values, tensors as they are."""
    weight = torch.ones(2)
    kept = KeptState({"mine": Counter({"seen": [1, 2.5, (3, "x")], "w": weight, "n": None})})
    captured = kept.capture()["mine"]["value"]
    assert captured == {"seen": [1, 2.5, (3, "x")], "w": weight, "n": None}
    assert captured["w"] is weight and captured["seen"] is not kept.objects["mine"].value["seen"]


def test_kept_state_that_would_run_code_is_refused(tmp_path: Path, one_rank: None) -> None:
    """A checkpoint whose kept state holds a crafted pickle: the load refuses it, naming the
    item, and nothing it names has run."""
    marker = tmp_path / "pwned"
    model, optimizer = trained(seed=1)
    model_state, optim_state = get_state_dict(model, optimizer)
    crafted = {KEPT_STATE: {"counter": {"value": Payload(marker)}}}
    with warnings.catch_warnings():  # one rank of a gloo group: nothing to warn about
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state, **crafted},
                 checkpoint_id=str(tmp_path / "ckpt"))  # fmt: skip
    counter = Counter()
    kept = KeptState({"counter": counter}).capture()
    with pytest.raises(UnsafeCheckpoint, match=r"refusing checkpoint item state\.counter\.value"):
        load_training_state(model, optimizer, tmp_path / "ckpt", kept)
    assert not marker.exists() and counter.value == 0


def test_a_checkpoint_without_the_named_state_is_refused(tmp_path: Path, one_rank: None) -> None:
    """Loading nothing for it would restart the schedule without a word."""
    model, optimizer = trained(seed=1)
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path / "c"))
    kept = KeptState({"counter": Counter()}).capture()
    with pytest.raises(CheckpointError, match=r"holds no state 'counter'"):
        load_training_state(model, optimizer, tmp_path / "c", kept)
