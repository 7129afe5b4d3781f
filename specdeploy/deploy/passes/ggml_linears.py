"""Linears whose weights came from GGUF Q4_0 / Q4_1 / Q8_0 blocks compute with those blocks on
the CPU.

A decode step streams every weight once; the default model's are 540 MB as fp32 and 96 MB as
blocks. `ops/ggml_linear.py` expands each block in registers to the exact fp32 weight values,
so this changes where the weights are read from, not the model. Up to MAX_ROWS input rows (decode
and verify steps at small batch) run on the blocks; prefill chunks and large batches, where a
GEMM over fp32 weights is faster, dequantize one weight at a time into one reused buffer and run
the GEMM there (`dequant_linear`; oneDNN as `pack_linears` did with its packed copies, so the
same bits). The blocks are the only copy of these weights the deployment keeps: the fp32
parameters leave the graph, and the embedding gathers its rows from its blocks too.
`python bench/linear_rows.py --threads 2` measures both per row count, side by side.

`ctx.kernels` picks the kernel on the blocks: "exact" (the default) keeps the fp32 model bit for
bit as above; "fast" quantizes each input row to 8-bit blocks and runs integer dot products
(`ops/ggml_int.py`, as llama.cpp does; a slightly different model, its error bound in that
module). Both keep rows batch-invariant, so greedy speculative = greedy plain either way.

Linears reading one input (q/k/v, gate/up) share one kernel call, as `fuse_linears` does for
fp32 weights. A weight matches by identity with the loaded parameter that has blocks
(`model.ggml_weights`, set by the loader for GGUF files loaded as fp32); one a transform replaced
(quantized, sharded) does not match and keeps its path. `build` loads those parameters deferred
(`model.ggml_deferred`: never-written placeholders, not resident) where this pass will run; a
placeholder still read afterwards is filled from its blocks (`materialize_deferred`). Skipped
when compiling, off the CPU, and where the kernel cannot be built (the report says why).
"""
from __future__ import annotations

import os

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.deferred import deferred_ptrs, materialize_deferred
from specdeploy.deploy.graph import attr_tensor, drop_unread_params, split_fused_output
from specdeploy.deploy.passes.pack_linears import packable
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import ggml_int
from specdeploy.ops.ggml_linear import (
    GGMLWeight,
    concat_rows,
    dequantize,
    ggml_embedding,
    ggml_linear,
    kernel_unavailable,
    scratch,
    warn_unbuilt,
)

_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default
# Above this many rows the fp32 GEMM wins for the exact kernel (bench/results/
# linear_rows_q4_1.json: about even at 16 rows, fp32 ahead at 32). The integer-dot kernels
# ("fast") take every row count: bench/linear_rows.py --threads 1 --clock cpu, ms of CPU for 30
# layers, int-dot avx2 / dequantize + GEMM: 64 rows 337 / 696, 256 rows 1277 / 1328
# (bench/results/linear_rows_one_copy.json; a shared 2-core machine)
MAX_ROWS = 16


KERNELS = ("exact", "fast")


def ggml_linear_fn(weight: GGMLWeight, members: list[GGMLWeight], bias: torch.Tensor | None,
                   isa: str | None = None):
    """x -> x @ W^T (+ bias): with `isa`, the integer-dot kernel on that ISA path at every row
    count; else the exact kernel up to MAX_ROWS rows and above that `dequant_linear` per fused
    member (views of `weight`'s rows), concatenated along the output."""
    bias = None if bias is None else bias.detach()
    if isa is not None:  # every row count: faster than dequantizing (see MAX_ROWS)
        fast = ggml_int.bound_linear(weight, bias, isa)
        fast.__name__ = fast.__qualname__ = "linear_on_blocks"  # the graph's node names
        return fast

    def linear_on_blocks(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= MAX_ROWS:
            return ggml_linear(x, weight, bias)
        if len(members) == 1:
            return dequant_linear(x, members[0], bias)
        return torch.cat([dequant_linear(x, m, None) for m in members], -1)

    return linear_on_blocks


def dequant_linear(x: torch.Tensor, weight: GGMLWeight, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """x @ W^T (+ bias) through W dequantized into the reused buffer: oneDNN on its blocked
    layout for weights `pack_linears` packed (the bits of its packed path), else aten.linear."""
    n, k = weight.shape
    w = dequantize(weight, out=scratch(n * k))
    if packable(w) and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        x2 = x.reshape(-1, k)
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], n)
    return torch.nn.functional.linear(x, w, bias)


