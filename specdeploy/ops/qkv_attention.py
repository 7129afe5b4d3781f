"""`qkv_attention`: a Llama-type layer's attention from its fused q/k/v projection in one op,
RoPE on q and k, the new keys and values into the paged cache, paged attention.

What it replaces (`deploy/passes/fuse_attention.py` matches it): three slices of the fused
projection, three views, two `rope` calls and one `cached_attention`, nine graph nodes a layer
whose torch dispatch and Python cost more than their arithmetic at decode sizes. On the CPU,
where the C attention kernel fits (then `cached_attention` attends every segment row by row:
decode, verify and prefill chunks alike), it is two C calls: RoPE over the q and k heads of
every token at once (row_kernels.c, the same function `rope` runs), then the cache writes and
attention (attention_rows.c's `write_attend_rows`, the same per-(row, head) code as `_rows`).
So it gives the unfused chain's bits exactly (sliding windows included); anything else (other
dtypes or devices) runs that chain itself (`qkv_attention_ref`).
Without RoPE (cos and sin None: NemotronH's attention layers) the q and k heads go to the
cache writes and attention as they are (a copy where a verify step's rows lie apart).
Attention sinks (gpt-oss: `sinks` [Hq]) go to the same C call as `cached_attention` gives them;
where it does not fit, the chain runs `cached_attention` itself (its torch sink paths).
"""
from __future__ import annotations

import torch

from specdeploy.ops import attention_rows, gpu_kernels, row_kernels
from specdeploy.ops.cached_attention import cached_attention, cached_attention_impl
from specdeploy.ops.rope import _rope_kernel

__all__ = ["qkv_attention_ref"]
_I64, _F32 = torch.int64, torch.float32


def qkv_attention_ref(qkv, cos, sin, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                      cache_lens_host, page_table, scale, sliding_window, slot_mapping, hq, hkv,
                      d, sinks=None):
    """The unfused chain: qkv [1, T, >= (Hq + Hkv) * D + Hkv * Dv] (q, k, v, maybe more) ->
    [1, T, Hq, Dv], Dv the value cache's head size; sinks [Hq] or None."""
    t, kv0, dv = qkv.shape[1], (hq + hkv) * d, v_cache.shape[-1]
    q = qkv[..., :hq * d].view(1, t, hq, d)
    k = qkv[..., hq * d:kv0].view(1, t, hkv, d)
    v = qkv[..., kv0:kv0 + hkv * dv].view(1, t, hkv, dv)
    if cos is not None:
        q, k = _rope_kernel(q, cos, sin), _rope_kernel(k, cos, sin)
    if sinks is not None:  # (the op's own choice of path for sinks)
        return cached_attention(q, k, v, k_cache, v_cache, cu_seqlens, cu_seqlens_host,
                                cache_lens, cache_lens_host, page_table, scale, sliding_window,
                                slot_mapping, sinks)
    return cached_attention_impl(q, k, v,
                                 k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                                 cache_lens_host, page_table, scale, sliding_window,
                                 slot_mapping)


def _fast(qkv, cos, sin, k_cache, v_cache, cu_host, lens_host, page_table, slot_mapping,
          sliding_window, hq, hkv, d) -> bool:
    if (slot_mapping is None or qkv.dtype is not _F32 or qkv.dim() != 3
            or qkv.shape[0] != 1 or qkv.stride(-1) != 1 or qkv.device.type != "cpu"):
        return False
    if cos is None:
        if sin is not None:
            return False
    elif (cos.dtype is not _F32 or sin.dtype is not _F32 or cos.dim() != 3
            or cos.shape[-1] % 2 or cos.shape[-1] > d or tuple(cos.shape[:2]) != (1, qkv.shape[1])
            or sin.shape != cos.shape):
        return False
    if k_cache.shape[2] != hkv or k_cache.shape[-1] != d or qkv.shape[-1] < (
            (hq + hkv) * d + hkv * v_cache.shape[-1]):
        return False
    if torch.is_grad_enabled() and (qkv.requires_grad or (cos is not None and cos.requires_grad)):
        return False
    return _step_fits(cu_host, lens_host, page_table, slot_mapping, k_cache, v_cache, hq, d)


