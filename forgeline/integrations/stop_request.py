"""A stop request (SIGTERM) that every rank of the gang acts on at the same step.

The node agent asks a script to stop (a preemption, a drain) by sending SIGTERM to torchrun,
which passes it to its ranks; the script then has the stop grace (trainer.script_folder) to
save and return. The signals reach the ranks of a gang at slightly different moments, so each
rank seeing its own flag would stop at its own step: one rank would save while another entered
the next step's all-reduce, and the gang would hang. So the flags are agreed: at the end of
every step each rank contributes its own, and the gang stops if any rank was asked.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist


class StopRequest:
    """Installs a SIGTERM handler (in the main thread, where the training loop runs) that only
    notes the request; `agreed()` says whether any rank of the gang has one."""

    def __init__(self) -> None:
        self.asked = False
        self.install()

    def install(self) -> None:
        """Make this the SIGTERM handler (again, after a library put its own in its place)."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.asked = True

    def agreed(self) -> bool:
        """Whether any rank was asked to stop. Every rank must call it at the same point of
        every step (it is one all-reduce of one number when a process group is up)."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.asked
        # NCCL reduces only tensors on the GPU; gloo, on the CPU.
        on_gpu = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
        flag = torch.tensor([1 if self.asked else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
