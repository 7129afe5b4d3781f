"""The fp32 linears (and fp32 routed experts) of a GGUF graph on the fast kernels compute with a
batch-invariant kernel (ops/linear_rows.py), so that every row of a step is the same bits
whatever rows are beside it.

With `kernels="fast"` each block linear rounds its input rows to 8-bit blocks: a last-bit
difference in an input can move an activation by a rounding step, ~1e-3 in logprob downstream.
The block kernels are batch-invariant; what stays fp32 in a GGUF (its F32 routers, matrices of
types without a block kernel) ran on the BLAS, whose result for a row depends on the call's
row count (GEMV at one row, packed GEMM at several). A verify step's rows then differed from
the decode rows they replay (7e-7 in the router logits of a Q8_0 NemotronH MoE, ~1e-3 after
the next layer's rounding), and greedy speculation could pick another token at such a
near-tie. Here those linears, and `moe_experts` still on fp32 weights, move to the
batch-invariant kernel; and (`row_invariant_elementwise`, after the row fusions) the graph's
sigmoid / softplus / silu, whose torch kernels round a tensor's last elements otherwise, move
to row_kernels.c's.

Only where the fast kernels run (`ctx.kernels="fast"` with an integer path and GGUF blocks in
the model): the fp32 model ("exact", safetensors checkpoints) differs between row counts in
the last bits only, which nothing downstream amplifies (greedy outputs there are checked as
near-ties), and keeps the BLAS (up to 1.6x faster at prefill sizes: bench/fp32_rows.py).
The linears right after `ggml_linears`, before the fusions (which leave these calls alone).
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor
from specdeploy.deploy.passes.ggml_weights import _fast_isa, _not_here
from specdeploy.deploy.passes.identity import is_identity
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import linear_rows as lr
from specdeploy.ops import row_kernels
from specdeploy.ops.moe import moe_experts_loop

_LINEAR = torch.ops.aten.linear.default
_MOE = torch.ops.specdeploy.moe_experts.default
_SOFTPLUS = torch.ops.aten.softplus.default
_SOFTPLUS_DEFAULTS = {"beta": 1, "threshold": 20}


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    out = row_kernels.sigmoid(x)
    return torch.sigmoid(x) if out is None else out


def softplus_rows(x: torch.Tensor, beta=1, threshold=20) -> torch.Tensor:
    out = row_kernels.softplus(x)
    return torch.nn.functional.softplus(x) if out is None else out


def silu_rows(x: torch.Tensor) -> torch.Tensor:
    out = row_kernels.elementwise("silu", x)
    return torch.nn.functional.silu(x) if out is None else out


# elementwise ops whose torch kernels run a tensor's tail through a scalar path that rounds
# otherwise (their transcendental functions)
ELEMENTWISE = {torch.ops.aten.sigmoid.default: sigmoid_rows, _SOFTPLUS: softplus_rows,
               torch.ops.aten.silu.default: silu_rows}


def _skip(ctx: DeployContext, what: str = "fp32 linears") -> str | None:
    why = _not_here(ctx)
    if why:
        return why
    if ctx.model is None or not (getattr(ctx.model, "ggml_weights", None)
                                 or getattr(ctx.model, "ggml_tensors", None)):
        return f"no GGUF blocks: the {what} feed no fast kernel"
    if ctx.kernels != "fast":
        return f"kernels={ctx.kernels!r}: the fp32 model keeps torch's {what}"
    return None


def experts_fn(w_up: torch.Tensor, w_down: torch.Tensor, activation: str):
    """(x, topk_ids, topk_weights) -> the routed experts' sum in one batch-invariant C call
    (linear_rows.c `moe_rows`: each token's output the same bits whatever tokens share it);
    where that call cannot run, each expert's matrices on the batch-invariant linear."""
    mats = {"up": w_up.detach().contiguous(), "down": w_down.detach().contiguous()}
    if lr.moe_unavailable() is None:
        def experts_fp32_one_call(x, topk_ids, topk_weights):
            return lr.moe_rows(x, topk_ids, topk_weights, mats["up"], mats["down"], activation)

        return experts_fp32_one_call

    def experts_fp32_rows(x, topk_ids, topk_weights):
        return moe_experts_loop(x, topk_ids, topk_weights, mats["up"].shape[0],
                                lambda e, which, h: lr.linear_rows(h, mats[which][e]),
                                activation)

    return experts_fp32_rows


def _fp32(gm: fx.GraphModule, arg, dims: int) -> torch.Tensor | None:
    while isinstance(arg, fx.Node) and is_identity(arg):  # `.float()` of an fp32 router weight
        arg = arg.args[0]
    w = attr_tensor(gm, arg) if isinstance(arg, fx.Node) else None
    ok = w is not None and w.dtype == torch.float32 and w.dim() == dims
    return w if ok and w.device.type == "cpu" else None


def _replace(gm: fx.GraphModule, node: fx.Node, fn, args) -> None:
    with gm.graph.inserting_before(node):
        out = gm.graph.call_function(fn, args)
    out.meta = dict(node.meta)
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def _ready() -> str | None:
    if lr.library() is None:
        return "the batch-invariant fp32 kernel could not be built"
    return None


@register("row_invariant_linears", Stage.OPTIMIZE, skip_if=_skip)
def row_invariant_linears(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    isa, _ = _fast_isa(ctx.kernels, warn=False)
    if isa is None:
        return Skipped("the fast integer path is unavailable here (exact kernel)")
    if _ready():
        return Skipped(_ready())
    n_lin = n_moe = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _LINEAR:
            w = _fp32(gm, node.args[1], 2)
            b_arg = node.args[2] if len(node.args) > 2 else None
            b = None if b_arg is None else _fp32(gm, b_arg, 1)
            if w is None or (b_arg is not None and b is None):
                continue
            _replace(gm, node, lr.bound(w, b), (node.args[0],))
            n_lin += 1
        elif node.target is _MOE:
            x, ids, wts, w_up, w_down, activation = node.args
            up, down = _fp32(gm, w_up, 3), _fp32(gm, w_down, 3)
            if up is None or down is None:
                continue
            _replace(gm, node, experts_fn(up, down, activation), (x, ids, wts))
            n_moe += 1
    if not n_lin + n_moe:
        return Skipped("no fp32 linear beside the block kernels")
    return Done(n_lin + n_moe, f"{n_lin} fp32 linears, {n_moe} fp32 expert groups on the "
                "batch-invariant kernel")


def _skip_elementwise(ctx: DeployContext) -> str | None:
    return _skip(ctx, "sigmoid / softplus / silu")


@register("row_invariant_elementwise", Stage.OPTIMIZE, skip_if=_skip_elementwise)
def row_invariant_elementwise(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    """The graph's sigmoid / softplus / silu that the fusions before it left (a silu * up of
    one fused projection is `fuse_row_ops`' silu_mul kernel already, itself batch-invariant)."""
    isa, _ = _fast_isa(ctx.kernels, warn=False)
    if isa is None:
        return Skipped("the fast integer path is unavailable here (exact kernel)")
    n = 0
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if (node.op != "call_function" or node.target not in ELEMENTWISE
                or getattr(val, "dtype", None) != torch.float32):
            continue
        given = {**dict(zip(("beta", "threshold"), node.args[1:])), **node.kwargs}
        if node.target is _SOFTPLUS and {**_SOFTPLUS_DEFAULTS, **given} != _SOFTPLUS_DEFAULTS:
            continue  # another beta / threshold than the kernel's
        _replace(gm, node, ELEMENTWISE[node.target], node.args[:1])
        n += 1
    if not n:
        return Skipped("no sigmoid, softplus or silu left beside the block kernels")
    return Done(n, f"{n} sigmoid / softplus / silu ops on batch-invariant kernels")
