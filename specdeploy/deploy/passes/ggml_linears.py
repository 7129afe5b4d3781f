"""Linears whose weights came from GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / MXFP4 blocks (and the
K-quants Q4_K / Q5_K / Q6_K) compute with those blocks on the CPU.

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
module). Both keep rows batch-invariant, so greedy speculative = greedy plain either way. With
"fast", a kernel call of N % 16 == 0 outputs (all of the default model's) runs on its weights
repacked in tiles of 16 outputs (`ops/ggml_tiled.py`: rows share the unpacked weights, so a
verify step of K + 1 rows costs little more than a decode step); the packed copy replaces the
blocks, a tied embedding gathers from it, and `model.ggml_weights` then names the members' rows
of it (`TiledMember`). Other calls keep `ggml_int` on the blocks (MXFP4, which it does not read:
the exact kernel, at every row count).

Linears reading one input (q/k/v, gate/up) share one kernel call, as `fuse_linears` does for
fp32 weights. A weight matches by identity with the loaded parameter that has blocks
(`model.ggml_weights`, set by the loader for GGUF files loaded as fp32); one a transform replaced
(quantized, sharded) does not match and keeps its path. `build` loads those parameters deferred
(`model.ggml_deferred`: never-written placeholders, not resident) where this pass will run; a
placeholder still read afterwards is filled from its blocks (`materialize_deferred`). Skipped
when compiling, off the CPU, and where the kernel cannot be built (the report says why).
"""
from __future__ import annotations

import torch
from torch import fx

from specdeploy.deploy.context import DeployContext
from specdeploy.deploy.deferred import deferred_ptrs, materialize_deferred
from specdeploy.deploy.graph import attr_tensor, drop_unread_params, split_fused_output
from specdeploy.deploy.passes.ggml_calls import (  # noqa: F401 (MAX_ROWS, dequant_linear: API)
    MAX_ROWS,
    dequant_linear,
    embedding_fn,
    ggml_linear_fn,
    tiled_fn,
)
from specdeploy.deploy.passes.ggml_weights import _fast_isa, _not_here, _weight_map
from specdeploy.deploy.pipeline import Done, Skipped, Stage, register
from specdeploy.ops import ggml_tiled
from specdeploy.ops.ggml_linear import (
    HALF_KINDS,
    GGMLWeight,
    concat_rows,
    ggml_linear,
    kernel_unavailable,
)
from specdeploy.ops.ggml_tiled import TILE, TILED_KINDS, TiledMember, repack

_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default


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


@register("ggml_linears", Stage.OPTIMIZE, skip_if=_not_here)
def ggml_linears(gm: fx.GraphModule, ctx: DeployContext) -> Done | Skipped:
    weights = _weight_map(ctx) if ctx.model is not None else {}
    deferred = deferred_ptrs(ctx.model)
    if not weights:
        return Skipped("no GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / MXFP4 / K-quant weights")
    why = kernel_unavailable()
    if why:
        return Skipped(f"kernel unavailable: {why}")
    isa, note = _fast_isa(ctx.kernels)
    todo, stale = _kernel_calls(gm, weights, deferred)
    attrs = {node.args[1].target for members in todo for node, _ in members}
    n_nodes = sum(len(members) for members in todo)
    # F16 / BF16 (a 16-bit checkpoint's values) run the exact kernel whatever `kernels` says
    half = sum(len(members) for members in todo if members[0][1].kind in HALF_KINDS)
    if half and half == n_nodes:
        note = "exact fp32 kernel: F16 / BF16 values"
    elif half:
        note += f"; {half} F16 / BF16 on the exact fp32 kernel"
    stored = sum(gw.blocks.nbytes for members in todo for _, gw in members)
    tile = isa is not None and ggml_tiled.kernel_unavailable() is None
    named, n_tiled, n_trans = ctx.model.ggml_weights, 0, 0
    while todo:  # NOTE: each call's loaded copies go as soon as it has its own, not at the end
        views = _replace(gm, todo.pop(0), isa, tile)
        n_tiled += sum(isinstance(v, TiledMember) for v in views.values())
        n_trans += sum(isinstance(v, TiledMember) and v.tiled.kind in ggml_tiled.TRANSCODED
                       for v in views.values())
        for d in (named, weights, deferred):
            d.update({key: views[id(g)] for key, g in d.items() if id(g) in views})
    n_emb, emb_bytes, tables = _embeddings(gm, weights, deferred)
    freed = drop_unread_params(gm, attrs | tables)
    filled = materialize_deferred(gm, ctx.model)
    if tile and half < n_nodes:
        note += f", tiled: {n_tiled} of {n_nodes} linears"
        if n_trans:  # (a lattice kind's tiles are IQ4_XS's bytes: ops/ggml_tiled.py)
            note += f" ({n_trans} lattice-kind weights transcoded to IQ4_XS tiles)"
    return Done(n_nodes, f"{n_nodes} linears on {stored / 2**20:.0f} MiB of blocks "
                + (f"({note}, every row count), " if isa else f"(<= {MAX_ROWS} rows {note}; "
                   "above: dequantized one weight at a time), ")
                + f"{n_emb} embeddings on {emb_bytes / 2**20:.0f} MiB; fp32 parameters out of "
                f"the graph: {freed / 2**20:.0f} MiB"
                + (f"; {filled} deferred weights filled from blocks" if filled else "")
                + (f"; {stale} weights changed since loading left fp32" if stale else ""))


