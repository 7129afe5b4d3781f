"""Collectives as custom ops: `all_reduce(x)` (sum) and `all_gather(x, dim, world)` over all ranks.

The `shard` transform inserts them where a sharded block's partial sums complete and behind a
vocabulary-parallel LM head. They are opaque graph nodes like any canonical op; the kernel calls
the current backend: torch.distributed (the group set by `set_group`) when initialized, else a
`ThreadGroup` installed for the calling thread (ranks simulated in one process, for tests), else
world size 1 (identity). Time spent inside collectives is counted (`COLLECTIVE_TIME`) for benches.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVE_TIME", "ThreadGroup", "set_group", "thread_rank"]

COLLECTIVE_TIME = {"seconds": 0.0, "calls": 0}
_local = threading.local()
_GROUP: list = [None]  # the process group of the graphs' collectives (None: the default one)


def set_group(group) -> None:
    """Collectives use `group` (distributed/groups.py: the one under the step timeout)."""
    _GROUP[0] = group


class ThreadGroup:
    """`world` ranks as threads of one process: each collective waits for all of them and sums
    (or concatenates) the contributions in rank order."""

    def __init__(self, world: int, timeout: float = 60.0):
        self.world, self.timeout = world, timeout
        self._slots: list[torch.Tensor | None] = [None] * world
        self._barrier = threading.Barrier(world)

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = x
        self._barrier.wait(self.timeout)
        parts = list(self._slots)
        self._barrier.wait(self.timeout)  # nobody overwrites a slot before all have read
        return parts

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(rank, x)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, rank: int, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(rank, x), dim)


@contextmanager
def thread_rank(group: ThreadGroup, rank: int):
    """Run the calling thread as `rank` of `group` (collectives in graphs it runs use it)."""
    _local.group = (group, rank)
    try:
        yield
    finally:
        _local.group = None


def _world() -> int:
    if getattr(_local, "group", None) is not None:
        return _local.group[0].world
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    COLLECTIVE_TIME["seconds"] += time.perf_counter() - t0
    COLLECTIVE_TIME["calls"] += 1
    return out


@torch.library.custom_op("specdeploy::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over all ranks (fp32 accumulation for lower-precision inputs)."""
    if _world() == 1:
        return x.clone()
    sim = getattr(_local, "group", None)
    if sim is not None:
        return _timed(lambda: sim[0].all_reduce(sim[1], x.float()).to(x.dtype))
    y = x.float().contiguous() if x.dtype in (torch.float16, torch.bfloat16) else x.clone()
    _timed(lambda: dist.all_reduce(y, group=_GROUP[0]))
    return y.to(x.dtype)


@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("specdeploy::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """The `world` ranks' `x` concatenated on `dim`, in rank order."""
    if world == 1:
        return x.clone()
    sim = getattr(_local, "group", None)
    if sim is not None:
        return _timed(lambda: sim[0].all_gather(sim[1], x, dim))
    parts = [torch.empty_like(x) for _ in range(world)]
    _timed(lambda: dist.all_gather(parts, x.contiguous(), group=_GROUP[0]))
    return torch.cat(parts, dim)


@all_gather.register_fake
def _(x, dim, world):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)
