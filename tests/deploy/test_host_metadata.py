"""`build_metadata` builds its tensors from one list, and a deployment its device feed from the
host lists (issue 21): both must equal the construction they replaced, kept here as the oracle,
field by field, for prefill, decode, verify and mixed batches; and no device input may be a
host tensor (DESIGN.md invariant 8)."""
from __future__ import annotations

import random

import pytest
import torch

from specdeploy.cache.metadata import (
    SEG_EXTEND,
    SEG_NORMAL,
    BatchMetadata,
    Segment,
    build_metadata,
    kv_slot_mapping,
)
from specdeploy.deploy import runner as runner_mod


def _old_build(segments) -> BatchMetadata:
    """The construction before issue 21: one `torch.tensor` per field."""
    ids, pos, cu, logits_idx, table, ckpt = [], [], [0], [], [], []
    max_pages = max(1, max(len(s.pages) for s in segments))
    for s in segments:
        n, start = len(s.token_ids), cu[-1]
        ids.extend(s.token_ids)
        pos.extend(range(s.cache_len, s.cache_len + n))
        cu.append(start + n)
        logits_idx.extend(range(start + n - s.num_logits, start + n))
        table.append(list(s.pages) + [0] * (max_pages - len(s.pages)))
        ckpt.extend((start + off, slot) for off, slot in s.ckpt)

    def t(x):
        return torch.tensor(x, dtype=torch.long)

    return BatchMetadata(
        input_ids=t(ids), position_ids=t(pos), cu_seqlens=t(cu),
        cache_lens=t([s.cache_len for s in segments]), page_table=t(table),
        slot_idx=t([s.slot for s in segments]), seg_kind=t([s.kind for s in segments]),
        logits_idx=t(logits_idx), num_tokens=len(ids), num_seqs=len(segments),
        ckpt_tokens=t([c[0] for c in ckpt]), ckpt_slots=t([c[1] for c in ckpt]))


def _old_slot_mapping(meta, page_size):
    seg = torch.repeat_interleave(torch.arange(meta.num_seqs), meta.cu_seqlens.diff(),
                                  output_size=meta.num_tokens)
    pos = meta.position_ids
    return meta.page_table[seg, pos // page_size] * page_size + pos % page_size


def _segment(rng, kind: str, page_size: int) -> Segment:
    cached = rng.randrange(0, 40)
    n = {"prefill": rng.randrange(2, 30), "decode": 1, "verify": rng.randrange(2, 6)}[kind]
    pages = rng.sample(range(1, 200), (cached + n + page_size - 1) // page_size)
    logits = {"prefill": rng.choice([0, 1]), "decode": 1, "verify": n}[kind]
    ckpt = [(n - 1, rng.randrange(4))] if kind == "prefill" and rng.random() < 0.5 else []
    return Segment([rng.randrange(1000) for _ in range(n)], cached, pages, rng.randrange(8),
                   logits, SEG_EXTEND if kind == "verify" else SEG_NORMAL, ckpt=ckpt)


BATCHES = {"prefill": ["prefill"], "decode": ["decode"] * 3, "verify": ["verify"] * 2,
           "mixed": ["prefill", "decode", "verify", "decode", "prefill"]}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("seed", range(5))
def test_build_metadata_equals_old_construction(batch, seed):
    rng = random.Random(seed)
    for page_size in (4, 16):
        segs = [_segment(rng, k, page_size) for k in BATCHES[batch]]
        new, old = build_metadata(segs), _old_build(segs)
        for name, want in vars(old).items():
            got = getattr(new, name)
            if isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.equal(got, want), name
                assert got.is_contiguous(), name
            elif name != "lists":
                assert got == want, name
        assert torch.equal(kv_slot_mapping(new, page_size), _old_slot_mapping(old, page_size))


@pytest.mark.parametrize("batch", list(BATCHES))
def test_device_feed_from_lists_equals_to_device(batch):
    """`GraphDeployed._device_from_lists` = `to_device` of the fields it replaced, and its
    buffer is fresh (shares no storage with the host metadata)."""
    rng = random.Random(7)
    segs = [_segment(rng, k, 16) for k in BATCHES[batch]]
    meta = build_metadata(segs)
    fake = type("G", (), {"_input_names": ["slot_mapping"], "device": torch.device("cpu"),
                          "layout": type("L", (), {"page_size": 16, "num_pages": 8})()})()
    got = runner_mod.GraphDeployed._device_from_lists(fake, meta, meta.lists)
    old = _old_build(segs)
    _ = meta.input_ids  # (its host tensors made: the buffer must share none of them)
    want = runner_mod.to_device({
        "input_ids": old.input_ids[None], "position_ids": old.position_ids[None],
        "logits_idx": old.logits_idx, "cu_seqlens": old.cu_seqlens,
        "cache_lens": old.cache_lens, "page_table": old.page_table, "slot_idx": old.slot_idx,
        "ckpt_slots": old.ckpt_slots, "slot_mapping": _old_slot_mapping(old, 16)},
        torch.device("cpu"))
    assert list(got) == list(want)
    host = {t.untyped_storage().data_ptr() for t in vars(meta).values()
            if isinstance(t, torch.Tensor)}
    for name in want:
        assert got[name].shape == want[name].shape and torch.equal(got[name], want[name]), name
        assert got[name].untyped_storage().data_ptr() not in host, name


def test_metadata_without_lists_falls_back():
    """A BatchMetadata built by hand (or moved with `.to`) has no lists: the tensor paths."""
    segs = [Segment([1, 2, 3], 5, [3, 4], 0, 1)]
    meta = build_metadata(segs).to("cpu")
    assert meta.lists is None
    assert torch.equal(kv_slot_mapping(meta, 4), _old_slot_mapping(_old_build(segs), 4))


def test_tensors_are_made_from_the_lists_on_first_read(monkeypatch):
    """build_metadata makes no tensor until one is read (a replayed step reads the lists
    only); the first read makes them all, once; `replace` and a windowed step see them all."""
    from specdeploy.cache import metadata

    calls = []
    real = metadata._materialize
    monkeypatch.setattr(metadata, "_materialize", lambda m: calls.append(1) or real(m))
    segs = [Segment([1, 2, 3], 5, [3, 4], 0, 1, ckpt=[(2, 1)]), Segment([7], 9, [5, 6], 2, 1)]
    meta = build_metadata(segs)
    assert not calls and "input_ids" not in vars(meta) and meta.num_tokens == 4
    assert meta.lists.ids == [1, 2, 3, 7] and meta.page_table_win is None and not calls
    assert torch.equal(meta.page_table, torch.tensor([[3, 4], [5, 6]])) and calls == [1]
    assert torch.equal(meta.ckpt_tokens, torch.tensor([2])) and calls == [1]
    other = build_metadata(segs)
    moved = __import__("dataclasses").replace(other, num_tokens=4)
    assert torch.equal(moved.input_ids, torch.tensor([1, 2, 3, 7])) and len(calls) == 2
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = other.nope
    win = build_metadata([Segment([1], 5, [3, 4], 0, 1, win_pages=[0, 2])])
    assert "input_ids" in vars(win) and torch.equal(win.page_table_win, torch.tensor([[0, 2]]))
