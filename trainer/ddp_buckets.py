"""DDP's bucket layout, made the same for every step of every attempt, so a resumed run adds its
gradients up in the order an uninterrupted one did.

DDP reduces gradients in buckets. Its first backward uses one bucket in parameter order; after
that backward it rebuilds them once, in the order the gradients became ready. An all-reduce over
three or more ranks adds each element's values in an order that depends on where the element
sits in its bucket (a ring starts each chunk at a different rank), so the same step adds up
differently in a fresh process's first step and in an old process's later ones: a run resumed
from step 10 computed step 11 in another order than the uninterrupted run did, and drifted from
it in the last bits (with two ranks, a + b = b + a, and nothing showed).

So every attempt has DDP rebuild its buckets before its first real step: one backward of a sum
over the parameters in reverse order (what a model's backward roughly is, and the same in every
process), whose all-reduces are skipped and whose gradients are dropped. From the first step on,
every step of every attempt reduces in the same layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel


def settle_buckets(model: DistributedDataParallel, dry: contextlib.AbstractContextManager) -> None:
    """Rebuild DDP's buckets now, deterministically; `dry`: the comm hook passes buckets back
    unreduced (no collective: every rank does this alike, but nothing needs to cross). Leaves
    every gradient None, as a fresh process has them."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    # DDP rebuilds on its own terms with these (a search for unused parameters, a static
    # graph's first-iteration bookkeeping): leave such a model to it.
    if not params or model.find_unused_parameters or model.static_graph:
        return
    with dry:
        # What DDP's forward does before a backward it will reduce: expect the autograd hooks.
        model.reducer.prepare_for_backward([])
        fake = torch.stack([p.sum() for p in reversed(params)]).sum()
        fake.backward()
    for param in params:
        param.grad = None
