"""Weights loaded deferred: GGUF block-quantized linears whose fp32 values are never written.

`build` loads a GGUF model with `defer_blocks=True` where `ggml_linears` will compute with the
blocks (loading.py): those parameters are placeholders over never-written anonymous memory (no
resident pages, reads give zeros) and `model.ggml_deferred` names them, name -> placeholder.
Whatever still reads one after the pipeline (a linear the pass left alone, a program that
borrowed the weight) gets it filled from its blocks here, so no deferred zero is ever computed
with; the fp32 copy is then resident, as it was before. A speculative deployment's drafter
program shares the target's placeholders (`share_deferred`: the embedding, the LM head, a GGUF's
own MTP layers, run on the same blocks by its passes); what a drafter copies outside a graph is
filled first (`fill`, or `filled` for the moment of a copy).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap

from torch import fx

from specdeploy.ops.ggml_linear import GGMLWeight, dequantize
from specdeploy.ops.ggml_tiled import TiledMember, member_rows


def _blocks_by_name(model) -> dict:
    """name -> blocks of the names in `model.ggml_deferred`: the model's own, or the target's
    for a drafter program that shares its placeholders (`share_deferred`)."""
    shared = getattr(model, "ggml_deferred_blocks", None)
    return shared if shared is not None else (getattr(model, "ggml_weights", None) or {})


def deferred_ptrs(model) -> dict[int, GGMLWeight | TiledMember]:
    """data_ptr -> blocks of the model's placeholders not filled yet."""
    pending = getattr(model, "ggml_deferred", None) or {}
    blocks = _blocks_by_name(model)
    return {t.data_ptr(): blocks[name] for name, t in pending.items()}


def share_deferred(step, model) -> None:
    """A drafter program reads target placeholders (the borrowed embedding and LM head, the
    checkpoint's MTP layers): its passes see them as deferred (not as weights edited since
    loading) and fill what they still read from the target's blocks. The same dicts: a fill
    by either program is seen by both."""
    if getattr(model, "ggml_deferred", None):
        step.ggml_deferred = model.ggml_deferred
        step.ggml_deferred_blocks = model.ggml_weights


def fill(model, tensors) -> dict:
    """Fill those of `tensors` that are `model`'s pending placeholders from their blocks (for
    a read outside a graph: a drafter's cast); name -> the filled tensor."""
    pending = getattr(model, "ggml_deferred", None) or {}
    ptrs = {t.data_ptr() for t in tensors}
    names = [name for name, t in pending.items() if t.data_ptr() in ptrs]
    out = {}
    for name in names:
        fill_from_blocks(_blocks_by_name(model)[name], pending[name])
        out[name] = pending.pop(name)
    return out


@contextlib.contextmanager
def filled(model, tensors):
    """`fill` for the block only (a drafter copying its draft vocabulary's LM-head rows): the
    placeholders' pages go back to the OS after it and they are pending again (zeros, not
    resident), so the weights stay one copy, the blocks. Where the pages cannot be returned
    (not Linux), they stay filled."""
    done = fill(model, tensors)
    try:
        yield
    finally:
        for name, t in done.items():
            if _return_pages(t):
                model.ggml_deferred[name] = t


def _return_pages(t) -> bool:
    """MADV_DONTNEED over a placeholder's memory (loading.placeholder: private anonymous pages
    starting at its data_ptr): later reads give zeros and nothing is resident."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    page = mmap.PAGESIZE
    if advice is None or t.data_ptr() % page:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return False
    size = -(-t.untyped_storage().nbytes() // page) * page
    ok = libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(size), advice) == 0
    return ok and not bool(t.view(-1)[:: max(1, t.numel() // 64)].any())


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
            fill_from_blocks(_blocks_by_name(model)[name], pending.pop(name))
            n += 1
    return n


def fill_from_blocks(w: GGMLWeight | TiledMember, out) -> None:
    """`out` (fp32, w's shape) := w's values; ggml_linears repacks the blocks of the weights the
    tiled kernel runs (TiledMember: their rows of the tiled copy), same values either way."""
    if isinstance(w, TiledMember):
        member_rows(w, out=out)
    else:
        dequantize(w, out=out)

