"""Sharding hints: how a parameter, a split or a partial sum may be divided over ranks.

Model code states sharding intent once, on the tensors it concerns (DESIGN.md invariant 9, after
AutoDeploy's sharding IR); the `shard` transform (deploy/passes/shard.py) reads the hints for a
`DistConfig` and rewrites the graph for one rank, or drops them at world size 1.

A hint is inert outside torch.export: `tp_param(w, ...)` returns `w`, `tp_split` is `torch.split`,
`tp_reduce` returns its input, so eager forwards and drafter training pay nothing. Under export
each becomes a `torch.ops.specdeploy.tp_*` node whose arguments carry the intent.

Segments. A sharded dimension is a run of segments `Seg(size, unit, lead)`: `size // unit` units
(heads, groups, experts' rows) of `unit` elements each, split evenly over the ranks; `lead > 0`
says these units serve `lead` leading units (GQA: KV heads serve the query heads), so a rank keeps
the units its share of the leaders reads: shared KV heads are replicated when fewer than ranks.
Head counts in views are written as -1 in the model files, so a rank's views need no rewrite.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LAYER_TYPES", "TP_MODES", "Seg", "heads", "linear_col", "linear_partial", "linear_row",
           "piece_sizes", "seg_index", "seg_units", "segs_of", "tp_param", "tp_reduce", "tp_split"]

LAYER_TYPES = ("mha", "ssm", "delta", "mlp", "moe", "lm_head")
# colwise: a producer's output rows (or a per-channel parameter); rowwise: a consumer's input
# columns, its result a partial sum (its bias is kept on rank 0 only); expert_*: the same for
# fused expert weights [E, ...], whose dim 0 is also split by expert parallelism.
TP_MODES = ("colwise", "rowwise", "expert_colwise", "expert_rowwise")


class Seg(NamedTuple):
    size: int
    unit: int = 1
    lead: int = 0


def heads(n: int, dim: int, lead: int = 0) -> Seg:
    """`n` heads of `dim` elements (serving `lead` leading heads when > 0)."""
    return Seg(n * dim, dim, lead)


def _check(layer_type: str, tp_mode: str | None = None) -> None:
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"sharding hint: layer_type {layer_type!r} not in {LAYER_TYPES}")
    if tp_mode is not None and tp_mode not in TP_MODES:
        raise ValueError(f"sharding hint: tp_mode {tp_mode!r} not in {TP_MODES}")


def _flat(segs) -> tuple[list[int], list[int], list[int]]:
    segs = [Seg(*s) for s in segs]
    return [s.size for s in segs], [s.unit for s in segs], [s.lead for s in segs]


def tp_param(w: torch.Tensor, layer_type: str, tp_mode: str, dim: int, segs=()) -> torch.Tensor:
    """`w` (a parameter) split on `dim` by `segs` (empty: whole dim, for a rowwise bias)."""
    if not torch.compiler.is_exporting():
        return w
    _check(layer_type, tp_mode)
    return torch.ops.specdeploy.tp_param(w, layer_type, tp_mode, dim, *_flat(segs))


def tp_split(x: torch.Tensor, layer_type: str, pieces, dim: int = -1) -> list[torch.Tensor]:
    """`torch.split` of `x` into `pieces`, each a list of segments (its size is their sum)."""
    if not torch.compiler.is_exporting():
        return list(x.split([sum(Seg(*s).size for s in p) for p in pieces], dim))
    _check(layer_type)
    counts = [len(p) for p in pieces]
    return list(torch.ops.specdeploy.tp_split(x, layer_type, dim, counts,
                                              *_flat([s for p in pieces for s in p])))


def tp_reduce(x: torch.Tensor, layer_type: str) -> torch.Tensor:
    """Where the partial sums of a sharded `layer_type` block complete (an all-reduce at TP > 1)."""
    if not torch.compiler.is_exporting():
        return x
    _check(layer_type)
    return torch.ops.specdeploy.tp_reduce(x, layer_type)


def _eager() -> bool:
    """Outside torch.export the hints mean nothing: the wrappers call the module itself (the
    same math), so its hooks run as they would without hints (oracles in tests use them)."""
    return not torch.compiler.is_exporting()


def linear_col(mod: nn.Linear, x: torch.Tensor, layer_type: str, segs=None) -> torch.Tensor:
    """`mod(x)` with its output features split by `segs` (default: one segment, unit 1)."""
    if _eager():
        return mod(x)
    segs = segs or [Seg(mod.out_features)]
    w = tp_param(mod.weight, layer_type, "colwise", 0, segs)
    b = None if mod.bias is None else tp_param(mod.bias, layer_type, "colwise", 0, segs)
    return F.linear(x, w, b)


def linear_row(mod: nn.Linear, x: torch.Tensor, layer_type: str, segs=None) -> torch.Tensor:
    """`mod(x)` on a rank's share of its input features: a partial sum (bias on rank 0 only)."""
    if _eager():
        return mod(x)
    w = tp_param(mod.weight, layer_type, "rowwise", 1, segs or [Seg(mod.in_features)])
    return F.linear(x, w, None if mod.bias is None else tp_param(mod.bias, layer_type, "rowwise",
                                                                    0))


