"""A script's own set-up that never ends is the user's error; the platform's calls and the
first step are not (trainer.start_watch)."""

from __future__ import annotations

from trainer.start_watch import FIRST_STEP, StartWatch


def test_each_stretch_of_the_script_s_own_code_gets_the_limit() -> None:
    watch = StartWatch(limit_s=10, started_at=0.0)
    assert watch.verdict(100.0) is None  # the launch: Python and torch importing
    watch.observe("script:entered", 0.0)
    assert watch.verdict(9.0) is None
    found = watch.verdict(11.0)
    assert found is not None and found.users
    assert found.what == "ran 11 s without calling forgeline.init()"

    watch.observe("init:returned", 11.0)  # a new stretch: its own 10 s
    assert watch.verdict(20.0) is None
    found = watch.verdict(22.0)
    assert found is not None and found.users and "without calling run.restore" in found.what

    watch.observe("restore:returned", 22.0)
    watch.observe("restore:returned", 30.0)  # the same place again does not restart the clock
    found = watch.verdict(33.0)
    assert found is not None and "without entering run.steps()" in found.what


def test_the_platform_s_calls_are_never_the_user_s_error() -> None:
    watch = StartWatch(limit_s=10, started_at=0.0)
    for where in ("init:entered", "restore:entered"):  # a peer that never comes, a slow load
        watch.observe(where, 1.0)
        assert watch.verdict(1_000.0) is None


def test_a_first_step_past_the_limit_is_a_hang() -> None:
    watch = StartWatch(limit_s=10, started_at=0.0)
    watch.observe(FIRST_STEP, 5.0)
    assert watch.verdict(14.0) is None
    found = watch.verdict(16.0)
    assert found is not None and not found.users
    assert found.what == "the first step did not finish in 11 s"
