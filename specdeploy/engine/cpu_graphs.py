"""CPU graphs: a decode or verify step of the deployed graph recorded once per bucket as the C
kernel calls and torch ops it made, then replayed without the graph's Python.

Why: on the CPU fast path a step is ~50-300 graph calls, each a Python closure that checks its
inputs, allocates its result and calls one C kernel. At batch 1 on a small model that Python
was most of the step (perf on a hybrid MoE GGUF: ~60% of the main thread's time, the OpenMP
worker idle meanwhile). Like a CUDA graph (engine/cuda_graphs.py: the same runner, buckets,
static inputs and padding), a `CpuGraph` runs the step once under a recorder and keeps its
effects: every call into the kernel libraries (ctypes `errcheck` hooks: the function and its
arguments, pointers included) and every torch op (a dispatch mode: ops that compute values are
re-run, views and allocations are kept). A replay re-makes those calls in order on the same
buffers; only the static input buffer changes between replays. Runs of kernel calls are made by
one C loop each (ops/replay_calls.py: the arguments laid out once; ~2.5 us of ctypes a call
less, 8-11% of a hybrid MoE GGUF's decode step), where the calling convention allows.

What makes a replay valid, and what capture checks (it refuses, and the step runs eagerly, where
one does not hold):
- No Python decision may read a value that changes between replays: a host read (`tolist`,
  `item`, `bool`, ...) of any tensor but the bucket's static inputs (its segment boundaries,
  kinds, logits rows) refuses the capture: token ids, positions, cache lengths, pages and slots
  change, and so does whatever is computed from them, by torch or by a kernel (the router's
  expert ids of a torch MoE loop, say). Except inside `reads_allowed()`, where the caller
  vouches that the decision is the same for every step of the bucket (e.g. "every sequence has
  a cached state": the runner only replays such steps).
- Every pointer a recorded C call takes must lie in a tensor the replay keeps alive (the graph's
  weights and states, the tensors the capture saw, tensors held by the graph's callables) or in
  a registered ctypes struct (`register_struct`: its bytes at capture time are restored before
  each replayed call, its pointer fields checked the same way) or be a kernel function's
  address. Anything else (a temporary host array) refuses the capture.
- A replayed call must return what it returned at capture (the kernels' error codes).
tests/engine/test_cpu_graphs.py checks greedy output with replays against eager steps on the
hybrid MoE GGUFs and a Llama GGUF, plain and speculative.
"""
from __future__ import annotations

import bisect
import ctypes
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specdeploy.ops.replay_state import STATE as _STATE
from specdeploy.ops.replay_state import STRUCTS as _STRUCTS
from specdeploy.ops.replay_state import allowed, capturing, reads_allowed, register_struct

__all__ = ["CaptureRefused", "CpuGraph", "capturing", "reads_allowed", "register_struct"]
_CAPTURE_LOCK = threading.Lock()
_FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_SHAPE_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride",
              "dim", "numel", "is_contiguous"}


class CaptureRefused(RuntimeError):
    """This step cannot be recorded for replay (why: the message); it runs eagerly."""


def _range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements span (an expanded view: its base's, not numel's)."""
    last = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor with storage (not an opaque oneDNN one)."""
    return t.device.type == "cpu" and t.layout is torch.strided and not t.is_mkldnn


class _Static:
    """The bucket's static inputs: the only tensors a capture may read on the host."""

    def __init__(self, tensors):
        self.ranges = [_range(t) for t in tensors if t.numel()]

    def refuses(self, t: torch.Tensor) -> bool:
        """Whether a host read of `t` would bake a changing value into the recording."""
        if not t.numel() or not _plain(t):
            return bool(t.numel())
        a, b = _range(t)
        return not any(s <= a and b <= e for s, e in self.ranges)


def _guarded(name):
    real = torch.Tensor.__dict__.get(name)  # None: inherited (restored by deleting ours)
    base = getattr(torch.Tensor, name)

    def read(self, *a, **k):
        static = _STATE["static"]
        if (static is not None and threading.get_ident() == _STATE["tid"] and not allowed()
                and static.refuses(self)):
            raise CaptureRefused(f"a host read ({name}) of a value that changes between steps")
        return base(self, *a, **k)

    return real, read


