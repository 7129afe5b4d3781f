"""Pre-pack fp32 linear weights for oneDNN on the CPU, and route skinny inputs to W @ x^T.

`aten.linear` hands a row-major weight to the BLAS, which re-packs it on every call once the
input has more than one row: a 4-token verify step then cost ~2x a 1-token decode step although
both stream the same weights. `python bench/linear_rows.py --reps 5` (bench/results/
linear_rows.json; one thread, 30 layers of SmolLM2-sized weights so caches are cold), ms per
step of linears, plain / W @ x^T / packed: 1 row 55 / 56 / 58; 2 rows 93 / 71 / 67; 4 rows
99 / 61 / 78; 6 rows 117 / 124 / 91; 64 rows 312 / 310 / 261; 256 rows 921 / 1222 / 845. So:
1 row keeps the plain GEMV on one thread; with more threads the BLAS still runs a GEMV on one,
so it goes to the packed weight instead, or (not packed) a 2-column W @ x^T: on two cores
(`bench/linear_rows.py --threads 2`, bench/results/linear_rows_2threads.json) 1 row plain /
2-column / packed 54 / 43 / 41 ms.
2..SKINNY_ROWS rows (a K=3 verify at batch 1 is 4) use W @ x^T,
which reads the weight once with the input as the small operand, and more rows use the oneDNN
blocked layout made once here. bench/spec_step.py --default-model measures the end-to-end
verify step with and without this pass.

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
SKINNY_ROWS = 4  # up to here W @ x^T; above, the oneDNN-packed weight
# Smaller weights stay cache-resident, where the extra call and copy cost more than they save
# (tiny test models measured slower with them).
MIN_ELEMENTS = 1 << 18


def packed_linear_fn(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool = True):
    """A function x -> linear(x, weight, bias): plain GEMV at 1 row, W @ x^T up to SKINNY_ROWS,
    above that a oneDNN-packed copy of `weight` (`pack=False`: the plain linear there)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if pack else None
    bias = None if bias is None else bias.detach()
    out_features = weight.shape[0]
    pointwise = torch.ops.mkldnn._linear_pointwise

    linear = torch.nn.functional.linear
    w = weight.detach()

    def packed_linear(x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if m == 1:
            if torch.get_num_threads() == 1:  # a GEMV: on one thread the plain one is fastest
                return linear(x, w, bias)
            # NOTE: the BLAS runs a GEMV on one thread; oneDNN's packed weight, or else a
            # 2-column W @ x^T (the second column a throwaway copy), uses them all
            if packed is not None:
                y = pointwise(x2, packed, bias, "none", [], "")
            else:
                y = torch.mm(w, torch.cat([x2, x2]).t())[:, 0]
                if bias is not None:
                    y = y + bias
            return y.view(*x.shape[:-1], out_features)
        if m <= SKINNY_ROWS:
            # W @ x^T streams the weight once like a GEMV does (see the module note)
            y = torch.mm(w, x2.t()).t().contiguous()
            if bias is not None:
                y = y + bias
        elif packed is None:
            return linear(x, w, bias)
        else:
            y = pointwise(x2, packed, bias, "none", [], "")
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
