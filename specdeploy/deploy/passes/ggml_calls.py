"""What `ggml_linears` puts in the graph: the closures that run a linear or an embedding on
GGUF blocks or on their tiled copy (ops/ggml_linear.py, ggml_int.py, ggml_tiled.py), and the
row count above which the exact kernel hands over to a GEMM."""
from __future__ import annotations

import torch

from specdeploy.deploy.passes.pack_linears import packable
from specdeploy.ops import ggml_int, ggml_tiled
from specdeploy.ops.ggml_linear import (
    GGMLWeight,
    dequantize,
    ggml_embedding,
    ggml_linear,
    scratch,
)
from specdeploy.ops.ggml_tiled import (
    TILE,
    TiledMember,
    TiledWeight,
    member_rows,
    tiled_linear_fn,
)

# Above this many rows the fp32 GEMM wins for the exact kernel (bench/results/
# linear_rows_q4_1.json: about even at 16 rows, fp32 ahead at 32). The integer-dot kernels
# ("fast") take every row count (their model is not the fp32 one): bench/linear_rows.py
# --threads 1 --clock cpu, ms of CPU for 30 layers, int-dot avx2 / dequantize + GEMM: 64 rows
# 337 / 696, 256 rows 1277 / 1328 (bench/results/linear_rows_one_copy.json; a shared 2-core
# machine)
MAX_ROWS = 16



def ggml_linear_fn(weight: GGMLWeight, members: list[GGMLWeight], bias: torch.Tensor | None,
                   isa: str | None = None):
    """x -> x @ W^T (+ bias): with `isa`, the integer-dot kernel on that ISA path at every row
    count; else the exact kernel up to MAX_ROWS rows, above that `dequant_linear` per fused
    member (views of `weight`'s rows), concatenated along the output."""
    bias = None if bias is None else bias.detach()
    if isa is not None and weight.kind not in ggml_int.INT_KINDS:
        return exact_fn(weight, bias)
    if isa is not None:
        # NOTE: every row count, K-quants too (slower than the fp32 GEMM above ~16 rows:
        # bench/results/kquant_rows_amx_1205.json): "fast" is another model than the fp32 one,
        # and a row must get the same function whatever the rows beside it, or a decode row
        # inside a prefill chunk or a verify step of > 16 rows differs from itself alone
        fast = ggml_int.bound_linear(weight, bias, isa)
        fast.__name__ = fast.__qualname__ = "linear_on_blocks"  # the graph's node names
        return fast
    starts = [sum(m.shape[0] for m in members[:i]) for i in range(len(members))]

    def linear_on_blocks(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] <= MAX_ROWS:
            return ggml_linear(x, weight, bias)
        if len(members) == 1:
            return dequant_linear(x, members[0], bias)
        return torch.cat([dequant_linear(x, m, None if bias is None else bias[a:a + m.shape[0]])
                          for m, a in zip(members, starts)], -1)

    return linear_on_blocks


def exact_fn(weight: GGMLWeight, bias: torch.Tensor | None):
    """x -> x @ W^T (+ bias) on the exact kernel at every row count: a "fast" deployment's
    MXFP4 weights that no tiled copy runs (outputs not in 16s; ggml_int has no MXFP4 kernel).
    NOTE: no GEMM above MAX_ROWS: a row gets the same function whatever the rows beside it."""

    def linear_on_blocks(x: torch.Tensor) -> torch.Tensor:
        return ggml_linear(x, weight, bias)

    return linear_on_blocks


def expert_fast_fn(weight: GGMLWeight, bias: torch.Tensor | None, isa: str):
    """An expert matrix's "fast" linear (the per-expert loop of deploy/passes/ggml_experts.py):
    the integer-dot kernel; MXFP4, which has none there, on its tiled copy (outputs in 16s: the
    one-call kernel's numbers), else `exact_fn`."""
    if weight.kind in ggml_int.INT_KINDS:
        return ggml_int.bound_linear(weight, bias, isa)
    if (weight.kind in ggml_tiled.TILED_KINDS and weight.shape[0] % TILE == 0
            and ggml_tiled.kernel_unavailable() is None):
        return tiled_linear_fn(ggml_tiled.repack(weight), bias, isa)
    return exact_fn(weight, bias)


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


def tiled_fn(tw: TiledWeight, bias: torch.Tensor | None, isa: str,
             gather: torch.Tensor | None = None):
    """x -> x @ W^T (+ bias) on the tiled copy, at every row count (one kernel per weight: the
    tiled and the GGUF-order kernels sum in different orders); `gather`: x's columns taken in
    the copy's stored order first."""
    fn = tiled_linear_fn(tw, None if bias is None else bias.detach(), isa, gather)
    fn.__name__ = fn.__qualname__ = "linear_on_blocks"  # the graph's node names
    return fn


def embedding_fn(weight: GGMLWeight | TiledMember):
    """ids -> the table's rows: from the blocks, or from the tiled copy of a tied head."""
    if isinstance(weight, TiledMember):
        k = weight.shape[1]

        def embedding_on_tiles(ids: torch.Tensor) -> torch.Tensor:
            return member_rows(weight, ids).view(*ids.shape, k)

        embedding_on_tiles.__name__ = "embedding_on_blocks"
        return embedding_on_tiles

    def embedding_on_blocks(ids: torch.Tensor) -> torch.Tensor:
        return ggml_embedding(ids, weight)

    return embedding_on_blocks
