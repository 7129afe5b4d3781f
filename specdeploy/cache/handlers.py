"""Resource handlers: what a cached op declares it needs; `cache/plan.py` sizes and allocates.

NOTE: handlers are per layer; a handler knows its bytes per page (paged KV) or per slot (states),
so the plan can split a memory budget without knowing what kind of layer asked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedKV:
    """One attention layer's K and V pages: 2 × [num_pages, page_size, Hkv, D]; with
    `value_in_key` the values are the keys' leading v_head_dim dims (MLA's latent), stored once:
    the V pages are a view of the K pages. `window` > 0: a sliding-window layer in the window
    page group (its own block table and pool; cache/window.py), 0: the full-context group."""

    name: str
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    kind: str = "paged_kv"
    value_in_key: bool = False
    window: int = 0

    def bytes_per_page(self, page_size: int) -> int:
        width = self.head_dim + (0 if self.value_in_key else self.v_head_dim)
        return _nbytes((page_size, self.num_kv_heads, width), self.dtype)

    def allocate(self, num_pages: int, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        k = lazy_zeros((num_pages, page_size, self.num_kv_heads, self.head_dim), self.dtype,
                       device)
        if self.value_in_key:
            return k, k[..., :self.v_head_dim]
        v = lazy_zeros((num_pages, page_size, self.num_kv_heads, self.v_head_dim), self.dtype,
                       device)
        return k, v


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros that take memory as they are written. On the CPU: fresh anonymous memory, whose
    pages the OS backs only when first written, so a KV cache planned for max_batch_size x
    max_seq_len costs what the sequences actually fill (its pages are handed out in order;
    resident memory grows with use up to the plan, never past it). Elsewhere torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    n = math.prod(shape)
    size = torch.empty((), dtype=dtype).element_size()
    # NOTE: private, so a forked process gets its own copy on write, never a shared cache
    buf = mmap.mmap(-1, max(size, n * size), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)[:n].view(shape)


@dataclass(frozen=True)
class State:
    """A per-sequence recurrent state slot: [num_slots, *shape] (SSM, conv window, GDN)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    align: int = 1  # the op's scan chunk: its states at multiples of it come free (Checkpoint)
    kind: str = "state"

    def bytes_per_slot(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def allocate(self, num_slots: int, device) -> torch.Tensor:
        return torch.zeros(num_slots, *self.shape, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class SpecState:
    """Per-token states of a verify step: [num_slots, cache_steps = K+1, *shape]; `shadows` names
    the `State` whose slot a commit overwrites with one of these entries."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    cache_steps: int
    shadows: str
    kind: str = "spec_state"

    def bytes_per_slot(self) -> int:
        return self.cache_steps * _nbytes(self.shape, self.dtype)

    def allocate(self, num_slots: int, device) -> torch.Tensor:
        return torch.zeros(num_slots, self.cache_steps, *self.shape, dtype=self.dtype,
                           device=device)


@dataclass(frozen=True)
class Checkpoint:
    """Prefix-cache checkpoints of one recurrent `State` (`of`): [num_checkpoints, *shape], the
    state after the last token of a cached page (cache/prefix.py). Pool size: `cache/plan.py`."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    of: str
    align: int = 1  # the op's scan chunk: boundaries every `align` tokens cost no extra state
    kind: str = "checkpoint"

    def bytes_per_slot(self) -> int:
        return _nbytes(self.shape, self.dtype)

    def allocate(self, num_checkpoints: int, device) -> torch.Tensor:
        return torch.zeros(num_checkpoints, *self.shape, dtype=self.dtype, device=device)


@dataclass(frozen=True)
class HiddenStates:
    """Captured target features for drafters: [max_tokens, width] (filled every step)."""

    name: str
    width: int
    dtype: torch.dtype
    kind: str = "hidden_states"
