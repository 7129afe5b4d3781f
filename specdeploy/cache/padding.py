"""Pad a decode or verify step to a batch-size bucket, for CUDA-graph replay.

A CUDA graph replays fixed shapes, so (as vLLM and TensorRT-LLM do) graphs are captured for a few
batch sizes and a step of B sequences runs in the smallest bucket >= B, the rest of its rows
dummy sequences. A dummy row must not touch any real sequence: its KV goes to the plan's scratch
page and its recurrent states (main and spec) to the scratch slot, which no sequence is ever
given (cache/plan.py allocates them past the engine's pages and slots). Its cache length is 1,
as if it continued a one-token sequence: host control flow that branches on "has a cached
prefix" (ops/cached_recurrent.py) then takes the same path for every row of a bucket whatever
the mix of real and dummy rows, which a captured graph needs. It attends to the scratch page only
and its logits are dropped by the caller (the real rows come first, `logits[:num_real]`).

NOTE: only steps whose segments all feed the same number of tokens (decode: 1; verify: 1 + K)
and want the same number of logits can be padded; prefill chunks are not (they run eagerly).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specdeploy.cache.metadata import BatchMetadata

# vLLM's default capture sizes start the same way: every small batch, then steps of 8
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
DUMMY_LEN = 1  # a dummy row's cache length (see above)


def buckets_for(max_batch_size: int, sizes: tuple[int, ...] = DEFAULT_BUCKETS
                ) -> tuple[int, ...]:
    """The bucket sizes up to `max_batch_size`, which itself is always one."""
    return tuple(sorted({s for s in sizes if s < max_batch_size} | {max_batch_size}))


def bucket_of(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= num_seqs), None)


def uniform_step(meta: BatchMetadata) -> tuple[int, int] | None:
    """(tokens, logits) per segment when every segment feeds and reads back the same number
    and all are of one kind with no images; else None (the step cannot be padded)."""
    s = meta.num_seqs
    lens = meta.cu_seqlens.diff()
    n = int(lens[0])
    if not bool((lens == n).all()) or meta.logits_idx.numel() % s or meta.mm_rows:
        return None
    if not bool((meta.seg_kind == meta.seg_kind[0]).all()):
        return None
    m = meta.logits_idx.numel() // s
    want = (meta.cu_seqlens[1:, None] - torch.arange(m, 0, -1)[None]).reshape(-1)
    return (n, m) if torch.equal(meta.logits_idx, want) else None


def pad_batch(meta: BatchMetadata, bucket: int, *, scratch_page: int, scratch_slot: int,
              page_size: int, scratch_page_win: int = 0) -> BatchMetadata:
    """`meta` (host tensors, a uniform decode / verify step of S sequences) padded with
    `bucket - S` dummy sequences after the real ones; S == bucket returns `meta` itself.
    The window group's table (cache/window.py), where there is one, likewise: dummy rows on
    its scratch page `scratch_page_win`."""
    s = meta.num_seqs
    if bucket < s:
        raise ValueError(f"pad_batch: bucket {bucket} is smaller than the batch ({s})")
    if bucket == s:
        return meta
    shape = uniform_step(meta)
    if shape is None:
        raise ValueError("pad_batch: segments of different lengths, kinds or logits (only "
                         "decode and verify steps are padded)")
    n, m = shape
    d, t = bucket - s, meta.num_tokens
    long = dict(dtype=torch.long)
    offsets = torch.arange(n, **long).repeat(d)
    width = max(meta.page_table.shape[1], -(-(DUMMY_LEN + n) // page_size))
    table = torch.zeros(bucket, width, **long)
    table[:s, :meta.page_table.shape[1]] = meta.page_table
    table[s:] = scratch_page
    ends = t + n * torch.arange(1, d + 1, **long)
    out = replace(
        meta,
        input_ids=torch.cat([meta.input_ids, torch.zeros(d * n, **long)]),
        position_ids=torch.cat([meta.position_ids, DUMMY_LEN + offsets]),
        cu_seqlens=torch.cat([meta.cu_seqlens, ends]),
        cache_lens=torch.cat([meta.cache_lens, torch.full((d,), DUMMY_LEN, **long)]),
        page_table=table,
        slot_idx=torch.cat([meta.slot_idx, torch.full((d,), scratch_slot, **long)]),
        seg_kind=torch.cat([meta.seg_kind, meta.seg_kind[:1].expand(d)]),
        logits_idx=torch.cat([meta.logits_idx,
                              (ends[:, None] - torch.arange(m, 0, -1)[None]).reshape(-1)]),
        num_tokens=t + d * n, num_seqs=bucket, lists=None)  # the lists are the unpadded step's
    if meta.page_table_win is not None:
        w = meta.page_table_win
        win = torch.zeros(bucket, max(w.shape[1], width), **long)  # (padding: the null page)
        win[:s, :w.shape[1]] = w
        win[s:] = scratch_page_win
        out.page_table_win = win
    if meta.mrope_positions is not None:
        out.mrope_positions = torch.cat([meta.mrope_positions,
                                         (DUMMY_LEN + offsets).expand(3, -1)], 1)
    return out