def _kernel_calls(gm: fx.GraphModule, weights: dict, deferred: dict) -> tuple[list, int]:
    """The linears on blocks as kernel calls (lists of (node, blocks)): grouped by their input,
    the members of a group that share a kind and all have a bias or none fuse (gpt-oss's
    biased q/k/v: one call, the biases joined). And how many weights changed since loading
    (left on the fp32 path)."""
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
    todo = []
    for members in groups.values():
        fusable: dict[tuple, list] = {}
        for node, gw in members:
            if gw.gather is None and (_bias(node) is None or _bias_tensor(gm, node) is not None):
                key = (gw.kind, gw.shape[1], _bias(node) is None)
                fusable.setdefault(key, []).append((node, gw))
            else:
                todo.append([(node, gw)])
        todo.extend(fusable.values())
    return todo, stale


def _bias(node: fx.Node):
    return node.args[2] if len(node.args) > 2 else None


def _bias_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """A linear's bias where it is a parameter / buffer of the graph (what a fused call can
    join), else None."""
    b = _bias(node)
    t = attr_tensor(gm, b) if isinstance(b, fx.Node) else None
    return t if t is not None and t.dim() == 1 else None


def _replace(gm: fx.GraphModule, members: list[tuple[fx.Node, GGMLWeight]], isa: str | None,
             tile: bool) -> dict[int, GGMLWeight | TiledMember]:
    """One kernel call for `members` (linears of one input, in graph order); returns
    id(member's blocks) -> what holds its values now: its rows of the tiled copy (`tile` and a
    multiple of 16 outputs), else its row view of the stacked copy (fused members only)."""
    nodes, weights = [n for n, _ in members], [g for _, g in members]
    gather = weights[0].gather  # (a Qwen3.5 GGUF's ssm_out: x's columns taken in stored order)
    if weights[0].kind not in TILED_KINDS or (gather is not None and len(weights) > 1):
        tile = False  # (SPECDEPLOY_GGML_TILED_KQUANTS=0)
    bias = attr_tensor(gm, _bias(nodes[0])) if len(nodes) == 1 else None
    if len(nodes) > 1 and _bias(nodes[0]) is not None:  # each output row plus its own bias
        bias = torch.cat([_bias_tensor(gm, n).detach().float() for n in nodes])
    views, start = [], 0
    if tile and sum(g.shape[0] for g in weights) % TILE == 0:
        tw = repack(weights)
        fn = tiled_fn(tw, bias, isa, gather)
        for g in weights:
            views.append(TiledMember(tw, start, g.shape, gather))
            start += g.shape[0]
    else:
        gw = weights[0] if len(weights) == 1 else concat_rows(weights)
        for g in weights:  # NOTE: the members as row views of the one stacked copy
            views.append(GGMLWeight(g.kind, gw.blocks[start:start + g.shape[0]], g.shape,
                                    g.gather))
            start += g.shape[0]
        fn = ggml_linear_fn(gw, views, bias, isa)
    with gm.graph.inserting_before(nodes[0]):
        out = gm.graph.call_function(fn, (nodes[0].args[0],))
    done = {id(g): view for g, view in zip(weights, views)}
    if len(nodes) == 1:
        out.meta = dict(nodes[0].meta)
        nodes[0].replace_all_uses_with(out)
        gm.graph.erase_node(nodes[0])
        return done if isinstance(views[0], TiledMember) else {}
    split_fused_output(gm, out, nodes, [g.shape[0] for g in weights])
    return done


def _embeddings(gm: fx.GraphModule, weights: dict, deferred: dict) -> tuple[int, int, set]:
    """Embedding lookups whose table has blocks (still its values) gather their rows from the
    blocks, or from the tiled copy of a tied head's: (lookups, bytes, the tables' targets)."""
    n, stored, tables = 0, {}, set()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _EMBEDDING:
            gw, w = _blocks_of(gm, node, weights), attr_tensor(gm, node.args[0])
            # NOTE: a tiled table was checked as the head's linear (same parameter)
            if gw is None or (not isinstance(gw, TiledMember) and w.data_ptr() not in deferred
                              and not _same_values(w, gw)):
                continue
            tables.add(node.args[0].target)
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(embedding_fn(gw), (node.args[1],))
            out.meta = dict(node.meta)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
            held = gw.tiled.packed if isinstance(gw, TiledMember) else gw.blocks
            n, stored[held.data_ptr()] = n + 1, held.nbytes
    return n, sum(stored.values()), tables
