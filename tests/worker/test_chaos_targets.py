"""The chaos commands and the tests' fault helpers find a node's torchrun and ranks by their
command lines (worker.chaos.trainer_processes); bwrap and its init carry the same command line
after their own, and must not be taken for them (a SIGSTOP to bwrap slows no rank; a SIGKILL
ends every rank of the node)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainer.launch import RANK_SCRIPT
from worker.chaos import trainer_processes


def test_a_box_is_not_taken_for_the_ranks_inside_it(tmp_path: Path) -> None:
    job = f"{tmp_path}/nodes/n0/runs/r1/gen-1/job.json"
    # As the command lines are: torchrun's own, and bwrap's with torchrun's after it.
    script = f'exec -a "$0" {sys.executable} -c "import time; time.sleep(30)" "$@"'
    started = [
        subprocess.Popen(["bash", "-c", script, name, "--run-path", RANK_SCRIPT, job])
        for name in (sys.executable, "/usr/bin/bwrap")
    ]
    try:
        time.sleep(0.5)
        found = trainer_processes(tmp_path, run="r1")
        assert found == [started[0].pid], (found, [p.pid for p in started])
    finally:
        for process in started:
            process.kill()
            process.wait()
