"""Linears and routed experts of a pre-quantized checkpoint compute with its quantized weights.

The loader gives the plain model dequantized weights and keeps the checkpoint's quantized tensors
beside them (`prequant_weights`, checkpoint/prequant.py). Here every `aten.linear` whose weight
is one of them becomes `specdeploy::fp8_linear` / `nvfp4_linear`, and every `moe_experts` whose
two expert weights are becomes `fp8_moe_experts` / `nvfp4_moe_experts`; the quantized tensors
become buffers and the fp weights leave the graph (the runner drops the plain model, so
FP8 holds 1 byte per weight and NVFP4 0.5625 from then on). Weights match by identity with the
loaded parameters, so one a transform replaced keeps its path.

FP8 (ModelOpt) applies the checkpoint's static `input_scale` to activations as an FP8 GEMM does;
NVFP4 and HF block FP8 run weight-only dequantized (no FP4 units here; block FP8's dynamic
activation scales are not emulated). Nothing matched → skipped ("not a pre-quantized
checkpoint"). Modules the checkpoint's exclusion globs kept in full precision, with the glob and
its mapping into the deployment's namespaces (`mtp*` → `eagle_drafter*`), are in the report.
"""
from __future__ import annotations

import torch
from torch import fx, nn

import specdeploy.ops.fp8_linear  # noqa: F401  (registers the quantized ops)
import specdeploy.ops.nvfp4_linear  # noqa: F401
import specdeploy.ops.quant_moe  # noqa: F401
from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops.fp8_linear import Fp8Weight

NAME = "prequantized_weights"
_LINEAR = torch.ops.aten.linear.default


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride())


def weight_map(model: nn.Module) -> tuple[dict, object]:
    """Tensor identity → (quantized weight, FP8 input scale or None); and the PrequantInfo."""
    out, info = {}, getattr(model, "prequant", None)
    for prefix, mod in model.named_modules():
        weights = getattr(mod, "prequant_weights", None)
        scales = getattr(mod, "prequant_input_scales", None) or {}
        for rel, qw in (weights or {}).items():
            name = f"{prefix}.{rel}" if prefix else rel
            try:
                p = model.get_parameter(name)
            except AttributeError:  # e.g. mtp.* once the drafter left the target
                continue
            # NOTE: the build may have moved the model (`device`); its quantized weights follow
            qw = type(qw)(*(t.to(p.device) if isinstance(t, torch.Tensor) else t for t in qw))
            scale = scales.get(rel)
            out[_key(p)] = (qw, None if scale is None else scale.to(p.device))
        if info is None:
            info = getattr(mod, "prequant", None)
    return out, info


def _quant_args(gm: fx.GraphModule, owner_name: str, leaf: str, qw, in_scale, before: fx.Node
                ) -> list:
    """Register qw's tensors as buffers next to the weight; get_attr nodes (or ints) in op order."""
    owner = gm.get_submodule(owner_name) if owner_name else gm
    prefix = f"{owner_name}." if owner_name else ""
    fields = list(qw._asdict().items())
    if in_scale is not None:
        fields.append(("input_scale", in_scale))
    args = {}
    for f, t in fields:
        if isinstance(t, int):
            args[f] = t
            continue
        buf = f"{leaf}_q_{f}"
        if not hasattr(owner, buf):
            owner.register_buffer(buf, t, persistent=False)
        with gm.graph.inserting_before(before):
            args[f] = gm.graph.get_attr(prefix + buf)
    return args


def _replace_linear(gm, node, qw, in_scale) -> None:
    w_node = node.args[1]
    owner, _, leaf = w_node.target.rpartition(".")
    a = _quant_args(gm, owner, leaf, qw, in_scale, node)
    bias = node.args[2] if len(node.args) > 2 else None
    if isinstance(qw, Fp8Weight):
        op, args = torch.ops.specdeploy.fp8_linear.default, (
            node.args[0], a["weight"], a["scale"], a["block_k"], a.get("input_scale"), bias)
    else:
        op, args = torch.ops.specdeploy.nvfp4_linear.default, (
            node.args[0], a["weight"], a["scale"], a["scale_2"], bias)
    _swap(gm, node, op, args)


