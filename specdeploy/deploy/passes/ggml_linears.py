"""Linears whose weights came from GGUF Q4_0 / Q4_1 / Q8_0 blocks compute with those blocks on
the CPU.

A decode step streams every weight once; the default model's are 540 MB as fp32 and 96 MB as
blocks. `ops/ggml_linear.py` expands each block in registers to the exact fp32 weight values,
so this changes where the weights are read from, not the model. Up to MAX_ROWS input rows (decode
and verify steps at small batch) run on the blocks; prefill chunks and large batches, where a
GEMM over fp32 weights is faster, keep the fp32 path (`pack_linears.packed_linear_fn`).
`python bench/linear_rows.py --threads 2` measures both per row count, side by side.

`ctx.kernels` picks the kernel on the blocks: "exact" (the default) keeps the fp32 model bit for
bit as above; "fast" quantizes each input row to 8-bit blocks and runs integer dot products
(`ops/ggml_int.py`, as llama.cpp does; a slightly different model, its error bound in that
module). Both keep rows batch-invariant, so greedy speculative = greedy plain either way.

Linears reading one input (q/k/v, gate/up) share one kernel call, as `fuse_linears` does for
fp32 weights. A weight matches by identity with the loaded parameter that has blocks
(`model.ggml_weights`, set by the loader for GGUF files loaded as fp32); one a transform replaced
(quantized, sharded) does not match and keeps its path. Skipped when compiling, off the CPU, and
where the kernel cannot be built here (the report says why).
"""
from __future__ import annotations

import os

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.graph import attr_tensor, split_fused_output
from specdeploy.deploy.passes.pack_linears import pack_fits, packable, packed_linear_fn
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import ggml_int
from specdeploy.ops.ggml_linear import (
    GGMLWeight,
    concat_rows,
    ggml_linear,
    kernel_unavailable,
    warn_unbuilt,
)

_LINEAR = torch.ops.aten.linear.default
# Above this many rows the fp32 GEMM wins (bench/results/linear_rows_q4_1.json: about even at
# 16 rows, fp32 ahead at 32)
MAX_ROWS = 16


KERNELS = ("exact", "fast")


