"""The first process of a job's container (infra.containers): runs torchrun, and ends
everything inside when the agent that started it is gone.

    python3 container_init.py LIFELINE_FD -- python3 -m torch.distributed.run ...

It is pid 1 of the container's pid namespace, in the image's Python, with nothing of
Forgeline's imported (standard library only). The agent holds the write end of a pipe whose
read end is LIFELINE_FD here: a dead agent closes it, and then this process exits, which ends
every process of the namespace (a dead agent is a failed node: nothing of its ranks may
outlive it, as bubblewrap's --die-with-parent makes it for a box). The signals the agent sends
go to torchrun or the ranks themselves, by their pids on the host; this process only reaps
orphans (pid 1's duty) and exits with torchrun's status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def _watch_lifeline(fd: int, child: subprocess.Popen) -> None:
    """Block on the pipe until the agent's end closes, then end the container."""
    while os.read(fd, 1):
        pass
    child.kill()
    os._exit(137)  # pid 1 exits: the kernel kills the rest of the namespace


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    if argv[2] != "--":
        raise SystemExit("usage: container_init.py LIFELINE_FD -- COMMAND ...")
    os.set_inheritable(fd, False)  # torchrun and its ranks never hold the agent's pipe
    child = subprocess.Popen(argv[3:])
    threading.Thread(target=_watch_lifeline, args=(fd, child), daemon=True).start()
    # pid 1 ignores signals it has no handler for: SIGTERM from the host must not be lost.
    signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
    while True:
        pid, status = os.wait()  # reaps orphans too (a rank torchrun did not wait for)
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # a signal's death, as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv))
