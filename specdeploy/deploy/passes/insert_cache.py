"""Replace canonical attention / SSM / conv / gated-delta nodes by their cached ops.

Each replaced node declares its resources (paged KV, state slot, spec state) in what its
transform returns, and reads them as buffers of the GraphModule (allocated after planning, see
deploy/build.py).
Batch metadata enters as graph inputs; nothing is global.
"""
from __future__ import annotations

import torch
from torch import fx

import specdeploy.ops.cached_attention  # noqa: F401  (registers cached ops)
import specdeploy.ops.cached_recurrent  # noqa: F401
from specdeploy.cache.handlers import Checkpoint, PagedKV, SpecState, State
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import (
    add_buffer,
    add_placeholder,
    getitem_users,
    meta_shape,
    nodes_calling,
    op_args,
)
from specdeploy.deploy.pipeline import Done, Stage, register

ops = torch.ops.specdeploy
METADATA_INPUTS = ("cu_seqlens", "cu_seqlens_host", "cache_lens", "cache_lens_host",
                   "page_table", "slot_idx", "seg_kind_host", "slot_mapping")


def _meta(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """The metadata inputs, added on first use (an earlier cache transform may have)."""
    have = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    return {name: have.get(name) or add_placeholder(gm, name) for name in METADATA_INPUTS}


CKPT_INPUTS = ("ckpt_tokens_host", "ckpt_slots")



def _state_buffers(gm, ctx, node, base: str, shape, dtype, declared: list, align: int = 1
                   ) -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    """(state, spec state or None, prefix-cache checkpoint pool or None) buffers."""
    base = ctx.resource_prefix + base
    state = State(f"{base}_state", tuple(shape), dtype, align)
    handlers = {"state": state}
    if ctx.spec_steps:
        handlers["spec"] = SpecState(f"{base}_spec_state", tuple(shape), dtype, ctx.spec_steps,
                                     shadows=state.name)
    if ctx.prefix_caching:
        handlers["ckpt"] = Checkpoint(f"{base}_ckpt", tuple(shape), dtype, of=state.name,
                                      align=align)
    declared.extend(handlers.values())
    bufs = {k: add_buffer(gm, h.name, torch.zeros(0), node) for k, h in handlers.items()}
    return bufs["state"], bufs.get("spec"), bufs.get("ckpt")


def _replace_first_output(node: fx.Node, new: fx.Node) -> None:
    """`node` returns (y, final_state); only y may be used by the plain model."""
    users = getitem_users(node)
    if users.get(1):
        raise RuntimeError(f"{node.name}: the model uses the final state; cannot insert cache")
    for g in users.get(0, []):
        g.replace_all_uses_with(new)


def _key_prefix(v, k) -> bool:
    """Whether the value is `k[..., :Dv]`, the key's leading dims (MLA's latent): then the cache
    stores the key only and reads the value from it (PagedKV.value_in_key)."""
    if not (isinstance(v, fx.Node) and v.target is torch.ops.aten.slice.Tensor
            and v.args[0] is k):
        return False
    dim, start, end, step = (list(v.args[1:]) + [0, None, None, 1][len(v.args) - 1:])[:4]
    ndim = len(meta_shape(k))
    return dim % ndim == ndim - 1 and start in (None, 0) and step == 1 and isinstance(end, int)


def _paged_kv(ctx: DeployContext, name: str, a: dict, window: int = 0) -> PagedKV:
    k_shape, v_shape = meta_shape(a["k"]), meta_shape(a["v"])
    return PagedKV(name, k_shape[2], k_shape[3], v_shape[3], ctx.kv_cache_dtype or ctx.dtype,
                   value_in_key=_key_prefix(a["v"], a["k"]), window=window)


@register("insert_cached_attention", Stage.CACHE)
def insert_cached_attention(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    n, declared = 0, []
    for node in nodes_calling(gm, ops.attention):
        m = _meta(gm)
        a = op_args(node)
        h = _paged_kv(ctx, f"{ctx.resource_prefix}kv_cache_{n}", a)
        declared.append(h)
        kc = add_buffer(gm, f"{h.name}_k", torch.zeros(0), node)
        vc = add_buffer(gm, f"{h.name}_v", torch.zeros(0), node)
        args = (a["q"], a["k"], a["v"], kc, vc, m["cu_seqlens"], m["cu_seqlens_host"],
                m["cache_lens"], m["cache_lens_host"], m["page_table"], a["scale"],
                a["sliding_window"], m["slot_mapping"])
        # NOTE: sinks only where the layer has them: fuse_rope_attention matches 13 arguments
        # (its fused op has no sinks), so a layer with sinks keeps this op
        if a.get("sinks") is not None:
            args += (a["sinks"],)
        # NOTE: a model whose image tokens attend bidirectionally (Gemma 3) takes the step's key
        # extents; fuse_rope_attention then leaves the op alone (15 arguments), so every step
        # runs `cached_attention` (its C rows where they fit, then the widened image rows)
        if getattr(ctx.model, "image_blocks", False):
            args += (a.get("sinks"), add_placeholder(gm, "key_extent_host"))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(ops.cached_attention.default, args)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        n += 1
    shared = sum(h.value_in_key for h in declared)
    return Done(n, f"{shared} with the value in the key's leading dims" if shared else "",
                resources=tuple(declared))


_SLOT_META = ("cu_seqlens_host", "cache_lens_host", "slot_idx", "seg_kind_host")


def _insert_recurrent(gm, ctx, op, cached, kind, tensors, scalars, state_of) -> Done:
    """Shared by the recurrent ops: `cached(*tensors, state, spec_state, *slot metadata,
    *scalars)` replaces `op`; `state_of(args) -> (shape per slot, dtype)`."""
    n, declared = 0, []
    for node in nodes_calling(gm, op):
        m = _meta(gm)
        a = op_args(node)
        if a["initial_state"] is not None:
            raise RuntimeError(f"{node.name}: plain model passes an initial {kind} state")
        shape, dtype = state_of(a)
        # NOTE: a scan's boundary states are free at its chunk ends (ops/scan_states.py)
        align = int(a.get("chunk_size") or 1)
        state, spec, ckpt = _state_buffers(gm, ctx, node, f"{kind}_{n}", shape, dtype, declared,
                                           align)
        args = (*(a[k] for k in tensors), state, spec, *(m[k] for k in _SLOT_META),
                *(a[k] for k in scalars))
        if ckpt is not None:
            args += (ckpt, *(add_placeholder(gm, k) for k in CKPT_INPUTS))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(cached, args)
        _replace_first_output(node, new)
        n += 1
    kinds: dict[str, int] = {}
    for h in declared:
        kinds[h.kind] = kinds.get(h.kind, 0) + 1
    return Done(n, ", ".join(f"{k} ×{c}" for k, c in kinds.items()), resources=tuple(declared))


def _ssm_state(a):  # [H, P, N], fp32
    _, _, h, p = meta_shape(a["x"])
    return (h, p, meta_shape(a["B"])[-1]), torch.float32


def _gdn_state(a):  # [Hv, K, V], fp32
    v_shape = meta_shape(a["v"])
    return (v_shape[2], meta_shape(a["k"])[-1], v_shape[3]), torch.float32


@register("insert_cached_ssm", Stage.CACHE)
def insert_cached_ssm(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    return _insert_recurrent(
        gm, ctx, ops.ssm_scan, ops.cached_ssm_scan.default, "ssm",
        ("x", "dt", "A", "B", "C", "D", "dt_bias"), ("dt_min", "dt_max", "chunk_size"),
        _ssm_state)


@register("insert_cached_conv", Stage.CACHE)
def insert_cached_conv(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    def conv_state(a):  # the last W-1 inputs [C, W-1], in the model's dtype
        channels, width = meta_shape(a["weight"])
        return (channels, width - 1), ctx.dtype

    return _insert_recurrent(
        gm, ctx, ops.causal_conv1d, ops.cached_causal_conv1d.default,
        "conv", ("x", "weight", "bias"), ("activation",), conv_state)


@register("insert_cached_gdn", Stage.CACHE)
def insert_cached_gdn(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    return _insert_recurrent(
        gm, ctx, ops.gated_delta_rule, ops.cached_gated_delta_rule.default,
        "gdn", ("q", "k", "v", "g", "beta"), ("use_qk_l2norm", "scale", "chunk_size"),
        _gdn_state)


_RECURRENT = (ops.cached_ssm_scan.default, ops.cached_causal_conv1d.default,
              ops.cached_gated_delta_rule.default)
WINDOW_INPUTS = ("page_table_win", "slot_mapping_win")


def _window_skip(ctx: DeployContext) -> str | None:
    if ctx.resource_prefix:  # NOTE: a drafter's rows may lag the target's (catch-up rows)
        return "a drafter's layers keep the full-context pages"
    return None


@register("window_kv_pages", Stage.CACHE, skip_if=_window_skip)
def window_kv_pages(gm: fx.GraphModule, ctx: DeployContext) -> Done:
    """Sliding-window layers read their own block table (`page_table_win`) and write through
    their own slot mapping: the window page group, whose pages the engine frees once they
    slide out of every future query's window (cache/window.py). The layer's paged KV is
    declared again with its window (the plan sizes the two groups from the one budget). A
    graph without windowed layers is left as it is (no new inputs)."""
    attn = list(nodes_calling(gm, ops.cached_attention.default))
    windowed = [n for n in attn if int(op_args(n)["sliding_window"] or 0) > 0]
    if not windowed:
        return Done(0)
    if len(windowed) == len(attn) and any(n.target in _RECURRENT for n in gm.graph.nodes):
        # NOTE: prefix-cache checkpoints of recurrent states hang on full-context pages
        return Done(0, "every attention layer is windowed in a recurrent model: one group")
    table, slots = (add_placeholder(gm, k) for k in WINDOW_INPUTS)
    declared = []
    for node in windowed:
        a = op_args(node)
        name = a["k_cache"].target.removesuffix("_k")
        declared.append(_paged_kv(ctx, name, a, int(a["sliding_window"])))
        args = list(node.args)
        args[9], args[12] = table, slots  # page_table, slot_mapping
        node.args = tuple(args)
    windows = sorted({h.window for h in declared})
    return Done(len(windowed), f"window {', '.join(map(str, windows))}; "
                f"{len(attn) - len(windowed)} full-context layer(s)", resources=tuple(declared))