def _replace_moe(gm, node, up, down) -> None:
    x, ids, wts, w_up, w_down, act = node.args
    ua = _quant_args(gm, *_split(w_up.target), *up, node)
    da = _quant_args(gm, *_split(w_down.target), *down, node)
    if isinstance(up[0], Fp8Weight):
        op = torch.ops.specdeploy.fp8_moe_experts.default
        args = (x, ids, wts, ua["weight"], ua["scale"], ua["block_k"], da["weight"], da["scale"],
                da["block_k"], act, ua.get("input_scale"), da.get("input_scale"))
    else:
        op = torch.ops.specdeploy.nvfp4_moe_experts.default
        args = (x, ids, wts, ua["weight"], ua["scale"], ua["scale_2"], da["weight"],
                da["scale"], da["scale_2"], act)
    _swap(gm, node, op, args)


def _split(target: str) -> tuple[str, str]:
    owner, _, leaf = target.rpartition(".")
    return owner, leaf


def _swap(gm, node, op, args) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(op, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _drop_unused_params(gm: fx.GraphModule, candidates: set[str]) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in candidates and not node.users:
            gm.graph.erase_node(node)
    live = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in candidates - live:
        owner, leaf = _split(name)
        (gm.get_submodule(owner) if owner else gm)._parameters.pop(leaf, None)


def _excluded_summary(info) -> str:
    if info is None or not info.excluded:
        return ""
    by_why: dict[str, list[str]] = {}
    for mod, why in info.excluded.items():
        by_why.setdefault(why, []).append(mod)
    parts = [f"{why}: {len(mods)} ({mods[0]}{', ...' if len(mods) > 1 else ''})"
             for why, mods in by_why.items()]
    return "; kept full precision by the checkpoint's exclusions: " + ", ".join(parts)


def _no_weights(ctx: DeployContext) -> str | None:
    if ctx.model is None or not weight_map(ctx.model)[0]:
        return "not a pre-quantized checkpoint"
    return None


@register(NAME, Stage.QUANTIZE, skip_if=_no_weights)
def prequantized_weights(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    weights, info = weight_map(ctx.model)
    weights.update(ctx.prequant_slices)  # this rank's cuts (deploy/passes/shard.py)
    n_lin = n_moe = 0
    stored, touched, freed = 0, set(), {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _LINEAR:
            w = attr_tensor(gm, node.args[1])
            hit = None if w is None else weights.get(_key(w))
            if hit is not None and node.args[0] is not node.args[1]:
                touched.add(node.args[1].target)
                freed[w.data_ptr()] = w.nbytes
                _replace_linear(gm, node, *hit)
                n_lin += 1
                stored += _nbytes(hit[0])
        elif node.target is torch.ops.specdeploy.moe_experts.default:
            w_up, w_down = (attr_tensor(gm, node.args[i]) for i in (3, 4))
            up = None if w_up is None else weights.get(_key(w_up))
            down = None if w_down is None else weights.get(_key(w_down))
            if up is not None and down is not None and type(up[0]) is type(down[0]):
                touched.update({node.args[3].target, node.args[4].target})
                freed.update({w_up.data_ptr(): w_up.nbytes, w_down.data_ptr(): w_down.nbytes})
                _replace_moe(gm, node, up, down)
                n_moe += 1
                stored += _nbytes(up[0]) + _nbytes(down[0])
    _drop_unused_params(gm, touched)
    what = info.config.describe() if info is not None else "pre-quantized"
    detail = (f"{what}: {n_lin} linears + {n_moe} routed-expert sets on "
              f"{stored / 2**20:.2f} MiB of quantized weights")
    if info is not None and info.config.kv_cache:
        detail += "; kv cache kept at the model dtype (checkpoint k/v scales unused)"
    return Done(n_lin + n_moe, detail + _excluded_summary(info),
                bytes_saved=sum(freed.values()) - stored)


def _nbytes(qw) -> int:
    return sum(t.numel() * t.element_size() for t in qw if isinstance(t, torch.Tensor))
