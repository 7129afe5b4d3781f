from __future__ import annotations

import math

import pytest
import torch

import specdeploy.ops  # noqa: F401
from specdeploy.ops.attention import attention_ref


def explicit_attention(q, k, v, scale, window):
    """Independent per-query formula: softmax over the allowed keys j in [i-w+1, i] only."""
    b, t, hq, _ = q.shape
    kv_head = torch.arange(hq) // (hq // k.shape[2])  # query head h reads kv head h // rep
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    out = torch.zeros(b, t, hq, v.shape[-1])
    for i in range(t):
        lo = 0 if window == 0 else max(0, i - window + 1)
        s = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, lo : i + 1]) * scale
        out[:, i] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v[:, lo : i + 1])
    return out


@pytest.mark.parametrize("t", (1, 7, 63, 130))
@pytest.mark.parametrize("hq,hkv,window", [(4, 4, 0), (4, 2, 0), (6, 2, 5), (4, 1, 64)])
def test_attention_matches_explicit(close, t, hq, hkv, window):
    q = torch.randn(2, t, hq, 16)
    k = torch.randn(2, t, hkv, 16)
    v = torch.randn(2, t, hkv, 8)
    scale = 1 / math.sqrt(16)
    out = torch.ops.specdeploy.attention(q, k, v, scale, window)
    close(out, explicit_attention(q, k, v, scale, window))
    close(out, attention_ref(q, k, v, scale, window))


def test_attention_keeps_dtype(close):
    q, k, v = (torch.randn(1, 9, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = torch.ops.specdeploy.attention(q, k, v, 0.5, 3)
    assert out.dtype == torch.bfloat16
    close(out.float(), attention_ref(q, k, v, 0.5, 3).float(), rtol=2e-2)
