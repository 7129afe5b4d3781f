"""torch.export of a plain model into a flat `torch.fx.GraphModule`.

The model's `forward(input_ids[B,T], position_ids[B,T])` is exported with a dynamic token
dimension (B = 1: the engine feeds one flattened ragged batch). The result is a plain GraphModule
(positional inputs, tuple output) whose nodes still call the canonical `torch.ops.specdeploy.*`
ops — the anchors that the transforms in `deploy/passes/` match.
"""
from __future__ import annotations

import torch
from torch import fx, nn

import specdeploy.ops  # noqa: F401  (registers the canonical ops)
from specdeploy.deploy import export_cache


def export_model(
    model: nn.Module, example_tokens: int = 8, max_tokens: int = 1 << 16,
    hidden_size: int | None = None, dtype: torch.dtype = torch.float32, mrope: bool = False,
    keep_hints: bool = False,
) -> fx.GraphModule:
    """Export `model` with T dynamic in [1, max_tokens]; returns a flat GraphModule.

    Inputs are (input_ids[1,T], position_ids[1,T]) and, for drafters (`hidden_size` set), a third
    one: hidden[1,T,hidden_size]. `mrope`: positions are [3,1,T] (multimodal RoPE; the target
    of a vision-language model then takes its input embeddings as `hidden`).
    NOTE: the example uses T > 1 (export specializes sizes 0 and 1).
    Sharding hints (ops/shard.py) are dropped unless `keep_hints` (the `shard` transform reads
    them): a one-process graph is exactly what the model computes, for every transform.
    """
    # the examples live where the weights do (a CUDA deployment exports its CUDA model)
    dev = next(iter(model.parameters()), torch.empty(0)).device
    ids = torch.zeros(1, example_tokens, dtype=torch.long, device=dev)
    pos = torch.arange(example_tokens, dtype=torch.long, device=dev)[None]
    tokens = torch.export.Dim("tokens", min=2, max=max_tokens)
    args: tuple = (ids, pos)
    dyn: tuple = ({1: tokens}, {1: tokens})
    if mrope:
        args, dyn = (ids, pos.expand(3, 1, -1).contiguous()), ({1: tokens}, {2: tokens})
    if hidden_size is not None:
        args += (torch.zeros(1, example_tokens, hidden_size, dtype=dtype, device=dev),)
        dyn += ({1: tokens},)
    key = hit = None
    if export_cache.enabled():  # NOTE: one entry (with the hints) serves both `keep_hints`
        key = export_cache.fingerprint(model, (example_tokens, max_tokens, hidden_size, dtype,
                                               mrope, str(dev)))
        hit = export_cache.lookup(key, model)
        if hit is not None and not export_cache.checking():
            return _hinted(hit, keep_hints)
    with torch.no_grad():
        ep = torch.export.export(model, args, dynamic_shapes=dyn, strict=False)
    gm = _flatten_io(ep.module())
    export_cache.store(key, gm, model)
    _hinted(gm, keep_hints)
    if key is not None and hit is not None:
        export_cache.check(_hinted(hit, keep_hints), gm)
    return gm


def _hinted(gm: fx.GraphModule, keep_hints: bool) -> fx.GraphModule:
    if not keep_hints:
        from specdeploy.deploy.passes.shard import drop_hints

        drop_hints(gm)
    return gm


def _flatten_io(gm: fx.GraphModule) -> fx.GraphModule:
    """Drop the pytree calling convention, the input-guard call and the input-check hook that
    `ep.module()` adds, so transforms can add inputs freely; the graph takes and returns plain
    tensors. A fresh GraphModule carries over only what the graph references."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op == "call_module" and "guards" in str(node.target):
            g.erase_node(node)
    g._codegen = fx.graph.CodeGen()
    flat = fx.GraphModule(gm, g)
    flat.recompile()
    return flat
