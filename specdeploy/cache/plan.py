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


def total_bytes(device: torch.device) -> int:
    """All the memory of the device (CUDA) or of the machine (CPU: MemTotal)."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(total)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_budget(max_cache_gib: float | None, gpu_memory_utilization: float | None) -> None:
    """The budget knobs: each in range, and at most one of them (see `cache_budget`)."""
    if max_cache_gib is not None and not max_cache_gib > 0:
        raise ValueError(f"max_cache_gib: must be > 0, got {max_cache_gib!r}")
    u = gpu_memory_utilization
    if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float))
                          or not 0 < u <= 1):
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {u!r}")
    if max_cache_gib is not None and u is not None:
        raise ValueError("gpu_memory_utilization: give it or max_cache_gib, not both")


def cache_budget(device: torch.device, max_cache_gib: float | None = None,
                 gpu_memory_utilization: float | None = None,
                 free_fraction: float = 0.5) -> tuple[int, str]:
    """Bytes the caches may take, and the knob that set them (named in errors).

    `max_cache_gib`: exactly that. `gpu_memory_utilization` (vLLM's knob): the fraction of the
    device's *total* memory this instance may hold, weights included: the caches get
    `u * total - in_use`, `in_use = total - free` measured now, after the weights are on the
    device (memory of other processes counts as in use, so two instances at 0.45 each fit).
    Step activations are not reserved: leave headroom (vLLM's default is 0.9). Neither: half
    of what is free now. The two knobs are exclusive (an error, rather than one silently
    ignored)."""
    check_budget(max_cache_gib, gpu_memory_utilization)
    if max_cache_gib is not None:
        return int(max_cache_gib * GIB), "max_cache_gib"
    free = available_bytes(device)
    if gpu_memory_utilization is None:
        return int(free * free_fraction), "max_cache_gib"  # the knob to set when too small
    total = total_bytes(device)
    in_use = max(0, total - free)
    budget = int(gpu_memory_utilization * total) - in_use
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of {total / GIB:.2f} GiB is "
            f"{gpu_memory_utilization * total / GIB:.2f} GiB, but {in_use / GIB:.2f} GiB are "
            f"already in use on {device}; nothing is left for the cache")
    return budget, "gpu_memory_utilization"


@dataclass
class CachePlan:
    page_size: int
    num_pages: int
    num_slots: int
    budget_bytes: int
    num_checkpoints: int = 0  # prefix-cache checkpoint slots of the recurrent states
    checkpoint_every: int = 1  # pages between two checkpointed page boundaries
    checkpoint_why: str = ""  # why that spacing (summary line)
    bytes_by_handler: dict[str, int] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    kind_by_handler: dict[str, str] = field(default_factory=dict)
    # the sliding-window group (cache/window.py): its pool's pages are 1..num_win_pages; 0 is
    # the null page (never written: freed and padding slots of its block table), then scratch
    num_win_pages: int = 0
    window: int = 0
    win_handlers: tuple[str, ...] = ()
    win_pages_per_seq: int = 0  # what a decoding sequence holds of them at most (sizing)
    # bytes of one page across the group's layers (the groups' pages differ in size: a usage
    # fraction over both weighs them by these)
    page_bytes: int = 0
    win_page_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_handler.values())

    # One page and one state slot past those the engine hands out are allocated too, used by no
    # sequence: the padding rows of a CUDA-graph bucket write there (cache/padding.py).
    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    @property
    def scratch_page_win(self) -> int:
        return self.num_win_pages + 1

    def summary(self) -> str:
        lines = [
            f"cache plan: page_size={self.page_size} num_pages={self.num_pages} "
            f"num_slots={self.num_slots} total={self.total_bytes / 2**20:.2f} MiB "
            f"(budget {self.budget_bytes / 2**20:.2f} MiB; + 1 scratch page and slot, used by no "
            f"sequence; on the CPU the paged KV is reserved, "
            f"its memory backed as pages are first written)"
        ]
        if self.window:
            win = sum(b for n, b in self.bytes_by_handler.items() if n in self.win_handlers)
            lines.append(f"  sliding-window group: {len(self.win_handlers)} layer(s), window "
                         f"{self.window}: {self.num_win_pages} pages (+ null and scratch, "
                         f"{win / 2**20:.3f} MiB), a decoding sequence holds at most "
                         f"{self.win_pages_per_seq}; pages that slide out of every future "
                         f"query's window go back to the pool")
        if "checkpoint" in self.bytes_by_kind:
            pool = self.bytes_by_kind["checkpoint"]
            lines.append(f"  prefix-cache checkpoints: {self.num_checkpoints} slots "
                         f"({pool / 2**20:.3f} MiB), one every {self.checkpoint_every} page(s) "
                         f"= {self.checkpoint_every * self.page_size} tokens"
                         + (f": {self.checkpoint_why}" if self.checkpoint_why else ""))
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


def default_page_size(handlers: list, attention_only: int = 16) -> int:
    """Tokens per KV page when none is asked for: `attention_only` for targets without
    recurrent states; else the smallest multiple of every scan chunk (`State.align`) that is
    at least that, so every page boundary is a chunk boundary and a recurrent checkpoint at
    every page comes free with the prefill scans (vLLM sizes hybrid pages the same way).
    NOTE: the other way round, shrinking the scan chunk to a 16-token page, slows the Mamba2
    prefill scan on CPU (chunk 16: 1.7x the time of chunk 64; bench/scan_chunk.py)."""
    align = math.lcm(1, *(h.align for h in handlers if isinstance(h, State)))
    return align * -(-attention_only // align)


def budget_gib(device: torch.device, max_cache_gib: float | None,
               gpu_memory_utilization: float | None) -> float | None:
    """`max_cache_gib`, or what `gpu_memory_utilization` leaves for the cache, in GiB."""
    if gpu_memory_utilization is None:
        return max_cache_gib
    return cache_budget(device, max_cache_gib, gpu_memory_utilization)[0] / GIB


def plan_cache(
    handlers: list, page_size: int, max_batch_size: int, max_seq_len: int,
    max_cache_gib: float | None, device: torch.device, free_fraction: float = 0.5,
    checkpoint_every: int | None = None, gpu_memory_utilization: float | None = None,
) -> CachePlan:
    """Slots = max_batch_size (every running sequence needs one); pages fill what is left of the
    budget, capped at what max_batch_size sequences of max_seq_len tokens could ever use.
    Prefix-cache checkpoints (`Checkpoint` handlers) take what is left after that, up to one
    per `checkpoint_every` pages: running sequences never lose KV pages to checkpoints, and a
    smaller pool only means fewer recurrent boundaries to hit (LRU, cache/prefix.py).
    `checkpoint_every=None` checkpoints every page when the page size is a multiple of every
    scan chunk (`Checkpoint.align`; `default_page_size` makes it so) and memory holds one per
    page. An unaligned page size falls back to every k pages, k the fewest whose tokens span
    whole chunks: a boundary inside a chunk would cost an extra in-chunk sum and a state copy
    (+70-300 % of the op, bench/scan_chunk.py). A budget too small for one per k pages
    spaces them out further (a multiple of k) rather than leave late pages uncovered.
    The budget: `cache_budget` (max_cache_gib, gpu_memory_utilization, else half the free)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    ckpts = [h for h in handlers if isinstance(h, Checkpoint)]
    auto, why = checkpoint_every is None, ""
    if auto:
        align = math.lcm(1, *(h.align for h in ckpts))
        checkpoint_every = align // math.gcd(align, page_size)
        if checkpoint_every == 1:
            why = "every page boundary is a scan-chunk boundary"
        else:
            why = (f"page_size {page_size} is not a multiple of the scan chunk {align}; "
                   "boundaries inside a chunk would cost extra states")
    if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every: must be a positive integer, got {checkpoint_every!r}")
    kv = [h for h in handlers if isinstance(h, PagedKV) and not h.window]
    win = [h for h in handlers if isinstance(h, PagedKV) and h.window]
    slotted = [h for h in handlers if isinstance(h, (State, SpecState))]
    num_slots = max_batch_size
    slot_bytes = (num_slots + 1) * sum(h.bytes_per_slot() for h in slotted)  # + the scratch
    page_bytes = sum(h.bytes_per_page(page_size) for h in kv)
    pages_per_seq = math.ceil(max_seq_len / page_size)
    wanted_pages = max_batch_size * pages_per_seq + 1 if kv else 0
    budget, knob = cache_budget(device, max_cache_gib, gpu_memory_utilization, free_fraction)
    if slot_bytes > budget:
        raise ValueError(
            f"{knob}: recurrent states for {num_slots} sequences need "
            f"{slot_bytes / GIB:.3f} GiB, over the budget of {budget / GIB:.3f} GiB"
        )
    num_pages = 0
    window = max((h.window for h in win), default=0)
    win_bytes = sum(h.bytes_per_page(page_size) for h in win)
    num_win, per_seq = 0, 0
    if win:
        num_pages, num_win, per_seq = window_split(
            budget - slot_bytes - page_bytes - 2 * win_bytes, page_bytes, win_bytes,
            pages_per_seq, max_batch_size, -(-window // page_size))
    elif kv:
        num_pages = min(wanted_pages, (budget - slot_bytes) // page_bytes - 1)  # - the scratch
    if (kv and num_pages < pages_per_seq) or (win and num_win < pages_per_seq):
        raise ValueError(
            f"{knob}: the budget of {budget / GIB:.3f} GiB holds "
            f"{min(num_pages, num_win) if win and kv else num_win if win else num_pages} KV "
            f"pages; one sequence of max_seq_len={max_seq_len} needs {pages_per_seq}"
        )
    num_ckpt = 0
    if ckpts:
        left = budget - slot_bytes - (num_pages + 1) * page_bytes - (num_win + 2) * win_bytes
        fits = max(0, left // sum(h.bytes_per_slot() for h in ckpts))
        base = checkpoint_every
        while auto and fits and -(-num_pages // checkpoint_every) > fits:
            checkpoint_every += base
        if checkpoint_every != base:
            why = (f"spaced out: the budget holds {fits} checkpoints, one per {base} page(s) "
                   f"would take {-(-num_pages // base)}")
        num_ckpt = min(-(-num_pages // checkpoint_every), fits)
    plan = CachePlan(page_size, int(num_pages), num_slots, budget, int(num_ckpt),
                     checkpoint_every, why, num_win_pages=int(num_win), window=window,
                     win_handlers=tuple(h.name for h in win), win_pages_per_seq=per_seq,
                     page_bytes=page_bytes, win_page_bytes=win_bytes)
    for h in kv:
        plan.bytes_by_handler[h.name] = h.bytes_per_page(page_size) * (plan.num_pages + 1)
    for h in win:
        plan.bytes_by_handler[h.name] = h.bytes_per_page(page_size) * (num_win + 2)
    for h in slotted:
        plan.bytes_by_handler[h.name] = h.bytes_per_slot() * (num_slots + 1)
    for h in ckpts:
        plan.bytes_by_handler[h.name] = h.bytes_per_slot() * plan.num_checkpoints
    for h in kv + win + slotted + ckpts:
        plan.kind_by_handler[h.name] = h.kind
        by_kind = plan.bytes_by_kind
        by_kind[h.kind] = by_kind.get(h.kind, 0) + plan.bytes_by_handler[h.name]
    return plan


def window_split(avail: int, full_bytes: int, win_bytes: int, pages_per_seq: int,
                 max_batch_size: int, window_pages: int) -> tuple[int, int, int]:
    """(full-context pages, window pages, window pages a decoding sequence holds) from `avail`
    bytes (scratch, null pages and states already taken). A decoding sequence holds at most
    its window's pages + 2 (a page partly before the window, the page being written) of the
    window group: the sizing unit; the window group also gets what one max_seq_len prompt
    prefilled in one chunk holds at once (all its pages), so one sequence always fits. Both
    groups capped at what max_batch_size sequences could use; a tighter budget is split so
    the two run out together."""
    per_seq = min(pages_per_seq, window_pages + 2)
    slack = pages_per_seq - per_seq
    want_full = max_batch_size * pages_per_seq + 1 if full_bytes else 0
    want_win = min(max_batch_size * pages_per_seq, max_batch_size * per_seq + slack) + 1
    if want_full * full_bytes + want_win * win_bytes <= avail:
        return want_full, want_win, per_seq
    unit = pages_per_seq * full_bytes + per_seq * win_bytes  # one sequence's worth
    left = max(0, avail - slack * win_bytes)
    full = left * pages_per_seq // unit if full_bytes else 0
    return full, (left - full * full_bytes) // win_bytes + slack, per_seq
