"""Routed experts whose stacked weights came from GGUF blocks compute with those blocks on the
CPU: `moe_experts`' per-expert loop (ops/moe.py `moe_experts_loop`) with each chosen expert's
two matrices read from its blocks ([E, N, K / QK * size], ops/ggml_linear.py) instead of fp32
copies. A MoE checkpoint is mostly its experts: as fp32 they are ~7x their Q4_0 / Q4_K bytes.

The loader keeps the blocks of stacked experts [E, N, K] as it does a linear's
(`model.ggml_weights`; a Qwen3.5 GGUF's gate and up experts joined into gate_up_proj) and,
where this runs, never writes their fp32 values (`model.ggml_deferred`). Each `moe_experts`
whose two expert weights have blocks becomes a call that runs each chosen expert's matrices
on its blocks: with `ctx.kernels="exact"` the fp32 kernel up to MAX_ROWS rows an expert and
above that the expert's matrix dequantized into the reused buffer (as `ggml_linears`), with
"fast" the integer-dot kernel (8-bit activations, as llama.cpp; MXFP4 experts, which only the
tiled kernel reads, on their tiled copies) at every row count, the whole layer in one C call
(ops/ggml_moe_int.py) where that is built. Either way each token's rows are
computed alone, so greedy speculative = greedy plain. A weight matches by
identity with the loaded parameter; one a transform replaced keeps its path.

Runs before `ggml_linears`, which fills any deferred weight the graph still reads (so an
expert left on the fp32 path computes with its values, never with a placeholder). Skipped where
`ggml_linears` is: compiling, off the CPU, no kernel.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor, drop_unread_params
from specdeploy.deploy.passes.ggml_calls import MAX_ROWS, dequant_linear, expert_fast_fn
from specdeploy.deploy.passes.ggml_weights import _fast_isa, _not_here, _weight_map
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import ggml_moe_int, ggml_tiled, linear_rows, row_kernels
from specdeploy.ops.ggml_linear import (
    GGMLWeight,
    expert,
    ggml_linear,
    kernel_unavailable,
)
from specdeploy.ops.moe import ONE_CALL_MAX_TOKENS, moe_experts_fast, moe_experts_loop

_MOE = torch.ops.specdeploy.moe_experts.default
HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}  # 16-bit experts: the tensors
_MOE_BIAS = torch.ops.specdeploy.moe_experts_bias.default


def experts_fn(up: GGMLWeight, down: GGMLWeight, activation: str, isa: str | None):
    """(x, topk_ids, topk_weights) -> the routed experts' sum, on `up` / `down`'s blocks."""
    if up.kind == down.kind and up.kind in HALF_DTYPES and activation in linear_rows.ACTIVATIONS \
            and linear_rows.moe_unavailable() is None:
        return _half_experts_fn(up, down, activation, isa is not None)
    if isa is not None and ggml_moe_int.unavailable() is None:
        try:  # the whole layer in one C call (ops/ggml_moe_int.py)
            return ggml_moe_int.bound_experts(up, down, activation, isa)
        except ValueError:
            pass  # shapes or an activation it does not take: the per-expert calls below
    mats = {"up": [expert(up, e) for e in range(up.shape[0])],
            "down": [expert(down, e) for e in range(down.shape[0])]}
    bound: dict[tuple[int, str], object] = {}

    def linear(e: int, which: str, x: torch.Tensor) -> torch.Tensor:
        w = mats[which][e]
        if isa is not None:  # every row count (see ggml_calls.ggml_linear_fn)
            fn = bound.get((e, which))
            if fn is None:  # NOTE: bound once per expert matrix, on first use
                fn = bound[(e, which)] = expert_fast_fn(w, None, isa)
            return fn(x.contiguous())
        if x.shape[0] <= MAX_ROWS:
            return ggml_linear(x.contiguous(), w)
        return dequant_linear(x, w, None)

    def experts_on_blocks(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                          ) -> torch.Tensor:
        return moe_experts_loop(x, topk_ids, topk_weights, up.shape[0], linear, activation)

    experts_on_blocks.blocks = (up.blocks, down.blocks)  # (what deploy/memory.py counts)
    return experts_on_blocks


def _half_experts_fn(up: GGMLWeight, down: GGMLWeight, activation: str, fast: bool):
    """BF16 / F16 experts (a 16-bit checkpoint's, loading.half_weights; a GGUF's): their
    blocks are the 16-bit tensors [E, N, K] themselves, which the CPU's one-call expert kernel
    reads (linear_rows.c `moe_rows`: each weight widened exactly, each token alone:
    batch-invariant) at every row count with "fast"; "exact" hands calls of many tokens to the
    per-expert GEMMs (ops/moe.py ONE_CALL_MAX_TOKENS), as the fp32 model's op does."""
    dtype = HALF_DTYPES[up.kind]
    w_up, w_down = up.blocks.view(dtype), down.blocks.view(dtype)

    def experts_on_blocks(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                          ) -> torch.Tensor:
        if fast or x.shape[0] <= ONE_CALL_MAX_TOKENS:
            return linear_rows.moe_rows(x, topk_ids, topk_weights, w_up, w_down, activation)
        return moe_experts_fast(x, topk_ids, topk_weights, w_up, w_down, activation)

    experts_on_blocks.half_one_call = True  # (the pass's report)
    experts_on_blocks.blocks = (up.blocks, down.blocks)
    return experts_on_blocks