def _weight_map(ctx: DeployContext) -> dict:
    named = getattr(ctx.model, "ggml_weights", None) or {}
    out = {}
    for name, p in ctx.model.named_parameters():
        if name in named:
            out[(p.data_ptr(), tuple(p.shape), p.stride())] = named[name]
    # a drafter's: weights it borrows from the target and its own Q8_0 ones (deploy/spec.py)
    for p, gw in getattr(ctx.model, "ggml_tensors", ()):
        out[(p.data_ptr(), tuple(p.shape), p.stride())] = gw
    return out


def _blocks_of(gm, node, weights) -> GGMLWeight | None:
    w = attr_tensor(gm, node.args[0 if node.target is _EMBEDDING else 1])
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
    deferred = deferred_ptrs(ctx.model)
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
            w = attr_tensor(gm, node.args[1]) if gw is not None else None
            if gw is not None and w.data_ptr() not in deferred and not _same_values(w, gw):
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
    attrs = {node.args[1].target for members in todo for node, _ in members}
    stacked = {}  # id(member blocks) -> its view of the stacked copy
    for members in todo:
        stacked.update(_replace(gm, members, isa))
    named = ctx.model.ggml_weights  # NOTE: the loaded copies go now, not when the model does
    named.update({n: stacked[id(g)] for n, g in named.items() if id(g) in stacked})
    n_emb, emb_bytes, tables = _embeddings(gm, weights, deferred)
    freed = drop_unread_params(gm, attrs | tables)
    filled = materialize_deferred(gm, ctx.model)
    n_nodes = sum(len(members) for members in todo)
    stored = sum(gw.blocks.nbytes for members in todo for _, gw in members)
    return Done(n_nodes, f"{n_nodes} linears on {stored / 2**20:.0f} MiB of blocks "
                + (f"({note}, every row count), " if isa else f"(<= {MAX_ROWS} rows {note}; "
                   "above: dequantized one weight at a time), ")
                + f"{n_emb} embeddings on {emb_bytes / 2**20:.0f} MiB; fp32 parameters out of "
                f"the graph: {freed / 2**20:.0f} MiB"
                + (f"; {filled} deferred weights filled from blocks" if filled else "")
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


def _replace(gm: fx.GraphModule, members: list[tuple[fx.Node, GGMLWeight]],
             isa: str | None) -> dict[int, GGMLWeight]:
    """One kernel call for `members` (linears of one input, in graph order); returns
    id(member's blocks) -> its row view of the stacked copy (fused members only)."""
    nodes = [n for n, _ in members]
    gw = members[0][1] if len(members) == 1 else concat_rows([g for _, g in members])
    views, start = [], 0  # NOTE: the members as row views of the one stacked copy
    for _, g in members:
        views.append(GGMLWeight(g.kind, gw.blocks[start:start + g.shape[0]], g.shape))
        start += g.shape[0]
    bias = attr_tensor(gm, _bias(nodes[0])) if len(nodes) == 1 else None
    with gm.graph.inserting_before(nodes[0]):
        fn = ggml_linear_fn(gw, views, bias, isa)
        out = gm.graph.call_function(fn, (nodes[0].args[0],))
    if len(nodes) == 1:
        out.meta = dict(nodes[0].meta)
        nodes[0].replace_all_uses_with(out)
        gm.graph.erase_node(nodes[0])
        return {}
    split_fused_output(gm, out, nodes, [g.shape[0] for _, g in members])
    return {id(g): view for (_, g), view in zip(members, views)}


def _embeddings(gm: fx.GraphModule, weights: dict, deferred: dict) -> tuple[int, int, set]:
    """Embedding lookups whose table has blocks (still its values) gather their rows from the
    blocks: (lookups, block bytes, the tables' get_attr targets)."""
    n, stored, tables = 0, {}, set()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _EMBEDDING:
            gw, w = _blocks_of(gm, node, weights), attr_tensor(gm, node.args[0])
            if gw is None or (w.data_ptr() not in deferred and not _same_values(w, gw)):
                continue
            tables.add(node.args[0].target)
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(_embedding_fn(gw), (node.args[1],))
            out.meta = dict(node.meta)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
            n, stored[id(gw)] = n + 1, gw.blocks.nbytes
    return n, sum(stored.values()), tables


def _embedding_fn(weight: GGMLWeight):
    def embedding_on_blocks(ids: torch.Tensor) -> torch.Tensor:
        return ggml_embedding(ids, weight)

    return embedding_on_blocks
