"""One rank's slice of a parameter for the `shard` transform (deploy/passes/shard.py): the cut a
`tp_param` hint asks for, read from a lazy checkpoint where the weight is lazy, and the same cut
of a pre-quantized (FP8 / NVFP4) weight's quantized tensors and scales."""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.checkpoint.lazy import LazyWeights
from specdeploy.distributed.config import DistConfig
from specdeploy.ops.shard import seg_index, segs_of


def hint_name(node: fx.Node) -> str:
    src = node.args[0]
    return f"{node.args[1]} {getattr(src, 'target', src)}"


def slice_param(w: torch.Tensor, node: fx.Node, d: DistConfig, lazy: LazyWeights | None,
                 prequant: dict | None = None, slices: dict | None = None,
                 ggml: dict | None = None, ggml_slices: list | None = None) -> torch.Tensor:
    """The rank's slice of `w` for one `tp_param` hint (of a lazy `w`: read just for this).
    `prequant` (tensor identity -> (quantized weight, input scale)): a pre-quantized `w`'s
    quantized tensors are cut alike, recorded in `slices` under the slice's identity. `ggml`
    (tensor identity -> GGMLWeight): a GGUF weight's blocks are cut alike where the cut keeps
    whole blocks, appended to `ggml_slices` as (slice, blocks)."""
    _, layer_type, mode, dim, sizes, units, leads = node.args
    if not w.is_floating_point():  # a pre-quantized weight would need its scales sliced too
        raise ValueError(f"shard: {hint_name(node)} is {w.dtype}; only floating-point weights "
                         "shard")
    dim = dim % w.dim()
    if not sizes:  # a rowwise bias: added once, by rank 0
        if d.rank != 0:
            return torch.zeros(w.shape, dtype=w.dtype, device=w.device)
        return read_slice(w, lambda full: full.detach().clone(), lazy)
    tp, rank, lo, hi = d.tp_size, d.rank, 0, w.shape[0]
    if mode.startswith("expert_"):
        e = w.shape[0]
        if e % d.ep_size:
            raise ValueError(f"shard: {hint_name(node)}: {e} experts do not divide over "
                             f"expert_parallel_size={d.ep_size}")
        k, ep_rank = e // d.ep_size, d.rank // d.moe_tp
        lo, hi = ep_rank * k, (ep_rank + 1) * k
        tp, rank = d.moe_tp, d.rank % d.moe_tp
    if sum(sizes) != w[lo:hi].shape[dim]:
        raise RuntimeError(f"shard: {hint_name(node)}: segments {sizes} != dim {dim} of "
                           f"{tuple(w[lo:hi].shape)}")
    idx = torch.tensor([i for part in seg_index(segs_of(sizes, units, leads), tp, rank,
                                                 hint_name(node)) for i in part], device=w.device)
    out = read_slice(w, lambda full: full.detach()[lo:hi].index_select(dim, idx).contiguous(), lazy)
    blocks = None if ggml is None else ggml.get(prequant_key(w))
    if blocks is not None:
        cut = slice_blocks(blocks, w.dim(), (lo, hi) if mode.startswith("expert_") else None,
                           dim, idx)
        if cut is not None:
            ggml_slices.append((out, cut))
    hit = None if prequant is None else prequant.get(prequant_key(w))
    if hit is not None:
        qw = slice_quantized(hit[0], w.dim(), (lo, hi) if mode.startswith("expert_") else None,
                             dim, idx, hint_name(node))
        slices[prequant_key(out)] = (qw, hit[1])
    return out


def prequant_key(t: torch.Tensor) -> tuple:
    """A tensor's identity as deploy/passes/prequantized.py matches weights."""
    return (t.data_ptr(), tuple(t.shape), t.stride())


