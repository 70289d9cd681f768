"""The soak's count of liveness probes (bench/probe_answers.py), read from recorded histories
of real runs: a dead node's probe goes unanswered; after a control-plane silence, live agents
answer theirs."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import WorkflowHistory

from bench.probe_answers import count_probes
from bench.soak_plan import ProbeAnswers

HISTORIES = Path(__file__).resolve().parents[1] / "workflows" / "histories"


def _counted(name: str) -> ProbeAnswers:
    history = WorkflowHistory.from_json(name, (HISTORIES / name).read_text())
    found = ProbeAnswers()
    count_probes(history.events, found)
    return found


def test_a_dead_nodes_probe_goes_unanswered() -> None:
    found = _counted("2026-12-03-requeue_TrainingRun_dead-node.json")
    assert found.unanswered == 1
    assert found.answered_ms == []


def test_live_agents_answers_are_timed_from_scheduled_to_completed() -> None:
    found = _counted("2026-12-07-silence_TrainingRun_silence.json")
    assert found.unanswered == 0
    assert found.answered_ms and all(0 <= ms < 2000 for ms in found.answered_ms), found
