from __future__ import annotations

import math

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops.attention import attention_ref


def explicit_attention(q, k, v, scale, window):
    """Independent per-(b, h, i) formula: softmax over allowed keys j in [i-w+1, i]."""
    b, t, hq, _ = q.shape
    rep = hq // k.shape[2]
    out = torch.zeros(b, t, hq, v.shape[-1])
    for h in range(hq):
        for i in range(t):
            lo = 0 if window == 0 else max(0, i - window + 1)
            s = torch.einsum("bd,bjd->bj", q[:, i, h], k[:, lo : i + 1, h // rep]) * scale
            out[:, i, h] = torch.einsum("bj,bjd->bd", s.softmax(-1), v[:, lo : i + 1, h // rep])
    return out


@pytest.mark.parametrize("t", (1, 7, 63, 130))
@pytest.mark.parametrize("hq,hkv,window", [(4, 4, 0), (4, 2, 0), (6, 2, 5), (4, 1, 64)])
def test_attention_matches_explicit(close, t, hq, hkv, window):
    q = torch.randn(2, t, hq, 16)
    k = torch.randn(2, t, hkv, 16)
    v = torch.randn(2, t, hkv, 8)
    scale = 1 / math.sqrt(16)
    out = torch.ops.specdeploy.attention(q, k, v, scale, window)
    if t <= 63:
        close(out, explicit_attention(q, k, v, scale, window))
    close(out, attention_ref(q, k, v, scale, window))


def test_attention_keeps_dtype(close):
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = torch.ops.specdeploy.attention(q, k, v, 0.5, 3)
    assert out.dtype == torch.bfloat16
    close(out.float(), attention_ref(q, k, v, 0.5, 3).float(), rtol=2e-2)
