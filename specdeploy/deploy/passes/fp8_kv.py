"""An FP8 KV cache as the checkpoint declares it (ModelOpt `kv_cache_quant_algo: FP8`).

The paged KV is allocated as float8_e4m3fn (the build passes `kv_cache_dtype`; the cached
attention op casts what it writes, saturating, and reads fp32 back). A layer's checkpoint
scales s_k, s_v (`k_proj.k_scale` / `v_proj.v_scale`, 1.0 when absent) are applied around the
canonical attention op, so the cache holds k / s_k and v / s_v:
    attention(q * s_k, k / s_k, v / s_v) * s_v  ==  attention(q, k, v)   (before rounding),
since q·k = (q s_k)·(k / s_k) and the output is linear in v. The cache plan reports the bytes.
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import nodes_calling
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register

NAME = "fp8_kv_scales"
_FP8_MAX = 448.0


def _not_fp8(ctx: DeployContext) -> str | None:
    if ctx.kv_cache_dtype != torch.float8_e4m3fn:
        return "kv cache not FP8"
    return None


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _scaled(gm: fx.GraphModule, x: fx.Node, factor: float, before: fx.Node, clamp: bool
            ) -> fx.Node:
    with gm.graph.inserting_before(before):
        y = gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, factor))
        y.meta = dict(x.meta)  # same shape and dtype (the cache stage reads shapes from meta)
        if clamp:  # NOTE: float8_e4m3fn has no infinities: keep the cast's saturation explicit
            y = gm.graph.call_function(torch.ops.aten.clamp.default, (y, -_FP8_MAX, _FP8_MAX))
            y.meta = dict(x.meta)
    return y


@register(NAME, Stage.QUANTIZE, skip_if=_not_fp8)
def fp8_kv_scales(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    info = getattr(ctx.model, "prequant", None)
    scales = info.kv_scales if info is not None else {}
    n, scaled = 0, 0
    for node in list(nodes_calling(gm, torch.ops.specdeploy.attention)):
        n += 1
        ks, vs = scales.get(_module_path(node), (1.0, 1.0))
        if (ks, vs) == (1.0, 1.0):
            continue
        q, k, v = node.args[:3]
        args = list(node.args)
        args[0] = _scaled(gm, q, ks, node, clamp=False)
        args[1] = _scaled(gm, k, 1.0 / ks, node, clamp=True)
        args[2] = _scaled(gm, v, 1.0 / vs, node, clamp=True)
        node.args = tuple(args)
        users = list(node.users)
        with gm.graph.inserting_after(node):
            out = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, vs))
        out.meta = dict(node.meta)
        for u in users:
            u.replace_input_with(node, out)
        scaled += 1
    return Done(n, f"paged KV stored as float8_e4m3fn: {n} attention layers, {scaled} with the "
                   f"checkpoint's k/v scales, {n - scaled} at 1.0")
