"""The module shadow checks differentiate (forgeline.shadow.plain_module): the script's model
without torch.compile's wrapper and DDP's, however they are stacked. Under torch.compile a DDP
model is an OptimizedModule around the DDP one, and a check that looked for DDP alone ran its
recompute through DDP's forward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from forgeline.errors import SDKUsageError
from forgeline.shadow import plain_module, shadow_checks
from trainer.shadow_check import ShadowSettings


@pytest.mark.usefixtures("one_rank")
def test_the_checks_reach_the_module_inside_compile_and_ddp() -> None:
    inner = torch.nn.Linear(4, 4)
    ddp = DistributedDataParallel(inner)
    # backend="eager": the wrapper torch.compile makes, without compiling kernels on this CPU.
    assert plain_module(torch.compile(ddp, backend="eager")) is inner
    assert plain_module(DistributedDataParallel(torch.compile(inner, backend="eager"))) is inner
    assert plain_module(ddp) is inner
    assert plain_module(inner) is inner


class _RunOn:
    """What `shadow_checks` reads of a run before it checks anything: its device."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_bitwise_checks_are_refused_on_a_gpu_with_the_setting_to_change() -> None:
    """GPU kernels are not bitwise reproducible: a zero tolerance there would quarantine every
    node at its first check. The script's run fails before its first step, saying what to set."""
    settings = ShadowSettings(every=50, rtol=0.0)
    with pytest.raises(SDKUsageError, match=r"recovery.shadow_rtol \(1e-3 is a start"):
        shadow_checks(_RunOn("cuda"), settings, lambda m, x, y: m(x).sum(), None)  # type: ignore[arg-type]
