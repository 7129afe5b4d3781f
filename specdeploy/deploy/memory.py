"""Where a deployment's bytes are: weights it holds (fp tensors, GGUF blocks, packed copies),
its cache, and the process's resident memory (what `deploy --list-transforms`, `LLM.stats()`
and bench/memory.py report).

Transforms keep some weights outside the graph's parameters, in the closures they call (GGUF
blocks in `ggml_linears`, oneDNN-packed copies in `pack_linears`, expert blocks in a fused MoE
block's parts); those are counted by walking what the graph's call_function targets hold.
"""
from __future__ import annotations

import types
from typing import NamedTuple

import torch
from torch import fx


class WeightBytes(NamedTuple):
    params: int  # the graph's parameters and non-cache buffers (fp weights, norms, int8, ...)
    closures: int  # tensors transforms hold in what the graph calls (GGUF blocks, packed copies)

    @property
    def total(self) -> int:
        return self.params + self.closures


def _nbytes(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of a tensor's storage; opaque (oneDNN) tensors count their elements."""
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def _held_tensors(x, out: dict, seen: set, depth: int = 0) -> None:
    """Tensors reachable from `x` through tuples and lists (GGMLWeight, TiledMember and other
    NamedTuples), a function's closure cells and attributes (a one-call experts closure keeps
    its blocks as `.blocks`; a fused MoE block holds that closure in its `Parts`), and what an
    object names in its `held_callables()` (a fused chain's fallback: the linears it replaced).
    Dicts and other objects are not entered: kernels keep their scratch buffers in them."""
    if depth > 6 or id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, torch.Tensor):
        k, b = _nbytes(x)
        out[k] = b
    elif isinstance(x, (tuple, list)):
        for y in x:
            _held_tensors(y, out, seen, depth + 1)
    elif isinstance(x, types.FunctionType):
        for cell in x.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            _held_tensors(v, out, seen, depth + 1)
        for v in x.__dict__.values():
            _held_tensors(v, out, seen, depth + 1)
    elif callable(getattr(x, "held_callables", None)):
        _held_tensors(list(x.held_callables()), out, seen, depth + 1)


def weight_bytes(gm: fx.GraphModule, cache_names: set[str] = frozenset()) -> WeightBytes:
    """Bytes of the weights `gm` holds; buffers named in `cache_names` (the KV and state
    buffers the cache plan allocated) are the cache's, not weights."""
    params: dict = {}
    cache: set = set()
    for name, t in (*gm.named_parameters(), *gm.named_buffers()):
        k, b = _nbytes(t)
        if name in cache_names:
            cache.add(k)
        else:
            params[k] = b
    closures: dict = {}
    seen: set = set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            _held_tensors(node.target, closures, seen)
    # NOTE: a fused decoder layer keeps its KV cache in its closure after its first call: that
    # is the cache's (counted as weights, the 16-sequence default's 755 MB cache made
    # bench/memory.py report 852 MB of weights on a 92 MB model, 2026-12-05)
    closures = {k: b for k, b in closures.items() if k not in params and k not in cache}
    return WeightBytes(sum(params.values()), sum(closures.values()))


def process_memory() -> dict[str, int]:
    """This process's resident bytes now (`rss`) and at its peak (`peak_rss`), from
    /proc/self/status (VmRSS / VmHWM); empty where that file does not exist."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = {"VmRSS:": "rss", "VmHWM:": "peak_rss"}.get(line.split(":")[0] + ":")
                if key:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out