def linear_partial(mod: nn.Linear, x: torch.Tensor, layer_type: str) -> torch.Tensor:
    """A replicated `mod` applied to a partial sum `x` (linear, so the sum commutes with it);
    only its bias must be added once."""
    if _eager():
        return mod(x)
    return F.linear(x, mod.weight, None if mod.bias is None else tp_param(
        mod.bias, layer_type, "rowwise", 0))


# ---- what one rank keeps (the shard transform's index math) ----------------------------------
def seg_units(n: int, lead: int, tp: int, rank: int, what: str) -> list[int]:
    """The units (of `n`) rank `rank` of `tp` keeps. `lead > 0`: they serve `lead` leading units
    (KV heads → query heads); a rank keeps those its share of the leaders reads, one per leader
    when the sharing is uneven (3 KV heads over 2 ranks), so its local GQA stays uniform."""
    if lead == 0:
        if n % tp:
            raise ValueError(f"shard: {what}: {n} heads/units do not divide over "
                             f"tensor_parallel_size={tp}")
        k = n // tp
        return list(range(rank * k, (rank + 1) * k))
    if lead % tp or lead % n:
        raise ValueError(f"shard: {what}: {lead} leading heads over {n} shared heads cannot split "
                         f"over tensor_parallel_size={tp}")
    per = lead // tp
    need = [j * n // lead for j in range(rank * per, (rank + 1) * per)]
    uniq = sorted(set(need))
    if per % len(uniq) == 0 and all(need.count(u) == per // len(uniq) for u in uniq):
        return uniq
    return need


def seg_index(segs: list[Seg], tp: int, rank: int, what: str) -> list[list[int]]:
    """Per segment, the element indices (into the whole dimension) rank `rank` keeps."""
    out, off = [], 0
    for s in segs:
        units = seg_units(s.size // s.unit, s.lead, tp, rank, what)
        out.append([off + u * s.unit + e for u in units for e in range(s.unit)])
        off += s.size
    return out


def segs_of(sizes, units, leads) -> list[Seg]:
    return [Seg(*x) for x in zip(sizes, units, leads)]


# ---- the hint ops (identity at world size 1; the shard transform replaces every one) ----------
@torch.library.custom_op("specdeploy::tp_param", mutates_args=())
def _tp_param(w: torch.Tensor, layer_type: str, tp_mode: str, dim: int, sizes: list[int],
              units: list[int], leads: list[int]) -> torch.Tensor:
    return w.clone()


@_tp_param.register_fake
def _(w, layer_type, tp_mode, dim, sizes, units, leads):
    return torch.empty_like(w)


@torch.library.custom_op("specdeploy::tp_split", mutates_args=())
def _tp_split(x: torch.Tensor, layer_type: str, dim: int, counts: list[int], sizes: list[int],
              units: list[int], leads: list[int]) -> list[torch.Tensor]:
    return [t.clone() for t in x.split(piece_sizes(counts, sizes), dim)]


@_tp_split.register_fake
def _(x, layer_type, dim, counts, sizes, units, leads):
    return [t.clone() for t in x.split(piece_sizes(counts, sizes), dim)]


def piece_sizes(counts: list[int], sizes: list[int]) -> list[int]:
    out, i = [], 0
    for c in counts:
        out.append(sum(sizes[i:i + c]))
        i += c
    return out


@torch.library.custom_op("specdeploy::tp_reduce", mutates_args=())
def _tp_reduce(x: torch.Tensor, layer_type: str) -> torch.Tensor:
    return x.clone()


@_tp_reduce.register_fake
def _(x, layer_type):
    return torch.empty_like(x)
