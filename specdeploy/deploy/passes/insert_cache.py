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


_SLOT_META = ("cu_seqlens_host", "cache_lens_host", "slot_idx", "seg_kind_host")


def _insert_recurrent(gm, ctx, name, op, cached, kind, tensors, scalars, state_of):
    """Shared by the recurrent ops: `cached(*tensors, state, spec_state, *slot metadata,
    *scalars)` replaces `op`; `state_of(args) -> (shape per slot, dtype)`."""
    n = 0
    for node in nodes_calling(gm, op):
        m = _meta(gm, ctx)
        a = op_args(node)
        if a["initial_state"] is not None:
            raise RuntimeError(f"{node.name}: plain model passes an initial {kind} state")
        shape, dtype = state_of(a)
        state, spec = _state_buffers(gm, ctx, node, f"{kind}_{n}", shape, dtype)
        args = (*(a[k] for k in tensors), state, spec, *(m[k] for k in _SLOT_META),
                *(a[k] for k in scalars))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(cached, args)
        _replace_first_output(node, new)
        n += 1
    finalize(gm)
    return TransformInfo(name, Stage.CACHE, n)


def _ssm_state(a):  # [H, P, N], fp32
    _, _, h, p = meta_shape(a["x"])
    return (h, p, meta_shape(a["B"])[-1]), torch.float32


def _gdn_state(a):  # [Hv, K, V], fp32
    v_shape = meta_shape(a["v"])
    return (v_shape[2], meta_shape(a["k"])[-1], v_shape[3]), torch.float32


@register("insert_cached_ssm", Stage.CACHE)
def insert_cached_ssm(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    return _insert_recurrent(
        gm, ctx, "insert_cached_ssm", ops.ssm_scan, ops.cached_ssm_scan.default, "ssm",
        ("x", "dt", "A", "B", "C", "D", "dt_bias"), ("dt_min", "dt_max", "chunk_size"),
        _ssm_state)


@register("insert_cached_conv", Stage.CACHE)
def insert_cached_conv(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    def conv_state(a):  # the last W-1 inputs [C, W-1], in the model's dtype
        channels, width = meta_shape(a["weight"])
        return (channels, width - 1), ctx.dtype

    return _insert_recurrent(
        gm, ctx, "insert_cached_conv", ops.causal_conv1d, ops.cached_causal_conv1d.default,
        "conv", ("x", "weight", "bias"), ("activation",), conv_state)


@register("insert_cached_gdn", Stage.CACHE)
def insert_cached_gdn(gm: fx.GraphModule, ctx: DeployContext) -> TransformInfo:
    return _insert_recurrent(
        gm, ctx, "insert_cached_gdn", ops.gated_delta_rule, ops.cached_gated_delta_rule.default,
        "gdn", ("q", "k", "v", "g", "beta"), ("use_qk_l2norm", "scale", "chunk_size"),
        _gdn_state)
