"""The module shadow checks differentiate (forgeline.shadow.plain_module): the script's model
without torch.compile's wrapper and DDP's, however they are stacked. Under torch.compile a DDP
model is an OptimizedModule around the DDP one, and a check that looked for DDP alone ran its
recompute through DDP's forward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from forgeline.shadow import plain_module


@pytest.mark.usefixtures("one_rank")
def test_the_checks_reach_the_module_inside_compile_and_ddp() -> None:
    inner = torch.nn.Linear(4, 4)
    ddp = DistributedDataParallel(inner)
    # backend="eager": the wrapper torch.compile makes, without compiling kernels on this CPU.
    assert plain_module(torch.compile(ddp, backend="eager")) is inner
    assert plain_module(DistributedDataParallel(torch.compile(inner, backend="eager"))) is inner
    assert plain_module(ddp) is inner
    assert plain_module(inner) is inner
