"""The node agent reads what its ranks write in bounded amounts (trainer/rank_lines.py, the
ProgressTail of trainer/launch.py): a script can write a line of gigabytes with no newline, or
junk, to its progress file or torchrun's log; the agent passes over it with a warning and goes on
following the lines after it, holding at most a read of 1 MiB at a time."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from trainer.progress_tail import ProgressTail
from trainer.rank_lines import MAX_READ, ODD_WARNINGS, TAIL_BYTES, line_cap, tail_lines

TEN_MIB = 10 << 20


def _line(**event: object) -> bytes:
    return json.dumps({"time": 1.0e9, **event}).encode() + b"\n"


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as out:
        out.write(data)


def _poll_until(tail: ProgressTail, done: bool = False, most: int = 40) -> list[int]:
    """Poll `most` times at most (until the step moves past 0); the bytes each poll read."""
    read = []
    for _ in range(most):
        tail.poll()
        read.append(tail.lines.last_read)
        if tail.latest["step"] != 0 and done:
            break
    return read


def test_a_10_mib_line_without_newline_is_passed_over_and_the_step_after_it_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    progress = tmp_path / "progress.jsonl"
    tail = ProgressTail(progress)
    _append(progress, b"x" * TEN_MIB)  # no newline yet: the line may grow for ever
    read = _poll_until(tail, most=12)
    assert tail.latest["step"] == 0 and tail.lines.offset == TEN_MIB  # all passed over
    _append(progress, b"y" * 100 + b"\n" + _line(event="step", step=7, loss=2.5))
    read += _poll_until(tail, done=True)
    # Before: one poll read the whole 10 MiB and the next json.loads of it raised.
    assert tail.latest["step"] == 7 and tail.latest["loss"] == 2.5
    assert max(read) <= MAX_READ  # what any one poll held, whatever the ranks wrote
    long_line = [r for r in caplog.records if "longer than the" in r.getMessage()]
    assert len(long_line) == 1  # one warning for the line, naming the file and its size
    assert str(progress) in long_line[0].getMessage()
    assert "a line of more than" in long_line[0].getMessage()


def test_a_long_line_read_whole_is_named_with_its_size_and_the_lines_around_it_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    progress = tmp_path / "progress.jsonl"
    too_long = line_cap(1) + 1
    _append(progress, _line(event="step", step=1) + b"z" * too_long + b"\n")
    _append(progress, _line(event="checkpoint", step=1) + _line(event="step", step=2))
    tail = ProgressTail(progress)
    tail.poll()
    assert tail.latest["step"] == 2 and tail.latest["checkpoint_step"] == 1
    assert f"a line of {too_long} bytes at byte " in caplog.text


def test_a_step_line_of_a_large_gang_is_within_its_cap(tmp_path: Path) -> None:
    """A step line carries each rank's step time and gradient norm: the cap grows with the
    gang, so an honest line of 8192 ranks is read, and its size is past the base cap."""
    world = 8192
    spread = [random.random() * 1e-3 for _ in range(world)]
    line = _line(event="step", step=3, rank_step_s=spread, rank_grad_norm=spread)
    assert line_cap(1) < len(line) <= line_cap(world)
    progress = tmp_path / "progress.jsonl"
    _append(progress, line)
    tail = ProgressTail(progress, world=world)
    tail.poll()
    assert tail.latest["step"] == 3


ODD_LINES = [
    b"garbage",
    b"[1, 2]",
    b'{"event": 5}',
    b"[" * 60_000,  # nested too deep for json
    b"\xff\xfe not utf-8",
    json.dumps({"event": "step", "step": "soon", "loss": "low"}).encode(),
    json.dumps({"event": "health", "kind": "corruption", "time": 1e308, "node_index": 0}).encode(),
    json.dumps({"event": "health", "kind": "anything", "time": 1.0, "node_index": 0}).encode(),
    json.dumps({"event": "health", "kind": "straggler", "time": 1.0, "node_index": -1}).encode(),
    json.dumps({"event": "checkpoint"}).encode(),
]


def test_odd_lines_are_skipped_with_a_bounded_number_of_warnings_and_the_rest_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    progress = tmp_path / "progress.jsonl"
    _append(progress, b"".join(odd + b"\n" for odd in ODD_LINES * 20))
    health = {"kind": "straggler", "node_index": 1, "evidence": "slow", "step": 4}
    _append(progress, _line(event="step", step=4, loss=1.5) + _line(event="health", **health))
    tail = ProgressTail(progress)
    with caplog.at_level(logging.WARNING, logger="trainer.rank_lines"):
        tail.drain()  # before: json.loads raised on the first line
    assert tail.latest["step"] == 4 and tail.latest["loss"] == 1.5
    assert [e["kind"] for e in tail.latest["health"]] == ["straggler"]
    assert tail.lines.odd_lines == len(ODD_LINES) * 20
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == ODD_WARNINGS + 1  # not 200: a script cannot flood the agent's log
    assert "not JSON" in warnings[0] and str(progress) in warnings[0]
    assert 'not a JSON object with an "event" string' in warnings[1]
    assert "skipped without a warning" in warnings[-1]


def test_an_error_quotes_the_end_of_torchrun_s_log_not_all_of_it(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    _append(log, b"a" * TEN_MIB + b"\n" + b"".join(b"line %d\n" % n for n in range(100)))
    _append(log, b"b" * 10_000)  # a last line with no end
    lines = tail_lines(log).splitlines()
    assert len(lines) == 30 and lines[0] == "line 71"
    assert lines[-1] == "b" * 2000 + "… (8000 more characters)"  # cut, saying by how much
    _append(log, b"c" * TEN_MIB)
    assert len(tail_lines(log)) < TAIL_BYTES  # only the end is read, however long the log
    assert tail_lines(tmp_path / "absent.log") == ""


def test_the_last_poll_reads_on_to_the_end_of_what_the_ranks_left(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    steps = b"".join(_line(event="step", step=s, loss=1.0, pad="p" * 200) for s in range(20_000))
    assert len(steps) > 3 * MAX_READ
    _append(progress, steps + _line(event="done", step=20_000))
    tail = ProgressTail(progress)
    tail.drain()
    assert tail.finished and tail.latest["step"] == 20_000