_last_step: list = [None, None]  # (the step's slot_mapping, its verdict)


def _step_fits(cu_host, lens_host, page_table, slot_mapping, k_cache, v_cache, hq, d) -> bool:
    """The checks that depend on the step's metadata and the caches only: every layer of a step
    gets the same, so the verdict is kept for the step's slot_mapping (held, so its id cannot be
    reused) and the layers' shared cache layout. A model whose layers differ in cache dtype or
    head size re-checks per layer (the key includes them)."""
    key = (k_cache.dtype, tuple(k_cache.shape[1:]), v_cache.shape[-1], hq, d)
    if _last_step[0] is slot_mapping and _last_step[1][0] == key:
        return _last_step[1][1]
    ok = (all(x.dtype is _I64 and x.is_contiguous() and x.device.type == "cpu"
              for x in (cu_host, lens_host, page_table, slot_mapping))
          and row_kernels._library() is not None
          and attention_rows.fits(slot_mapping.new_empty(0, hq, d, dtype=_F32), k_cache, v_cache))
    _last_step[0], _last_step[1] = slot_mapping, (key, ok)
    return ok


def _qkv_attention_kernel(qkv: torch.Tensor, cos: torch.Tensor | None,
                          sin: torch.Tensor | None,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
                          cu_seqlens_host: torch.Tensor, cache_lens: torch.Tensor,
                          cache_lens_host: torch.Tensor, page_table: torch.Tensor, scale: float,
                          sliding_window: int, slot_mapping: torch.Tensor | None, hq: int,
                          hkv: int, d: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    # a uniform step (decode, verify) with RoPE: Triton (gpu_kernels; no sinks there)
    if cos is not None and sinks is None and gpu_kernels.candidate(qkv):
        out = gpu_kernels.qkv_attention(qkv, cos, sin, k_cache, v_cache, cu_seqlens_host,
                                        cache_lens_host, page_table, cache_lens, scale,
                                        sliding_window, slot_mapping, hq, hkv, d)
        if out is not None:
            return out
    if not _fast(qkv, cos, sin, k_cache, v_cache, cu_seqlens_host, cache_lens_host, page_table,
                 slot_mapping, sliding_window, hq, hkv, d):
        return qkv_attention_ref(qkv, cos, sin, k_cache, v_cache, cu_seqlens, cu_seqlens_host,
                                 cache_lens, cache_lens_host, page_table, scale, sliding_window,
                                 slot_mapping, hq, hkv, d, sinks)
    t = qkv.shape[1]
    if cos is None:  # the q and k heads as they are: [T, Hq + Hkv, D] rows
        qk = qkv[0, :, :(hq + hkv) * d].contiguous().view(t, hq + hkv, d)
    else:
        c, s = cos.contiguous(), sin.contiguous()
        qk = torch.empty(t, hq + hkv, d, dtype=_F32)
        row_kernels._library().rope_rows(qkv.data_ptr(), t, hq + hkv, d, qkv.stride(1),
                                         c.data_ptr(), s.data_ptr(), c.shape[-1], qk.data_ptr(),
                                         torch.get_num_threads())
    out = attention_rows.write_attend_rows(qk, qkv, (hq + hkv) * d, k_cache, v_cache,
                                           slot_mapping, cu_seqlens_host, cache_lens_host,
                                           page_table, scale, sliding_window, sinks)
    return out[None]


qkv_attention = torch.library.custom_op("specdeploy::qkv_attention", _qkv_attention_kernel,
                                        mutates_args=("k_cache", "v_cache"), device_types=None)


@qkv_attention.register_fake
def _qkv_attention_fake(qkv, cos, sin, k_cache, v_cache, cu_seqlens, cu_seqlens_host,
                        cache_lens, cache_lens_host, page_table, scale, sliding_window,
                        slot_mapping, hq, hkv, d, sinks=None):
    # (named, not by position: an argument added later, like sinks, cannot shift hq)
    return qkv.new_empty(1, qkv.shape[1], hq, v_cache.shape[-1])
