"""Pruning keeps the newest checkpoints that resume could use: a corrupt or unreadable one never
counts toward `keep_checkpoints`, and the newest verified checkpoint is never deleted."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from infra.store.local import LocalStore
from tests.trainer.test_fencing import commit
from trainer.manifest import committed_steps, find_latest, manifest_key, prune, record_generation


def corrupt(store: LocalStore, run: str, step: int) -> None:
    """Rot the files of every generation's checkpoint at `step`."""
    for key in store.list(f"runs/{run}/checkpoints/step-{step}/"):
        if key.endswith(".distcp"):
            store.put_bytes(key, b"rotted")


def test_a_corrupt_newer_checkpoint_does_not_push_the_good_one_out(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    commit(store, "r", 10, generation=1)
    commit(store, "r", 20, generation=1)
    corrupt(store, "r", 20)
    assert prune(store, "r", keep=1) == []  # before: [10], leaving only the corrupt step 20
    found = find_latest(store, "r", max_generation=1)
    assert found is not None and found.step == 10
    commit(store, "r", 30, generation=1)
    assert prune(store, "r", keep=1) == [20, 10]  # a newer good one: both older ones go
    store.put_bytes(manifest_key("r", 40, 1), b"{not json")
    assert prune(store, "r", keep=1) == [] and committed_steps(store, "r") == [40, 30]


# One event per draw, then a prune: commit the next step (by the current generation), commit
# one whose files rot before the prune, corrupt a committed step, or start a new generation
# that resumes from the newest verified checkpoint.
EVENTS = st.lists(
    st.one_of(
        st.just(("commit", 0)),
        st.just(("commit rotten", 0)),
        st.tuples(st.just("corrupt"), st.integers(0, 20)),
        st.just(("resume", 0)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(events=EVENTS, keep=st.integers(1, 3))
def test_the_newest_verified_checkpoint_always_survives(
    events: list[tuple[str, int]], keep: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        store = LocalStore(Path(folder))
        step, generation = 0, 1
        for event, which in events:
            if event.startswith("commit"):
                step += 10
                commit(store, "r", step, generation)
                if event == "commit rotten":
                    corrupt(store, "r", step)
            elif event == "corrupt" and (steps := committed_steps(store, "r")):
                corrupt(store, "r", steps[which % len(steps)])
            elif event == "resume":
                newest = find_latest(store, "r", max_generation=generation)
                generation += 1
                record_generation(store, "r", generation, newest.step if newest else 0)
            before = find_latest(store, "r", max_generation=generation)
            prune(store, "r", keep)  # what the writer does after each commit
            after = find_latest(store, "r", max_generation=generation)
            assert (after and after.step) == (before and before.step), (events, keep)
