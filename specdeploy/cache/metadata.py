"""Per-step batch metadata: the only way engine state enters the deployed graph.

A step runs one flattened ragged batch (no padding): S sequence segments laid end to end, T tokens
in all. A segment is a prefill chunk (possibly continuing a cached prefix), a decode token, or a
speculative *extend* segment (last accepted token + K drafts).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple

import torch

SEG_NORMAL = 0  # prefill / decode: the op updates the main state slot
SEG_EXTEND = 1  # spec verify: per-token states go to the spec-state resource, main state untouched


@dataclass
class Segment:
    """One sequence's contribution to a step (host-side description)."""

    token_ids: Sequence[int]  # tokens fed this step
    cache_len: int  # tokens of this sequence already in the cache (KV and state) before the step
    pages: Sequence[int]  # the sequence's page ids, enough for cache_len + len(token_ids)
    slot: int  # state slot (recurrent layers)
    num_logits: int = 1  # logits wanted for the last `num_logits` tokens (0 = none, mid-prefill)
    kind: int = SEG_NORMAL
    # a request's images (vision/prompt.py MultimodalPrompt): its 3-D mRoPE positions and image
    # feature rows; None for text (positions equal on the three axes)
    mm: object | None = None
    # prefix-cache checkpoints: (offset of a fed token, checkpoint slot) = save the recurrent
    # states after that token (NORMAL segments; cache/prefix.py)
    ckpt: Sequence[tuple[int, int]] = ()
    # the window group's block table (cache/window.py): page ids by page index, 0 = the null
    # page where a page slid out of the window; () when the model has no window group
    win_pages: Sequence[int] = ()


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


@dataclass
class BatchMetadata:
    """Tensors for one step. Shapes: T tokens, S segments, P max pages per segment, N logits."""

    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [S+1] int64, segment s = tokens cu[s]:cu[s+1]
    cache_lens: torch.Tensor  # [S] int64
    page_table: torch.Tensor  # [S, P] int64 (padded with 0)
    slot_idx: torch.Tensor  # [S] int64
    seg_kind: torch.Tensor  # [S] int64 (SEG_NORMAL / SEG_EXTEND)
    logits_idx: torch.Tensor  # [N] int64 indices into T
    num_tokens: int
    num_seqs: int
    # vision-language targets only: [3, T] mRoPE positions (position_ids stays the cache index)
    # and, per segment with images, (first token, MultimodalPrompt, cache_len, tokens) on the host
    mrope_positions: torch.Tensor | None = None
    mm_rows: list | None = None
    # per token, the key positions it sees are < its extent (Gemma 3's image tokens see their
    # whole image; 0: causal); [0] when no token of the step sees past itself. Host only.
    key_extent: torch.Tensor = field(default_factory=_empty)
    ckpt_tokens: torch.Tensor = field(default_factory=_empty)  # [W] host: flat token index
    ckpt_slots: torch.Tensor = field(default_factory=_empty)  # [W]: checkpoint slot
    page_table_win: torch.Tensor | None = None  # [S, Pw] the window group's (0-padded)
    # the lists the tensors were built from (build_metadata only; None after `to`): whoever
    # changes a tensor in place must drop them
    lists: HostLists | None = field(default=None, repr=False, compare=False)

    def __getattr__(self, name: str):
        # Only for attributes not set: build_metadata leaves the tensors to be made from the
        # lists on first read, all at once. A replayed graph's step reads the lists alone (its
        # feed, engine/graph_feed.py), and making ~11 tiny tensors was ~30 us of a step that
        # takes ~0.9 ms on a mid-size hybrid MoE (2-core AVX2).
        if name in _LAZY and self.__dict__.get("lists") is not None:
            _materialize(self)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to(self, device: torch.device | str) -> BatchMetadata:
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return BatchMetadata(
            mv(self.input_ids), mv(self.position_ids), mv(self.cu_seqlens), mv(self.cache_lens),
            mv(self.page_table), mv(self.slot_idx), mv(self.seg_kind), mv(self.logits_idx),
            self.num_tokens, self.num_seqs,
            mrope_positions=None if self.mrope_positions is None else mv(self.mrope_positions),
            mm_rows=self.mm_rows, key_extent=self.key_extent, ckpt_tokens=self.ckpt_tokens,
            ckpt_slots=mv(self.ckpt_slots),
            page_table_win=None if self.page_table_win is None else mv(self.page_table_win),
        )


class HostLists(NamedTuple):
    """The Python lists a step's tensors were built from (build_metadata), so the deployment
    can build its device feed and the KV slot mapping without reading the tensors back."""

    ids: list[int]
    pos: list[int]
    cu: list[int]
    cache_lens: list[int]
    table: list[int]  # [S * P] row-major
    slots: list[int]
    kinds: list[int]
    logits_idx: list[int]
    ckpt_tokens: list[int]
    ckpt_slots: list[int]
    win_table: list[int]  # [S * max_win_pages] row-major; [] without a window group
    max_pages: int
    max_win_pages: int = 0


_LISTS = 11  # HostLists' int lists (flattened into one tensor)


