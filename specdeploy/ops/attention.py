"""Causal (optionally sliding-window) grouped-query attention, optionally with attention sinks.

Sinks (gpt-oss): one learned logit per query head that joins every softmax's denominator and
has no value, so a row's weights sum to less than 1: `softmax([scores, sink])[:-1] @ V`.
Equivalently the sink-free output times `sigmoid(lse - sink)`, lse the row's log-sum-exp of
its scores; the kernels here add the sink as a key column instead (exact, no extra rounding
path to keep in sync)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdeploy.ops.autograd import register_recompute_autograd

__all__ = ["attention_ref", "attention_mask", "sink_mask"]


def attention_mask(
    t_q: int, t_k: int, sliding_window: int = 0, device: torch.device | None = None,
    key_extent: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [t_q, t_k] mask, True where query i may attend key j.

    Queries are the last ``t_q`` of the ``t_k`` keys (so a prefix of cached keys is allowed, which
    the cached variants reuse). Window w: query at absolute position p sees keys p-w+1..p.
    `key_extent` [t_q]: query i also sees the keys before position key_extent[i] (a
    bidirectional block, Gemma 3's image; 0: none), the window still bounding it from below.
    """
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    mask = k_pos <= q_pos
    if key_extent is not None:
        mask = mask | (k_pos < key_extent.to(device)[:, None])
    if sliding_window > 0:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int = 0,
    sinks: torch.Tensor | None = None, key_extent: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit softmax attention (the oracle).

    Args:
        q: [B, T, Hq, D]; k: [B, T, Hkv, D]; v: [B, T, Hkv, Dv], Hq % Hkv == 0.
        scale: multiplies q·k. sliding_window: 0 = full causal.
        sinks: [Hq] logits joining each row's softmax denominator (no value), or None.
        key_extent: [T] bidirectional blocks (see `attention_mask`), or None.
    Returns:
        [B, T, Hq, Dv] in q's dtype.
    """
    rep = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(rep, dim=2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    mask = attention_mask(q.shape[1], k.shape[1], sliding_window, q.device, key_extent)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = probs @ vf
    return out.transpose(1, 2).to(q.dtype)


def sink_mask(mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """A boolean mask [..., Tq, Tk] as SDPA's additive float mask [..., Hq, Tq, Tk + 1] for keys
    followed by one zero key (score 0) with a zero value: the added column's mask value is the
    head's sink, so SDPA's softmax sees exactly the sink logit there."""
    add = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    add = add.masked_fill(~mask, float("-inf"))
    add = add.unsqueeze(-3).expand(*mask.shape[:-2], sinks.shape[0], *mask.shape[-2:])
    col = sinks.float().view(-1, 1, 1).expand(*add.shape[:-1], 1)
    return torch.cat((add, col), -1)


def with_zero_key(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` with one zero row appended on `dim` (the sink's key / value)."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat((x, x.new_zeros(shape)), dim)


def attention_fast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA-based attention; same contract as :func:`attention_ref`."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        # NOTE: SDPA's enable_gqa is not implemented by every backend; expanding is always valid.
        kf = kf.repeat_interleave(rep, dim=1)
        vf = vf.repeat_interleave(rep, dim=1)
    if sinks is not None:
        mask = attention_mask(q.shape[1], k.shape[1], sliding_window, q.device)
        out = F.scaled_dot_product_attention(qf, with_zero_key(kf, 2), with_zero_key(vf, 2),
                                             attn_mask=sink_mask(mask, sinks), scale=scale)
    elif sliding_window > 0 and sliding_window < k.shape[1]:
        mask = attention_mask(q.shape[1], k.shape[1], sliding_window, q.device)
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous().to(q.dtype)


def _attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return attention_fast(q, k, v, scale, sliding_window, sinks)


attention = torch.library.custom_op("specdeploy::attention", _attention_kernel, mutates_args=())
register_recompute_autograd(attention, _attention_kernel)


@attention.register_fake
def _attention_fake(q, k, v, scale, sliding_window=0, sinks=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1])
