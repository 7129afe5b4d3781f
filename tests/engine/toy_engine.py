"""A toy causal model behind the eager runner: engine tests need no real checkpoint."""
from __future__ import annotations

import torch
from torch import nn

from specdeploy.deploy.base import CacheLayout
from specdeploy.deploy.eager import EagerDeployed
from specdeploy.engine import Engine

VOCAB = 40


class ToyModel(nn.Module):
    """logits[t] depend on every token up to t (a normalized running sum), so any cache or
    scheduling bug changes the tokens."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Parameter(torch.randn(vocab, dim, generator=g))
        self.pos = nn.Parameter(torch.randn(dim, generator=g))
        self.out = nn.Parameter(torch.randn(dim, vocab, generator=g) * 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb[input_ids]
        t = torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype)[None, :, None]
        h = torch.tanh(x.cumsum(1) / t.sqrt() + self.pos * t.log1p())
        return h @ self.out


class CharTokenizer:
    """id i ↔ one letter; enough for stop strings and text checks."""

    eos_token_ids = (0,)

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]


def make_engine(num_pages: int = 64, page_size: int = 4, max_batch_size: int = 8,
                max_num_tokens: int = 64, max_seq_len: int = 128, tokenizer=None,
                eos_token_ids=()) -> Engine:
    layout = CacheLayout(page_size, num_pages, max_batch_size)
    deployed = EagerDeployed(ToyModel(), VOCAB, max_seq_len, {}, layout)
    return Engine(deployed, tokenizer, max_batch_size=max_batch_size,
                  max_num_tokens=max_num_tokens, eos_token_ids=eos_token_ids)


def run_all(engine: Engine, prompts, params) -> list:
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(10_000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == len(ids):
            break
    assert not engine.has_unfinished()
    return [done[i] for i in ids]
