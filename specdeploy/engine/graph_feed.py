"""The host side of a replayed step (engine/cuda_graphs.py), in Python over the lists the step's
metadata was built from (`HostLists`): whether it can replay, its page-width bucket, and the
flat int64 buffer its graph reads, the padded and widened step's device inputs in their order.

Why: a decode step's tensors are ~10 tiny host tensors, and testing, padding and widening them
with torch ops (`uniform_step`, `pad_batch`, the widened table, `kv_slot_mapping` on tensors,
`torch.cat`) took ~165 us of host time a step here, in a step whose replayed graph is about a
millisecond on a GPU; the same in Python over the lists is a few tens of microseconds. The
tensor path stays for metadata without lists (and the CPU check); a test asserts the two give
the same buffer, width and bucket.
"""
from __future__ import annotations

from specdeploy.cache.metadata import HostLists
from specdeploy.cache.padding import DUMMY_LEN, bucket_of


def uniform_shape(h: HostLists) -> tuple[int, int] | None:
    """`padding.uniform_step` over the lists: (tokens, logits) per segment, or None."""
    cu, s = h.cu, len(h.cu) - 1
    n = cu[1] - cu[0]
    if any(cu[i + 1] - cu[i] != n for i in range(s)) or len(h.logits_idx) % s:
        return None
    if any(k != h.kinds[0] for k in h.kinds):
        return None
    m = len(h.logits_idx) // s
    want = [cu[i + 1] - j for i in range(s) for j in range(m, 0, -1)]
    return (n, m) if h.logits_idx == want else None


def static_width(h: HostLists, n: int, bucket: int, page_size: int,
                 widths: tuple[int, ...]) -> int:
    """The page-table width the padded step replays at (`CudaGraphRunner._static`'s)."""
    pages = max(h.max_pages, h.max_win_pages)  # (the window group's table: the same width)
    if bucket > len(h.cu) - 1:  # dummy rows need the pages of a DUMMY_LEN + n sequence
        pages = max(pages, -(-(DUMMY_LEN + n) // page_size))
    return bucket_of(pages, widths)


def flat_feed(h: HostLists, bucket: int, width: int, *, page_size: int, scratch_page: int,
              scratch_slot: int, mrope: bool, slot_mapping: bool,
              mrope_pos: list[list[int]] | None = None) -> list[int]:
    """input_ids, position_ids (x3 for an mRoPE target: `mrope_pos`, the step's [3][T]
    multimodal positions, or the text positions on every axis), logits_idx, cu_seqlens,
    cache_lens, page_table [bucket, width], slot_idx, ckpt_slots, slot_mapping (when the graph
    reads it): `GraphDeployed.device_inputs` of the padded, widened step, flattened and
    concatenated."""
    s, t = len(h.cu) - 1, h.cu[-1]
    n, m, d = t // s, len(h.logits_idx) // s, bucket - s
    dummy_pos = [DUMMY_LEN + i for i in range(n)]
    ends = [t + n * k for k in range(1, d + 1)]
    pos = h.pos + dummy_pos * d
    p = h.max_pages
    table: list[int] = []
    for i in range(s):
        table += h.table[i * p:(i + 1) * p]
        table += [0] * (width - p)
    table += [scratch_page] * (width * d)
    out = h.ids + [0] * (d * n)
    if mrope:
        for axis in mrope_pos if mrope_pos is not None else (h.pos,) * 3:
            out += axis + dummy_pos * d
    else:
        out += pos
    out += h.logits_idx + [e - j for e in ends for j in range(m, 0, -1)]
    out += h.cu + ends
    out += h.cache_lens + [DUMMY_LEN] * d
    out += table
    out += h.slots + [scratch_slot] * d
    out += h.ckpt_slots
    if slot_mapping:
        for i in range(s):
            row = h.table[i * p:(i + 1) * p]
            out += [row[q // page_size] * page_size + q % page_size
                    for q in h.pos[h.cu[i]:h.cu[i + 1]]]
        out += [scratch_page * page_size + q % page_size for q in dummy_pos] * d
    return out


def flat_feed_win(h: HostLists, bucket: int, width: int, *, page_size: int,
                  scratch_page: int) -> list[int]:
    """The window group's page_table_win [bucket, width] and slot_mapping_win (cache/window.py),
    which follow `flat_feed`'s inputs: real rows padded with the null page 0, dummy rows on the
    group's scratch page."""
    s, t = len(h.cu) - 1, h.cu[-1]
    n, d, p = t // s, bucket - s, h.max_win_pages
    out: list[int] = []
    for i in range(s):
        out += h.win_table[i * p:(i + 1) * p]
        out += [0] * (width - p)
    out += [scratch_page] * (width * d)
    for i in range(s):
        row = h.win_table[i * p:(i + 1) * p]
        out += [row[q // page_size] * page_size + q % page_size
                for q in h.pos[h.cu[i]:h.cu[i + 1]]]
    out += [scratch_page * page_size + (DUMMY_LEN + j) % page_size for j in range(n)] * d
    return out