def build_metadata(segments: Sequence[Segment]) -> BatchMetadata:
    """Host-side, once per step (NOTE: the only place that turns Python lists into tensors).
    One `torch.tensor` over every field's list, split into views: a step's metadata is ~10
    tiny tensors, each of which cost a torch call of its own."""
    if not segments:
        raise ValueError("build_metadata: no segments")
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    logits_idx: list[int] = []
    max_pages = max(1, max(len(s.pages) for s in segments))
    table: list[int] = []
    ckpt_tokens: list[int] = []
    ckpt_slots: list[int] = []
    win = any(s.win_pages for s in segments)
    max_win = max(1, max(len(s.win_pages) for s in segments)) if win else 0
    win_table: list[int] = []
    start = 0
    for s in segments:
        n = len(s.token_ids)
        if n == 0:
            raise ValueError("build_metadata: empty segment")
        ids.extend(s.token_ids)
        pos.extend(range(s.cache_len, s.cache_len + n))
        logits_idx.extend(range(start + n - s.num_logits, start + n))
        table.extend(s.pages)
        table.extend([0] * (max_pages - len(s.pages)))
        if win:  # (padding: the null page)
            win_table.extend(s.win_pages)
            win_table.extend([0] * (max_win - len(s.win_pages)))
        for off, slot in s.ckpt:
            ckpt_tokens.append(start + off)
            ckpt_slots.append(slot)
        start += n
        cu.append(start)
    lists = HostLists(ids, pos, cu, [s.cache_len for s in segments], table,
                      [s.slot for s in segments], [s.kind for s in segments], logits_idx,
                      ckpt_tokens, ckpt_slots, win_table, max_pages, max_win)
    meta = BatchMetadata.__new__(BatchMetadata)  # the tensors come on first read (__getattr__)
    meta.__dict__.update(num_tokens=len(ids), num_seqs=len(segments), mrope_positions=None,
                         mm_rows=None, lists=lists)
    if win:  # NOTE: a field with a plain default is found on the class: never lazy
        _materialize(meta)
    else:
        meta.page_table_win = None
    if any(s.mm is not None for s in segments):
        _add_multimodal(meta, segments, cu)
    return meta


# the fields build_metadata leaves to `_materialize`
_LAZY = frozenset({"input_ids", "position_ids", "cu_seqlens", "cache_lens", "page_table",
                   "slot_idx", "seg_kind", "logits_idx", "key_extent", "ckpt_tokens",
                   "ckpt_slots"})


def _materialize(meta: BatchMetadata) -> None:
    """The tensors of a build_metadata step from its lists: one `torch.tensor` over every
    field's list, split into views (each of ~10 tiny tensors cost a torch call of its own)."""
    h = meta.lists
    flat = torch.tensor(list(chain.from_iterable(h[:_LISTS])), dtype=torch.long)
    (t_ids, t_pos, t_cu, t_lens, t_table, t_slots, t_kinds, t_logits, t_ckt,
     t_cks, t_win) = flat.split_with_sizes([len(x) for x in h[:_LISTS]])
    s = meta.num_seqs
    fields = dict(input_ids=t_ids, position_ids=t_pos, cu_seqlens=t_cu, cache_lens=t_lens,
                  page_table=t_table.view(s, h.max_pages), slot_idx=t_slots, seg_kind=t_kinds,
                  logits_idx=t_logits, ckpt_tokens=t_ckt, ckpt_slots=t_cks,
                  page_table_win=t_win.view(s, h.max_win_pages) if h.max_win_pages else None)
    for k, v in fields.items():
        meta.__dict__.setdefault(k, v)  # (_add_multimodal may have set key_extent)
    meta.__dict__.setdefault("key_extent", _empty())


def _add_multimodal(meta: BatchMetadata, segments: Sequence[Segment], cu: list[int]) -> None:
    rows, pos, extents = [], [], []
    for s, start in zip(segments, cu):
        n = len(s.token_ids)
        ext = None
        if s.mm is None:
            pos.append(torch.arange(s.cache_len, s.cache_len + n).expand(3, n))
        else:
            pos.append(s.mm.positions(s.cache_len, n))
            if s.cache_len < s.mm.num_prompt:
                rows.append((start, s.mm, s.cache_len, n))
                ext = s.mm.key_extents(s.cache_len, n)
        extents.append(torch.zeros(n, dtype=torch.long) if ext is None else ext)
    meta.mrope_positions = torch.cat(pos, 1)
    meta.mm_rows = rows
    if any(bool(e.any()) for e in extents):
        meta.key_extent = torch.cat(extents)


def kv_slot_mapping(meta: BatchMetadata, page_size: int, win: bool = False) -> torch.Tensor:
    """Flat KV-cache row (page * page_size + offset) of every fed token: [T] int64.

    Computed once per step; every attention layer writes its new keys there (`win`: the
    window group's layers, through its table).
    """
    if meta.lists is not None:
        return torch.tensor(slot_mapping_list(meta.lists, page_size, win), dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(meta.num_seqs), meta.cu_seqlens.diff(),
                                  output_size=meta.num_tokens)
    pos = meta.position_ids
    table = meta.page_table_win if win else meta.page_table
    return table[seg, pos // page_size] * page_size + pos % page_size


def slot_mapping_list(h: HostLists, page_size: int, win: bool = False) -> list[int]:
    """`kv_slot_mapping` over the host lists, in Python (a decode / verify step has a few
    tokens, where each torch call costs more than the arithmetic)."""
    out: list[int] = []
    p, table = (h.max_win_pages, h.win_table) if win else (h.max_pages, h.table)
    for s in range(len(h.cu) - 1):
        row = table[s * p:(s + 1) * p]
        out.extend(row[q // page_size] * page_size + q % page_size
                   for q in h.pos[h.cu[s]:h.cu[s + 1]])
    return out
