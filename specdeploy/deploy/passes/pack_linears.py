"""Pre-pack fp32 linear weights for oneDNN on the CPU.

`aten.linear` hands a row-major weight to the BLAS, which re-packs it on every call once the
input has more than one row: a 4-token verify step then cost ~2x a 1-token decode step although
both stream the same weights. Here each large fp32 weight gets a oneDNN blocked copy made once,
which every call of 2+ rows multiplies. One row keeps the plain GEMV on one thread; with more
threads it takes the packed weight too (the BLAS's GEMV ran on one thread in earlier torch
builds; 2.13's threads it, and the two are even there).

`python bench/linear_rows.py --threads 2 --reps 3 --rows 1 2 4 6 --only plain w_xt packed`
(2-core AVX-512 Xeon, torch 2.13, 2026-12-06; ms for 30 layers of SmolLM2-sized weights, cold
caches), plain / W @ x^T / packed: 1 row 21.0 / 22.0 / 22.4; 2 rows 22.9 / 45.7 / 27.8; 4 rows
35.8 / 47.6 / 29.6; 6 rows 39.4 / 48.4 / 33.5. On hybrid-demo's tied 49,152 x 256 LM head W @ x^T
took 4.4 ms at 2-4 rows against 1.4 ms packed: a verify step paid 3x its decode step's head.
An earlier build of this pass sent 2-4 rows to W @ x^T (faster on the machine and torch of its
measurement: bench/results/linear_rows.json); it stays only where nothing was packed (the
weights' copies would not fit), as there it still reads the weight once. bench/spec_step.py
--default-model measures the end-to-end verify step with and without this pass.

The packed weight lives in a closure, not a buffer: it is an opaque oneDNN tensor (no slicing,
no state_dict), and the graph's buffers stay what the cache code and tests expect. Skipped
when the graph is compiled (inductor packs for itself), off the CPU, for non-fp32 weights, and
where this torch has no oneDNN.
"""
from __future__ import annotations

import os

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import gpu_kernels

_LINEAR = torch.ops.aten.linear.default
SKINNY_ROWS = 4  # without a packed copy, up to here W @ x^T; above, the plain linear
# Smaller weights stay cache-resident, where the extra call and copy cost more than they save
# (tiny test models measured slower with them).
MIN_ELEMENTS = 1 << 18


def packed_linear_fn(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True):
    """A function x -> linear(x, weight, bias): a oneDNN-packed copy of `weight` at every row
    count (one row on one thread: the plain GEMV). `pack=False`: the plain GEMV at one row,
    W @ x^T up to SKINNY_ROWS, the plain linear above."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if pack else None
    bias = None if bias is None else bias.detach()
    out_features = weight.shape[0]
    pointwise = torch.ops.mkldnn._linear_pointwise

    linear = torch.nn.functional.linear
    w = weight.detach()

    def packed_linear(x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if m == 1 and (packed is None or torch.get_num_threads() == 1):
            return linear(x, w, bias)  # a GEMV: on one thread the plain one is fastest
        if packed is not None:
            y = pointwise(x2, packed, bias, "none", [], "")
        elif m <= SKINNY_ROWS:
            # W @ x^T streams the weight once like a GEMV does (see the module note)
            y = torch.mm(w, x2.t()).t().contiguous()
            if bias is not None:
                y = y + bias
        else:
            return linear(x, w, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)

    return packed_linear


def packable(w: torch.Tensor | None) -> bool:
    return (w is not None and w.device.type == "cpu" and w.dtype == torch.float32
            and w.dim() == 2 and not w.requires_grad and w.numel() >= MIN_ELEMENTS)


def _skip(ctx: DeployContext) -> str | None:
    if ctx.compile:
        return "compile=True: inductor packs weights itself"
    if gpu_kernels.INTERPRET:  # the graph is a GPU's there (fuse_norm_linears reads linears)
        return "Triton's interpreter: the GPU kernels' graph"
    return None


@register("pack_linear_weights", Stage.OPTIMIZE, skip_if=_skip)
def pack_linear_weights(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    if not torch.backends.mkldnn.is_available():
        return Skipped("this torch has no oneDNN")
    n, cache, todo = 0, {}, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _LINEAR:
            continue
        b_node = node.args[2] if len(node.args) > 2 else None
        w, b = attr_tensor(gm, node.args[1]), attr_tensor(gm, b_node)
        # a weight or bias computed in the graph (e.g. dequantized) is left alone
        if not packable(w) or (b_node is not None and (b is None or b.dtype != w.dtype)):
            continue
        todo.append((node, w, b))
    # The packed copies sit next to the originals (the 1-row GEMV and the skinny path read
    # those): skip them when that would take more than a quarter of this machine's memory.
    sizes = {w.data_ptr(): w.nbytes for _, w, _ in todo}
    extra = sum(sizes.values())
    pack = pack_fits(extra)
    for node, w, b in todo:
        # NOTE: a weight used twice (tied heads across calls) is packed once
        key = (w.data_ptr(), tuple(w.shape), w.stride(), None if b is None else b.data_ptr())
        if key not in cache:
            cache[key] = packed_linear_fn(w, b, pack)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(cache[key], (node.args[0],))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n += 1
    detail = (f"{len(cache)} fp32 weights; oneDNN-packed copies +{extra / 2**20:.0f} MiB" if pack
              else f"{len(cache)} fp32 weights; not packed (+{extra / 2**20:.0f} MiB would be "
                   f"over a quarter of memory): skinny inputs only")
    return Done(n, detail)


def pack_fits(extra_bytes: int) -> bool:
    """Whether packed copies of this many bytes fit the budget (a quarter of memory)."""
    return extra_bytes <= _physical_bytes() // 4


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: do not pack
