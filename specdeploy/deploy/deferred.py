"""Weights loaded deferred: GGUF block-quantized linears whose fp32 values are never written.

`build` loads a GGUF model with `defer_blocks=True` where `ggml_linears` will compute with the
blocks (loading.py): those parameters are placeholders over never-written anonymous memory (no
resident pages, reads give zeros) and `model.ggml_deferred` names them, name -> placeholder.
Whatever still reads one after the pipeline (a linear the pass left alone, a program that
borrowed the weight) gets it filled from its blocks here, so no deferred zero is ever computed
with; the fp32 copy is then resident, as it was before.
"""
from __future__ import annotations

from torch import fx

from specdeploy.ops.ggml_linear import GGMLWeight, dequantize
from specdeploy.ops.ggml_tiled import TiledMember, member_rows


def deferred_ptrs(model) -> dict[int, GGMLWeight | TiledMember]:
    """data_ptr -> blocks of the model's placeholders not filled yet."""
    pending = getattr(model, "ggml_deferred", None) or {}
    blocks = getattr(model, "ggml_weights", None) or {}
    return {t.data_ptr(): blocks[name] for name, t in pending.items()}


def materialize_deferred(gm: fx.GraphModule, model) -> int:
    """Fill the placeholders `gm` still reads (through any view); how many were filled."""
    pending = getattr(model, "ggml_deferred", None) or {}
    if not pending:
        return 0
    by_ptr = {t.data_ptr(): name for name, t in pending.items()}
    n = 0
    for t in (*gm.parameters(), *gm.buffers()):
        name = by_ptr.get(t.untyped_storage().data_ptr())
        if name is not None and name in pending:
            fill_from_blocks(model.ggml_weights[name], pending.pop(name))
            n += 1
    return n


def fill_from_blocks(w: GGMLWeight | TiledMember, out) -> None:
    """`out` (fp32, w's shape) := w's values; ggml_linears repacks the blocks of the weights the
    tiled kernel runs (TiledMember: their rows of the tiled copy), same values either way."""
    if isinstance(w, TiledMember):
        member_rows(w, out=out)
    else:
        dequantize(w, out=out)

