"""Replace canonical attention / SSM / conv / gated-delta nodes by their cached ops.

Each replaced node declares its resources (paged KV, state slot, spec state) in `ctx.resources`
and reads them as buffers of the GraphModule (allocated after planning, see deploy/runner.py).
Batch metadata enters as graph inputs; nothing is global.
"""
from __future__ import annotations

import torch
from torch import fx

import specdeploy.ops.cached_attention  # noqa: F401  (registers cached ops)
import specdeploy.ops.cached_recurrent  # noqa: F401
from specdeploy.cache.handlers import PagedKV, SpecState, State
from specdeploy.deploy.graph import (
    add_buffer,
    add_placeholder,
    finalize,
    getitem_users,
    meta_shape,
    nodes_calling,
    op_args,
)
from specdeploy.deploy.pipeline import DeployContext, Stage, TransformInfo, register

ops = torch.ops.specdeploy
METADATA_INPUTS = ("cu_seqlens", "cu_seqlens_host", "cache_lens", "cache_lens_host",
                   "page_table", "slot_idx", "seg_kind_host", "slot_mapping")


def _meta(gm: fx.GraphModule, ctx: DeployContext) -> dict[str, fx.Node]:
    for name in METADATA_INPUTS:
        if name not in ctx.inputs:
            ctx.inputs[name] = add_placeholder(gm, name)
    return ctx.inputs


def _declare(gm, ctx, handler, before: fx.Node) -> fx.Node:
    ctx.resources.append(handler)
    return add_buffer(gm, handler.name, torch.zeros(0), before)


def _state_buffers(gm, ctx, node, base: str, shape, dtype) -> tuple[fx.Node, fx.Node | None]:
    base = ctx.resource_prefix + base
    state = _declare(gm, ctx, State(f"{base}_state", tuple(shape), dtype), node)
    spec = None
    if ctx.spec_steps:
        spec = _declare(gm, ctx, SpecState(f"{base}_spec_state", tuple(shape), dtype,
                                           ctx.spec_steps), node)
    return state, spec


def _replace_first_output(node: fx.Node, new: fx.Node) -> None:
    """`node` returns (y, final_state); only y may be used by the plain model."""
    users = getitem_users(node)
    if users.get(1):
        raise RuntimeError(f"{node.name}: the model uses the final state; cannot insert cache")
    for g in users.get(0, []):
        g.replace_all_uses_with(new)


@register("insert_cached_attention", Stage.CACHE)
def insert_cached_attention(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    n = 0
    for node in nodes_calling(gm, ops.attention):
        m = _meta(gm, ctx)
        a = op_args(node)
        k_shape, v_shape = meta_shape(a["k"]), meta_shape(a["v"])
        h = PagedKV(f"{ctx.resource_prefix}kv_cache_{n}", k_shape[2], k_shape[3], v_shape[3],
                    ctx.dtype)
        ctx.resources.append(h)
        kc = add_buffer(gm, f"{h.name}_k", torch.zeros(0), node)
        vc = add_buffer(gm, f"{h.name}_v", torch.zeros(0), node)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(ops.cached_attention.default, (
                a["q"], a["k"], a["v"], kc, vc, m["cu_seqlens"], m["cu_seqlens_host"],
                m["cache_lens"], m["cache_lens_host"], m["page_table"], a["scale"],
                a["sliding_window"], m["slot_mapping"],
            ))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n += 1
    finalize(gm)
    return TransformInfo("insert_cached_attention", Stage.CACHE, n)


@register("insert_cached_ssm", Stage.CACHE)
def insert_cached_ssm(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    n = 0
    for node in nodes_calling(gm, ops.ssm_scan):
        m = _meta(gm, ctx)
        a = op_args(node)
        if a["initial_state"] is not None:
            raise RuntimeError(f"{node.name}: plain model passes an initial SSM state")
        _, _, h, p = meta_shape(a["x"])
        shape = (h, p, meta_shape(a["B"])[-1])
        state, spec = _state_buffers(gm, ctx, node, f"ssm_{n}", shape, torch.float32)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(ops.cached_ssm_scan.default, (
                a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], state, spec,
                m["cu_seqlens_host"], m["cache_lens_host"], m["slot_idx"], m["seg_kind_host"],
                a["dt_min"], a["dt_max"], a["chunk_size"],
            ))
        _replace_first_output(node, new)
        n += 1
    finalize(gm)
    return TransformInfo("insert_cached_ssm", Stage.CACHE, n)


@register("insert_cached_conv", Stage.CACHE)
def insert_cached_conv(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    n = 0
    for node in nodes_calling(gm, ops.causal_conv1d):
        m = _meta(gm, ctx)
        a = op_args(node)
        if a["initial_state"] is not None:
            raise RuntimeError(f"{node.name}: plain model passes an initial conv state")
        channels, width = meta_shape(a["weight"])
        state, spec = _state_buffers(gm, ctx, node, f"conv_{n}", (channels, width - 1), ctx.dtype)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(ops.cached_causal_conv1d.default, (
                a["x"], a["weight"], a["bias"], state, spec, m["cu_seqlens_host"],
                m["cache_lens_host"], m["slot_idx"], m["seg_kind_host"], a["activation"],
            ))
        _replace_first_output(node, new)
        n += 1
    finalize(gm)
    return TransformInfo("insert_cached_conv", Stage.CACHE, n)


@register("insert_cached_gdn", Stage.CACHE)
def insert_cached_gdn(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    n = 0
    for node in nodes_calling(gm, ops.gated_delta_rule):
        m = _meta(gm, ctx)
        a = op_args(node)
        if a["initial_state"] is not None:
            raise RuntimeError(f"{node.name}: plain model passes an initial delta-rule state")
        v_shape = meta_shape(a["v"])
        shape = (v_shape[2], meta_shape(a["k"])[-1], v_shape[3])
        state, spec = _state_buffers(gm, ctx, node, f"gdn_{n}", shape, torch.float32)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(ops.cached_gated_delta_rule.default, (
                a["q"], a["k"], a["v"], a["g"], a["beta"], state, spec, m["cu_seqlens_host"],
                m["cache_lens_host"], m["slot_idx"], m["seg_kind_host"], a["use_qk_l2norm"],
                a["scale"], a["chunk_size"],
            ))
        _replace_first_output(node, new)
        n += 1
    finalize(gm)
    return TransformInfo("insert_cached_gdn", Stage.CACHE, n)