def ggml_linear_fn(weight: GGMLWeight, fallbacks: list, bias: torch.Tensor | None,
                   isa: str | None = None):
    """x -> x @ W^T (+ bias): the blocks up to MAX_ROWS rows (the exact kernel, or with `isa`
    the integer-dot one on that ISA path), else the fp32 `fallbacks` (one per fused member,
    concatenated along the output)."""
    bias = None if bias is None else bias.detach()

    def linear_on_blocks(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= MAX_ROWS:
            if isa is not None:
                return ggml_int.ggml_linear_int(x, weight, bias, isa)
            return ggml_linear(x, weight, bias)
        if len(fallbacks) == 1:
            return fallbacks[0](x)
        return torch.cat([f(x) for f in fallbacks], -1)

    return linear_on_blocks


def _weight_map(ctx: DeployContext) -> dict:
    named = getattr(ctx.model, "ggml_weights", None) or {}
    out = {}
    for name, p in ctx.model.named_parameters():
        if name in named:
            out[(p.data_ptr(), tuple(p.shape), p.stride())] = named[name]
    return out


def _blocks_of(gm, node, weights) -> GGMLWeight | None:
    w = attr_tensor(gm, node.args[1])
    if w is None or w.dtype != torch.float32:
        return None
    return weights.get((w.data_ptr(), tuple(w.shape), w.stride()))


def _same_values(w: torch.Tensor, gw: GGMLWeight) -> bool:
    """Whether the blocks still hold `w` (nothing edited it in place since loading): unit rows
    through the kernel give columns of W exactly (d * q + m rounded once, as gguf does), checked
    at four columns spread over the input."""
    k = w.shape[1]
    cols = torch.tensor([0, k // 3, (2 * k) // 3, k - 1])
    unit = torch.zeros(len(cols), k)
    unit[torch.arange(len(cols)), cols] = 1.0
    return torch.equal(ggml_linear(unit, gw), w.detach()[:, cols].t())


def _not_here(ctx: DeployContext) -> str | None:
    if ctx.compile:
        return "compile=True"
    if ctx.device.type != "cpu":
        return f"CPU kernels; device is {ctx.device}"
    return None


@register("ggml_linears", Stage.OPTIMIZE, skip_if=_not_here)
def ggml_linears(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    weights = _weight_map(ctx) if ctx.model is not None else {}
    if not weights:
        return Skipped("no GGUF Q4_0 / Q4_1 / Q8_0 weights")
    why = kernel_unavailable()
    if why:
        return Skipped(f"kernel unavailable: {why}")
    isa, note = _fast_isa(ctx.kernels)
    # linears on blocks, grouped by their input (one kernel call per group)
    groups: dict[fx.Node, list[tuple[fx.Node, GGMLWeight]]] = {}
    stale = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _LINEAR:
            gw = _blocks_of(gm, node, weights)
            if gw is not None and not _same_values(attr_tensor(gm, node.args[1]), gw):
                stale, gw = stale + 1, None  # NOTE: edited since loading: keep the fp32 path
            if gw is not None:
                groups.setdefault(node.args[0], []).append((node, gw))
    todo = []  # kernel calls: the bias-free members of a group that share a kind fuse
    for members in groups.values():
        fusable: dict[tuple, list] = {}
        for node, gw in members:
            if _bias(node) is None:
                fusable.setdefault((gw.kind, gw.shape[1]), []).append((node, gw))
            else:
                todo.append([(node, gw)])
        todo.extend(fusable.values())
    # the fp32 path above MAX_ROWS rows, one per weight (a tied head shares it), packed for
    # oneDNN within pack_linears' memory budget
    weight_of = {node: attr_tensor(gm, node.args[1]) for members in todo for node, _ in members}
    pack = pack_fits(sum({w.data_ptr(): w.nbytes for w in weight_of.values()}.values()))
    fp32, fallback_of, packed = {}, {}, {}
    for node, w in weight_of.items():
        b = attr_tensor(gm, _bias(node))
        key = (w.data_ptr(), None if b is None else b.data_ptr())
        if key not in fp32:
            fp32[key] = packed_linear_fn(w, b, pack and packable(w))
            if pack and packable(w):
                packed[w.data_ptr()] = w.nbytes
        fallback_of[node] = fp32[key]
    for members in todo:
        _replace(gm, members, [fallback_of[node] for node, _ in members], isa)
    n_nodes = len(fallback_of)
    stored = sum(gw.blocks.nbytes for members in todo for _, gw in members)
    return Done(n_nodes, f"{n_nodes} linears on {stored / 2**20:.0f} MiB of blocks (<= "
                         f"{MAX_ROWS} rows, {note}); fp32 above, oneDNN-packed copies "
                         f"+{sum(packed.values()) / 2**20:.0f} MiB"
                         + (f"; {stale} weights changed since loading left fp32" if stale else ""))


def _fast_isa(kernels: str) -> tuple[str | None, str]:
    """(ISA path of the integer-dot kernels or None for the exact one, what the report says).
    "fast" falls back to the exact kernel, with one warning, where no SIMD integer path runs
    (the portable scalar one is slower than fp32 there) unless SPECDEPLOY_GGML_ISA forces it."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels: one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == "exact":
        return None, "exact fp32 kernel"
    why = ggml_int.kernel_unavailable()
    if why is None:
        isa = ggml_int.default_isa()
        if isa != "scalar" or os.environ.get("SPECDEPLOY_GGML_ISA") == "scalar":
            return isa, f"integer-dot kernel, {isa}"
        why = "no SIMD integer path on this CPU"
        warn_unbuilt("the fast integer-dot path", why)
    return None, f"exact fp32 kernel; fast unavailable: {why}"


def _bias(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else None


def _replace(gm: fx.GraphModule, members: list[tuple[fx.Node, GGMLWeight]], fallbacks: list,
             isa: str | None) -> None:
    """One kernel call for `members` (linears of one input, in graph order)."""
    nodes = [n for n, _ in members]
    gw = members[0][1] if len(members) == 1 else concat_rows([g for _, g in members])
    bias = attr_tensor(gm, _bias(nodes[0])) if len(nodes) == 1 else None
    with gm.graph.inserting_before(nodes[0]):
        out = gm.graph.call_function(ggml_linear_fn(gw, fallbacks, bias, isa), (nodes[0].args[0],))
    if len(nodes) == 1:
        out.meta = dict(nodes[0].meta)
        nodes[0].replace_all_uses_with(out)
        gm.graph.erase_node(nodes[0])
        return
    split_fused_output(gm, out, nodes, [g.shape[0] for _, g in members])
