"""A process that dies the moment its parent does (Linux PR_SET_PDEATHSIG).

The node agent starts torchrun and torchrun starts the ranks. When an agent is SIGKILLed (the
node failed), nothing of its run may go on training: ranks that outlive their launcher keep
their peers' collectives succeeding for a while, train and even commit past the moment the node
died, and hold a GPU as orphans afterwards.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
# Loaded at import, not in a child between fork and exec: dlopen there can deadlock on a lock
# that another thread of the parent held at fork time.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits. Safe between fork and exec (one syscall)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent_from_now() -> None:
    """die_with_parent() for a process that is already running. A parent that died before
    this call has handed the process to init (pid 1): it exits now instead of living on."""
    parent = os.getppid()
    die_with_parent()
    if parent == 1 or os.getppid() != parent:
        os._exit(1)
