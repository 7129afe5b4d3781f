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
