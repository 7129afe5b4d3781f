"""Allocate a cache plan's tensors as a graph module's buffers (one place for the layout: the
plan's scratch page and slot are the last of each, see cache/padding.py)."""
from __future__ import annotations

import torch

from specdeploy.cache.handlers import Checkpoint, PagedKV
from specdeploy.cache.plan import CachePlan


def allocate(gm: torch.nn.Module, resources: list, plan: CachePlan, device,
             plain: bool = False) -> None:
    """The cache tensors of `resources` as the graph's buffers (with the plan's scratch page and
    slot: the last of each); `plain`: plain attributes too, read without
    `nn.Module.__getattr__` (~1 us each; caches are only changed in place)."""
    tensors = []
    for h in resources:
        if isinstance(h, PagedKV):
            # (the window group: its null page 0, its pool, its scratch page; cache/window.py)
            pages = plan.num_win_pages + 2 if h.window else plan.num_pages + 1
            k, v = h.allocate(pages, plan.page_size, device)
            tensors += [(f"{h.name}_k", k), (f"{h.name}_v", v)]
        elif isinstance(h, Checkpoint):
            tensors.append((h.name, h.allocate(plan.num_checkpoints, device)))
        else:
            tensors.append((h.name, h.allocate(plan.num_slots + 1, device)))
    for name, t in tensors:
        gm.__dict__.pop(name, None)  # a re-allocation never leaves a stale plain attribute
        gm.register_buffer(name, t, persistent=False)
        if plain:
            gm.__dict__[name] = t
