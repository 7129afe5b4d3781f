"""Size caches from a memory budget and allocate them; report bytes per handler."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from specdeploy.cache.handlers import Checkpoint, PagedKV, SpecState, State

GIB = 1 << 30


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


@dataclass
class CachePlan:
    page_size: int
    num_pages: int
    num_slots: int
    budget_bytes: int
    num_checkpoints: int = 0  # prefix-cache checkpoint slots of the recurrent states
    checkpoint_every: int = 1  # pages between two checkpointed page boundaries
    bytes_by_handler: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    kind_by_handler: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_handler.values())

    def summary(self) -> str:
        lines = [
            f"cache plan: page_size={self.page_size} num_pages={self.num_pages} "
            f"num_slots={self.num_slots} total={self.total_bytes / 2**20:.2f} MiB "
            f"(budget {self.budget_bytes / 2**20:.2f} MiB; on the CPU the paged KV is reserved, "
            f"its memory backed as pages are first written)"
        ]
        if "checkpoint" in self.bytes_by_kind:
            lines.append(f"  prefix-cache checkpoints: {self.num_checkpoints} slots, one every "
                         f"{self.checkpoint_every} page(s)")
        for kind, b in sorted(self.bytes_by_kind.items()):
            share = b / self.total_bytes if self.total_bytes else 0.0
            lines.append(f"  {kind:<12} {b / 2**20:10.3f} MiB  ({share:.1%})")
            lines += self._handler_lines(kind)
        return "\n".join(lines)

    def _handler_lines(self, kind: str) -> list[str]:
        """Handlers of one kind, runs of equal size folded: `30 × 409,600 B  kv_cache_0 … 29`."""
        groups: dict[int, list[str]] = {}
        for name, b in self.bytes_by_handler.items():
            if self.kind_by_handler.get(name) == kind:
                groups.setdefault(b, []).append(name)
        out = []
        for b, names in groups.items():
            shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} … {names[-1]}"
            out.append(f"    {len(names):3d} × {b:,} B  {shown}")
        return out


def plan_cache(
    handlers: list, page_size: int, max_batch_size: int, max_seq_len: int,
    max_cache_gib: float | None, device: torch.device, free_fraction: float = 0.5,
    checkpoint_every: int | None = None,
) -> CachePlan:
    """Slots = max_batch_size (every running sequence needs one); pages fill what is left of the
    budget, capped at what max_batch_size sequences of max_seq_len tokens could ever use.
    Prefix-cache checkpoints (`Checkpoint` handlers) take what is left after that, up to one
    per `checkpoint_every` pages: running sequences never lose KV pages to checkpoints, and a
    smaller pool only means fewer recurrent boundaries to hit (LRU, cache/prefix.py).
    `checkpoint_every=None` checkpoints every k pages, k the fewest whose tokens are a multiple
    of every scan chunk (`Checkpoint.align`): those boundary states cost no extra compute,
    where a boundary inside a chunk costs an extra in-chunk sum and a full state copy
    (bench/prefix_cache.py measures both)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    ckpts = [h for h in handlers if isinstance(h, Checkpoint)]
    if checkpoint_every is None:
        align = math.lcm(1, *(h.align for h in ckpts))
        checkpoint_every = align // math.gcd(align, page_size)
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: must be a positive integer, got {checkpoint_every!r}")
    kv = [h for h in handlers if isinstance(h, PagedKV)]
    slotted = [h for h in handlers if isinstance(h, (State, SpecState))]
    num_slots = max_batch_size
    slot_bytes = num_slots * sum(h.bytes_per_slot() for h in slotted)
    page_bytes = sum(h.bytes_per_page(page_size) for h in kv)
    pages_per_seq = math.ceil(max_seq_len / page_size)
    wanted_pages = max_batch_size * pages_per_seq + 1 if kv else 0
    if max_cache_gib is not None:
        if max_cache_gib <= 0:
            raise ValueError(f"max_cache_gib must be > 0, got {max_cache_gib}")
        budget = int(max_cache_gib * GIB)
    else:
        budget = int(available_bytes(device) * free_fraction)
    if slot_bytes > budget:
        raise ValueError(
            f"max_cache_gib: recurrent states for {num_slots} sequences need "
            f"{slot_bytes / GIB:.3f} GiB, over the budget of {budget / GIB:.3f} GiB"
        )
    num_pages = 0
    if kv:
        num_pages = min(wanted_pages, (budget - slot_bytes) // page_bytes)
        if num_pages < pages_per_seq:
            raise ValueError(
                f"max_cache_gib: the budget of {budget / GIB:.3f} GiB holds {num_pages} KV pages; "
                f"one sequence of max_seq_len={max_seq_len} needs {pages_per_seq}"
            )
    num_ckpt = 0
    if ckpts:
        left = budget - slot_bytes - num_pages * page_bytes
        num_ckpt = max(0, min(-(-num_pages // checkpoint_every),
                              left // sum(h.bytes_per_slot() for h in ckpts)))
    plan = CachePlan(page_size, int(num_pages), num_slots, budget, int(num_ckpt),
                     checkpoint_every)
    for h in kv:
        plan.bytes_by_handler[h.name] = h.bytes_per_page(page_size) * plan.num_pages
    for h in slotted:
        plan.bytes_by_handler[h.name] = h.bytes_per_slot() * num_slots
    for h in ckpts:
        plan.bytes_by_handler[h.name] = h.bytes_per_slot() * plan.num_checkpoints
    for h in kv + slotted + ckpts:
        plan.kind_by_handler[h.name] = h.kind
        by_kind = plan.bytes_by_kind
        by_kind[h.kind] = by_kind.get(h.kind, 0) + plan.bytes_by_handler[h.name]
    return plan
