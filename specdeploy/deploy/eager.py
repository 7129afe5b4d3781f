"""An uncached reference runner: recomputes each sequence's full history every step.

Slow and simple on purpose: the oracle that cached deployments are tested against, and a stand-in
for the engine's tests. Pages are ignored; a slot remembers the tokens fed so far.
"""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.cache.metadata import BatchMetadata
from specdeploy.deploy.base import CacheLayout, StepOutput


class EagerDeployed:
    def __init__(self, model: nn.Module, vocab_size: int, max_seq_len: int, hf_config: dict,
                 layout: CacheLayout):
        self.model = model
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.hf_config = hf_config
        self.layout = layout
        self._history: dict[int, list[int]] = {}

    @torch.inference_mode()
    def forward(self, meta: BatchMetadata) -> StepOutput:
        ids = meta.input_ids.tolist()
        cu = meta.cu_seqlens.tolist()
        rows = []
        for s in range(meta.num_seqs):
            slot = int(meta.slot_idx[s])
            cache_len = int(meta.cache_lens[s])
            hist = self._history.get(slot, [])[:cache_len]
            if len(hist) != cache_len:
                raise RuntimeError(f"slot {slot}: cache_len {cache_len} > known {len(hist)}")
            hist = hist + ids[cu[s]:cu[s + 1]]
            self._history[slot] = hist
            x = torch.tensor([hist])
            rows.append((cu[s], cu[s + 1], self.model(x)[0, cache_len:].float()))
        out = []
        for i in meta.logits_idx.tolist():
            for start, end, logits in rows:
                if start <= i < end:
                    out.append(logits[i - start])
                    break
        return StepOutput(logits=torch.stack(out))


def eager_layout(cfg: dict, max_batch_size: int, max_seq_len: int, page_size: int,
                 max_cache_gib: float | None, elem: int) -> CacheLayout:
    """The eager runner keeps no cache, but the engine still plans pages as if it did (so the
    scheduler behaves as with the real cache): bytes per page = K and V of every layer."""
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", heads) // heads
    kv = cfg.get("num_key_value_heads", heads)
    page_bytes = 2 * cfg.get("num_hidden_layers", 1) * kv * head_dim * page_size * elem
    if max_cache_gib is None:
        num_pages = max_batch_size * -(-max_seq_len // page_size)
    else:
        num_pages = int(max_cache_gib * 2**30 // page_bytes)
    if num_pages < 1:
        raise ValueError(f"max_cache_gib: {max_cache_gib} GiB holds no page of {page_bytes} bytes")
    return CacheLayout(page_size, num_pages, max_batch_size, {"kv_eager_estimate":
                                                              num_pages * page_bytes})
