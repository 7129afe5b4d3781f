"""Counting host synchronisations: every `.tolist()`, `.item()`, `int()`, `float()`, `bool()`
of a tensor made from specdeploy code while the counter is on, grouped by the file that made it.

On the CPU a "device" tensor is a host tensor, so this counts conversions, which is stricter:
on a GPU each of them would be a device→host copy and a sync (DESIGN.md invariant 8)."""
from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch

import specdeploy

ROOT = str(Path(specdeploy.__file__).parent)
_METHODS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def count_host_syncs():
    counts: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(ROOT):
                counts[caller[len(ROOT) + 1:]] += 1
            return fn(self, *args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