class _Recorder(TorchDispatchMode):
    def __init__(self, events: list, seen: dict, static: _Static):
        super().__init__()
        self.events, self.seen, self.static = events, seen, static

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # NOTE: a view op's result follows its base (most ops of a step), unless it copied
        # (`contiguous` counts as a view op and copies a strided tensor): then it is recorded
        if (getattr(func, "is_view", False) and isinstance(out, torch.Tensor) and args
                and isinstance(args[0], torch.Tensor) and _plain(out) and _plain(args[0])
                and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()):
            return out
        name = func.overloadpacket.__name__
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        leaves = tree_leaves(out)
        outs = [t for t in leaves if isinstance(t, torch.Tensor)]
        if len(outs) != len(leaves) and name not in _SHAPE_OPS:
            if any(self.static.refuses(t) for t in ins) and not allowed():
                raise CaptureRefused(f"{func} reads a value that changes between steps")
        for t in ins + outs:
            if _plain(t) and t.numel():
                self.seen[id(t)] = t
        if name in _FREE_OPS or not outs:
            return out
        schema = func._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.events.append((0, func, args, kwargs, None))  # in place / out=: re-run it
            return out
        if all(_plain(t) for t in outs):
            bases = {t.untyped_storage().data_ptr() for t in ins if _plain(t)}
            if all(t.untyped_storage().data_ptr() in bases for t in outs):
                return out  # views and aliases: they follow their bases
        # (a tensor result as itself: its replay is one copy, no tree walk)
        self.events.append((1, func, args, kwargs, out if isinstance(out, torch.Tensor) else outs))
        return out


def kernel_libraries() -> list[ctypes.CDLL]:
    """The loaded kernel libraries (those that built here)."""
    from specdeploy.ops import (
        attention_rows,
        ggml_int,
        ggml_linear,
        ggml_moe_int,
        ggml_tiled,
        layer_rows,
        linear_rows,
        moe_block,
        row_kernels,
    )

    libs = [ggml_linear._library()[0], ggml_int._library()[0], ggml_tiled._library()[0],
            row_kernels._library(), attention_rows._library()[0], linear_rows.library(),
            ggml_moe_int._library()[0], moe_block._library()[0], layer_rows._library()[0]]
    return [lib for lib in libs if lib is not None]


def _functions(libs) -> list:
    return [f for lib in libs for f in vars(lib).values()
            if isinstance(f, ctypes._CFuncPtr)]


def _tensors_of(obj, out: dict, depth: int = 0, seen: set | None = None) -> None:
    """Tensors reachable from a graph callable: closure cells, containers, object attributes."""
    seen = set() if seen is None else seen
    if depth > 10 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if _plain(obj):
            out[id(obj)] = obj
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None), ctypes._CFuncPtr,
                        torch.nn.Module, torch.fx.Node, torch.fx.Graph, type)):
        return  # (a module's tensors come as roots; fx objects hold metadata, not buffers)
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        items = [c.cell_contents for c in getattr(obj, "__closure__", None) or ()
                 if _filled(c)]
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            items += list(d.values())
    for x in items:
        _tensors_of(x, out, depth + 1, seen)


def _filled(cell) -> bool:
    try:
        return cell.cell_contents is not _EMPTY
    except ValueError:
        return False


_EMPTY = object()


