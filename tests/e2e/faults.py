"""Faults the end-to-end tests cause on the stack, and what they watch while doing it."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess
from typing import Protocol

from tests.e2e.conftest import Stack, alive, progress_events, ranks_of, wait_for


class DrivesTheCli(Protocol):
    """A stack the tests drive through `forgeline` (the local one, or tests/hosts' cluster)."""

    def cli(self, *args: str, timeout: float = 300, check: bool = True) -> CompletedProcess: ...


def gang_of(stack: DrivesTheCli, run: str) -> tuple[int, list[str]]:
    """The run's current generation and nodes, as `forgeline status` shows them ((0, []) while
    it holds no gang)."""
    found = re.search(r"allocation +generation (\d+) on (.+)", stack.cli("status", run).stdout)
    return (int(found.group(1)), found.group(2).split(", ")) if found else (0, [])


def latest_step(stack: Stack, run: str, generation: int) -> int:
    """The newest step the ranks of `generation` reported (-1: none yet)."""
    events = progress_events(stack, run, generation)
    return max((e["step"] for e in events if e["event"] == "step"), default=-1)


def commits_of(stack: Stack, run: str, generation: int) -> list[int]:
    """The steps `generation` itself committed, as its ranks wrote them (pruning cannot hide
    them, as it can in the store)."""
    return [
        e["step"]
        for e in progress_events(stack, run, generation)
        if e["event"] == "checkpoint" and e["manifest_key"]
    ]


def own_commit(stack: Stack, run: str, generation: int) -> int | None:
    """The first step `generation` itself committed (None: none yet)."""
    return min(commits_of(stack, run, generation), default=None)


def kill_a_node_of(
    stack: Stack,
    run: str,
    after_generation: int,
    chance: random.Random,
    committed_by: Callable[[Stack, str, int], int | None] = own_commit,
) -> int:
    """Wait for the run's next generation to commit a checkpoint (`committed_by`: the step
    of the one to wait for) and train a random number of steps more, then SIGKILL the agent of
    a random node of its gang; return the generation once all its ranks are gone. (The signal
    is sent from here, as `forgeline chaos kill-node` sends it: a command's start-up would let
    the tiny model train on for dozens of steps.)"""
    generation, nodes = wait_for(
        lambda: (gang := gang_of(stack, run))[0] > after_generation and gang, 120, "a new gang"
    )
    victim = chance.choice(nodes)
    agent = agent_pid(stack, victim)
    committed = wait_for(lambda: committed_by(stack, run, generation), 120, "a commit", poll=0.05)
    past = committed + chance.randint(5, 40)
    wait_for(
        lambda: latest_step(stack, run, generation) >= past,
        120,
        f"generation {generation} to reach step {past}",
        poll=0.02,
    )
    sigkill_agent(stack, run, agent)
    return generation


def kill_after_a_commit(stack: Stack, run: str, chance: random.Random) -> int:
    """SIGKILL the agent of a random node of the run's first gang a moment after its first
    commit (maybe mid-save: a torn last.pt must never be what resumes); return the generation."""
    generation, nodes = wait_for(
        lambda: (gang := gang_of(stack, run))[0] > 0 and gang, 120, "a gang"
    )
    wait_for(lambda: commits_of(stack, run, generation), 120, "a commit", poll=0.05)
    time.sleep(chance.uniform(0.0, 1.5))
    sigkill_agent(stack, run, agent_pid(stack, chance.choice(nodes)))
    return generation


def survives_a_dead_agent(stack: Stack, run: str, spec: Path, seed: int) -> tuple[int, str]:
    """Kill an agent of the run's first gang after a commit (`kill_after_a_commit`), bring its
    node back, follow the run to AWAITING_APPROVAL and check it restarted once; the killed
    generation and `forgeline status`."""
    killed = kill_after_a_commit(stack, run, random.Random(seed))
    stack.cli("up", "--nodes", "3")  # the node comes back
    followed = stack.cli("run", str(spec), timeout=300).stdout
    assert "AWAITING_APPROVAL" in followed, followed
    status = stack.cli("status", run).stdout
    assert re.search(r"attempts +1 restart", status), status
    return killed, status


def agent_pid(stack: Stack, node: str) -> int:
    return int((stack.home / "run" / f"{node}.pid").read_text().split()[0])


def sigkill_agent(stack: Stack, run: str, agent: int) -> None:
    """SIGKILL a node agent and wait until no rank of the run is left: the other node's ranks
    fail at their next collective."""
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: not any(map(alive, ranks_of(stack.home, run))), 60, "the gang to die")