def _index(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """index_select for 1-byte float types too (as bytes)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(dim, idx).view(t.dtype).contiguous()
    return t.index_select(dim, idx).contiguous()


def _groups(idx: torch.Tensor, size: int, what: str, of: str) -> torch.Tensor:
    """The group indices of `idx` when it is made of whole, aligned groups of `size` columns;
    else a clear error (a rowwise cut through a scale group cannot be sharded)."""
    n = idx.numel()
    runs = idx.reshape(-1, size) if n % size == 0 else None
    if runs is None or bool((runs[:, 0] % size).any()) or not torch.equal(
            runs, runs[:, :1] + torch.arange(size, device=idx.device)):
        raise ValueError(f"shard: {what}: the rank's input columns cut through {of} of {size}; "
                         f"this tensor_parallel_size cannot shard this pre-quantized weight")
    return runs[:, 0] // size


def slice_quantized(qw, w_dims: int, experts: tuple[int, int] | None, dim: int,
                    idx: torch.Tensor, what: str):
    """The rank's cut of a pre-quantized weight (ops/fp8_linear.Fp8Weight [.., N, K] with row
    scales [.., N, G]; ops/nvfp4_linear.Nvfp4Weight [.., N, K/2] with [.., N, K/16] scales and
    per-row [.., N] or one scale_2), for the fp weight's cut: `experts` (lo, hi) on dim 0, then
    `idx` on `dim` (N: rows of everything; K: columns, whole scale groups / nibble pairs)."""
    from specdeploy.ops.fp8_linear import Fp8Weight
    from specdeploy.ops.nvfp4_linear import GROUP, Nvfp4Weight

    def lead(t):
        return t[experts[0]:experts[1]] if experts is not None and t.dim() == w_dims else t

    rows = dim == w_dims - 2
    if isinstance(qw, Fp8Weight):
        weight, scale = lead(qw.weight), lead(qw.scale)
        if rows:
            return Fp8Weight(_index(weight, dim, idx), _index(scale, dim, idx), qw.block_k)
        g = scale.shape[-1]
        scale = scale.contiguous() if g == 1 else _index(
            scale, dim, _groups(idx, qw.block_k, what, "FP8 scale groups"))
        return Fp8Weight(_index(weight, dim, idx), scale, qw.block_k)
    if isinstance(qw, Nvfp4Weight):
        weight, scale, s2 = lead(qw.weight), lead(qw.scale), qw.scale_2
        if experts is not None and s2.dim() == w_dims - 1:
            s2 = s2[experts[0]:experts[1]]
        if rows:
            per_row = s2.dim() == w_dims - 1
            return Nvfp4Weight(_index(weight, dim, idx), _index(scale, dim, idx),
                               _index(s2, dim, idx) if per_row else s2)
        pairs = _groups(idx, 2, what, "FP4 nibble pairs")
        groups = _groups(idx, GROUP, what, "NVFP4 scale groups")
        return Nvfp4Weight(_index(weight, dim, pairs), _index(scale, dim, groups), s2)
    raise ValueError(f"shard: {what}: unknown pre-quantized weight {type(qw).__name__}")


def slice_blocks(gw, w_dims: int, experts: tuple[int, int] | None, dim: int,
                 idx: torch.Tensor):
    """The rank's cut of a GGUF weight's blocks (ops/ggml_linear.GGMLWeight [.., N, K] as
    [.., N, K / QK * size] bytes) for the fp weight's cut: `experts` (lo, hi) on dim 0, then
    `idx` on `dim` (N: block rows; K: whole blocks, in the stored column order). None where the
    cut splits a block (that weight keeps its fp32 slice)."""
    from specdeploy.ops.ggml_linear import KINDS, GGMLWeight, block_values

    blocks, shape, gather = gw.blocks, list(gw.shape), gw.gather
    if experts is not None and blocks.dim() == w_dims:
        blocks = blocks[experts[0]:experts[1]]
        shape[0] = experts[1] - experts[0]
    if dim == w_dims - 2:  # output rows
        shape[dim] = idx.numel()
        return GGMLWeight(gw.kind, blocks.index_select(dim, idx).contiguous(), tuple(shape),
                          gather)
    qk, size = block_values(gw.kind), KINDS[gw.kind][1]
    # the stored columns of the rank's input columns (W[:, j] = stored[:, cols[j]])
    cols = idx if gather is None else torch.argsort(gather)[idx]
    stored, order = cols.sort()
    n = stored.numel()
    runs = stored.reshape(-1, qk) if n % qk == 0 else None
    if runs is None or bool((runs[:, 0] % qk).any()) or not torch.equal(
            runs, runs[:, :1] + torch.arange(qk)):
        return None
    byte_idx = ((runs[:, :1] // qk) * size + torch.arange(size)).reshape(-1)
    shape[dim] = n
    # the rank's columns in the stored order: x_local[..., order] (GGMLWeight.gather)
    local = None if torch.equal(order, torch.arange(n)) else order
    return GGMLWeight(gw.kind, blocks.index_select(dim, byte_idx).contiguous(), tuple(shape),
                      local)


def read_slice(w: torch.Tensor, fn, lazy: LazyWeights | None) -> torch.Tensor:
    return lazy.slice(w, fn) if lazy is not None and lazy.is_lazy(w) else fn(w)