def experts_bias_fn(up: GGMLWeight, b_up: torch.Tensor, down: GGMLWeight, b_down: torch.Tensor,
                    activation: str, alpha: float, limit: float, isa: str | None):
    """`moe_experts_bias` (gpt-oss: biases, the clamped SwiGLU) on `up` / `down`'s blocks:
    (x, topk_ids, topk_weights) -> the routed experts' sum. Each chosen expert's rows through
    its two matrices (the integer-dot kernel with "fast", the fp32 block kernel or a dequantized
    GEMM with "exact"), its biases added to their rows; the rows of a token are computed alone
    by those kernels and summed per token in expert order, so a verify row is a decode row's
    bits. With "fast" the whole layer is one C call where that is built (ops/ggml_moe_int.py);
    the loop it replaces takes the same C activation, so the two differ only where the call
    runs tiled copies of the blocks (another fp32 summation)."""
    from specdeploy.ops.moe_bias import ACTIVATIONS, clamped_swiglu

    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_experts_bias: activation {activation!r} not in {ACTIVATIONS}")
    if isa is not None and ggml_moe_int.unavailable() is None:
        try:
            return ggml_moe_int.bound_experts(up, down, "swiglu_oai", isa, b_up=b_up,
                                              b_down=b_down, alpha=alpha, limit=limit)
        except ValueError:
            pass  # shapes it does not take: the per-expert calls below
    mats = {"up": [expert(up, e) for e in range(up.shape[0])],
            "down": [expert(down, e) for e in range(down.shape[0])]}
    biases = {"up": b_up.detach().float().contiguous(),
              "down": b_down.detach().float().contiguous()}
    bound: dict[tuple[int, str], object] = {}

    def linear(e: int, which: str, x: torch.Tensor) -> torch.Tensor:
        w, b = mats[which][e], biases[which][e]
        if isa is not None:
            fn = bound.get((e, which))
            if fn is None:  # NOTE: bound once per expert matrix, on first use
                fn = bound[(e, which)] = expert_fast_fn(w, b, isa)
            return fn(x.contiguous())
        y = ggml_linear(x.contiguous(), w) if x.shape[0] <= MAX_ROWS else dequant_linear(
            x, w, None)
        return y + b

    def act(h: torch.Tensor) -> torch.Tensor:
        # "fast": the one call's activation (row_kernels.c: batch-invariant, within 1e-6 of
        # torch's), where the row kernels are built
        y = row_kernels.swiglu_oai(h, alpha, limit) if isa is not None else None
        return clamped_swiglu(h, alpha, limit) if y is None else y

    def experts_bias_on_blocks(x: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts_loop(x, topk_ids, topk_weights, up.shape[0], linear, act)

    experts_bias_on_blocks.blocks = (up.blocks, down.blocks, *biases.values())
    return experts_bias_on_blocks


def _stacked_blocks(gm, stacked, args) -> list:
    out = []
    for arg in args:
        w = attr_tensor(gm, arg)
        key = None if w is None else (w.data_ptr(), tuple(w.shape), w.stride())
        out.append(stacked.get(key) if w is not None and w.dtype == torch.float32 else None)
    return out


@register("ggml_moe_experts", Stage.OPTIMIZE, skip_if=_not_here)
def ggml_moe_experts_pass(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    weights = _weight_map(ctx) if ctx.model is not None else {}
    stacked = {k: w for k, w in weights.items() if len(w.shape) == 3}
    if not stacked:
        return Skipped("no routed experts in GGUF / MXFP4 blocks")
    why = kernel_unavailable()
    if why:
        return Skipped(f"kernel unavailable: {why}")
    isa, note = _fast_isa(ctx.kernels)
    n, stored, attrs, one_call, half, trans = 0, 0, set(), 0, 0, 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (_MOE, _MOE_BIAS):
            continue
        if node.target is _MOE:
            x, ids, wts, w_up, w_down, activation = node.args
        else:
            x, ids, wts, w_up, b_up, w_down, b_down, activation, alpha, limit = node.args
            bias = [attr_tensor(gm, b) for b in (b_up, b_down)]
            if any(b is None for b in bias):
                continue
        blocks = _stacked_blocks(gm, stacked, (w_up, w_down))
        if None in blocks:
            continue
        if node.target is _MOE:
            fn = experts_fn(*blocks, activation, isa)
        else:
            fn = experts_bias_fn(blocks[0], bias[0], blocks[1], bias[1], activation, alpha,
                                 limit, isa)
        one_call += fn.__name__ == "experts_one_call" or hasattr(fn, "half_one_call")
        half += hasattr(fn, "half_one_call")
        trans += (isa is not None and any(b.kind in ggml_tiled.TRANSCODED for b in blocks)
                  and ggml_moe_int.tiles(*blocks))
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(fn, (x, ids, wts))
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        attrs |= {w_up.target, w_down.target}
        n, stored = n + 1, stored + sum(b.blocks.nbytes for b in blocks)
    if not n:
        return Skipped("no moe_experts / moe_experts_bias reads weights with blocks")
    freed = drop_unread_params(gm, attrs)
    if half and half == n:
        note = "16-bit experts as stored on the fp32 one-call kernel"
    calls = f", {one_call} of them one C call each" if one_call else ""
    if trans:
        calls += f", {trans} with lattice kinds transcoded to IQ4_XS tiles"
    return Done(n, f"{n} expert groups on {stored / 2**20:.1f} MiB of blocks ({note}{calls}); "
                f"fp32 parameters out of the graph: {freed / 2**20:.1f} MiB")
