"""A rank failure's message quotes the ranks' output into the run's history, which every reader
of the run sees: credentials in it are masked first (activities.node_confinement.quoted_output)."""

from __future__ import annotations

import pytest

from activities.node_confinement import quoted_output
from trainer.errors import RanksFailed, UserCodeFailed


def test_what_the_ranks_printed_reaches_the_history_masked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FORGELINE_TEMPORAL_API_KEY", "tk-agent-own-key-77")
    printed = (
        "last lines of torchrun.log:\n"
        "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"
        "environ({'HF_TOKEN': 'hf_abcdefghijklmnopqrstuvwxyz'})\n"
        "echo tk-agent-own-key-77\n"
        "RuntimeError: loss is nan at step 12\n"
    )
    for failure in (RanksFailed(printed), UserCodeFailed(printed)):
        quoted = quoted_output(failure)
        for secret in ("wJalrXUtnFEMI", "hf_abcdefghijkl", "tk-agent-own-key-77"):
            assert secret not in quoted, quoted
        assert "AWS_SECRET_ACCESS_KEY=***" in quoted
        assert "RuntimeError: loss is nan at step 12" in quoted  # what the reader needs stays