class CpuGraph:
    """One recorded step: `capture(fn, inputs, varying)` runs fn(*inputs) once, recording (it
    raises CaptureRefused where a replay would not be valid); `replay()` re-makes its effects."""

    def __init__(self):
        self.events: list = []
        self.keep: list = []  # every tensor a replayed call reads or writes
        self.structs: list = []  # (address, bytes at capture)

    def capture(self, fn, inputs: list, static: list[torch.Tensor], roots: list):
        """`static`: the inputs whose values are the same for every replay (the only tensors
        the capture may read on the host); `roots`: what holds the graph's weights and states
        (its module, its callables)."""
        libs = kernel_libraries()
        funcs = _functions(libs)
        addrs = {ctypes.cast(f, ctypes.c_void_p).value for f in funcs}
        events, seen, fixed = [], {}, _Static(static)

        tid = threading.get_ident()

        def hook(result, func, args):
            if threading.get_ident() != tid:  # another thread's call: not this step's
                return result
            events.append((2, func, args, result, [(a, bytes(ctypes.string_at(a, ctypes.sizeof(
                _STRUCTS[a])))) for a in args if isinstance(a, int) and a in _STRUCTS]))
            return result

        # NOTE: the hooks and guards are process-wide: one capture at a time (another thread's
        # capture waits; its deployment's first steps of a bucket are a capture's)
        with _CAPTURE_LOCK:
            guards = {n: _guarded(n) for n in ("tolist", "item", "__bool__", "__int__",
                                               "__index__", "__float__", "numpy")}
            for f in funcs:
                f.errcheck = hook
            for n, (_, read) in guards.items():
                setattr(torch.Tensor, n, read)
            _STATE["static"], _STATE["tid"] = fixed, tid
            try:
                with _Recorder(events, seen, fixed):
                    out = fn(*inputs)
            finally:
                _STATE["static"], _STATE["tid"] = None, None
                for n, (real, _) in guards.items():
                    if real is None:
                        delattr(torch.Tensor, n)
                    else:
                        setattr(torch.Tensor, n, real)
                for f in funcs:
                    del f.errcheck
        held: dict = dict(seen)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                held[id(t)] = t
        for r in roots:
            _tensors_of(r, held)
        self._check(events, held, addrs)
        self.events = _program(events)
        return out

    def _check(self, events, held: dict, addrs: set) -> None:
        spans = sorted(((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t)
                        for t in held.values() if _plain(t)), key=lambda s: s[0])
        starts = [s[0] for s in spans]
        keep: dict = {}

        def ok(p: int) -> bool:
            if p in addrs:
                return True
            i = bisect.bisect_right(starts, p) - 1  # storages do not overlap
            if i >= 0 and starts[i] <= p < starts[i] + max(spans[i][1], 1):
                keep[starts[i]] = spans[i][2]
                return True
            return False

        def struct_bad(s: ctypes.Structure, depth: int = 0) -> str | None:
            """The first pointer field outside what a replay keeps, or None."""
            for name, typ in s._fields_:
                v = getattr(s, name)
                if isinstance(v, ctypes.Structure):
                    bad = "too deep" if depth >= 2 else struct_bad(v, depth + 1)
                    if bad:
                        return f"{name}.{bad}"
                elif typ is ctypes.c_void_p and v and not ok(v):
                    return name
            return None

        for ev in events:
            if ev[0] != 2:
                continue
            _, func, args, _, _ = ev
            types = func.argtypes
            if types is None or len(types) != len(args):
                raise CaptureRefused(f"{func.__name__}: no argument types to check")
            for i, (a, t) in enumerate(zip(args, types)):
                if t is not ctypes.c_void_p or not a:
                    continue
                if a in _STRUCTS:
                    bad = struct_bad(_STRUCTS[a])
                    if bad:
                        raise CaptureRefused(f"{func.__name__}: argument {i} (a struct): its "
                                             f"{bad} points outside what a replay keeps")
                elif not ok(a):
                    raise CaptureRefused(f"{func.__name__}: argument {i} points outside the "
                                         "tensors a replay keeps")
        self.keep = list(keep.values())

    def replay(self) -> None:
        # NOTE: the step's whole Python now: one tuple a recorded effect, the common kinds first
        for kind, f, a, b, c in self.events:
            if kind == _BATCH:  # a run of kernel calls in one C loop (ops/replay_calls.py)
                r = f(*a)
                if r:
                    raise RuntimeError(f"cpu graph replay: {c.failed(r)} returned another "
                                       "code than at capture")
            elif kind == _CALL:
                if f(*a) != b:
                    _failed(f)
            elif kind == _OP1:
                c.copy_(f(*a, **b))
            elif kind == _STRUCT_CALL:
                for addr, raw in c:
                    ctypes.memmove(addr, raw, len(raw))
                if f(*a) != b:
                    _failed(f)
            elif kind == _INPLACE:
                f(*a, **b)
            else:
                for o, r in zip(c, tree_leaves(f(*a, **b))):
                    o.copy_(r)


_CALL, _OP1, _STRUCT_CALL, _INPLACE, _OPN, _BATCH = range(6)


def _program(events: list) -> list[tuple]:
    """The recorded events as (kind, callable, args, kwargs or result, outputs or structs);
    runs of kernel calls the C loop can make as one batch each (ops/replay_calls.py)."""
    from specdeploy.ops.replay_calls import Batch, fits

    prog, run = [], []

    def flush():
        batch = Batch.of(run)
        if batch is not None:
            prog.append((_BATCH, batch.fn, batch.args, None, batch))
        else:
            prog.extend((_STRUCT_CALL, f, a, r, tuple(st)) if st else (_CALL, f, a, r, None)
                        for f, a, r, st in run)
        run.clear()

    for ev in events:
        if ev[0] == 2:
            _, func, args, result, structs = ev
            if fits(func, args, result, structs):
                run.append((func, args, result, structs))
                continue
            flush()
            prog.append((_STRUCT_CALL, func, args, result, tuple(structs)) if structs
                        else (_CALL, func, args, result, None))
            continue
        flush()
        op = getattr(ev[1], "_op", ev[1])  # (the C++ op behind the OpOverload: one frame less)
        if ev[0] == 0:
            prog.append((_INPLACE, op, ev[2], ev[3], None))
        elif isinstance(ev[4], torch.Tensor):
            prog.append((_OP1, op, ev[2], ev[3], ev[4]))
        else:
            prog.append((_OPN, op, ev[2], ev[3], ev[4]))
    flush()
    return prog


def _failed(func) -> None:
    raise RuntimeError(f"cpu graph replay: {func.__name__} returned another code than at capture")
