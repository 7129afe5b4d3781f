"""A MoE layer's block (router, routing, the routed experts, the shared expert, their sum) in one
C call on the CPU fast path (`moe_block.c`).

With the GGUF kernels (`kernels="fast"`) a MoE block was ~12 graph calls: the router's fp32
linear, the routing op and its two getitems, the experts' one call, the shared expert's two
linears with its activation between (relu and square as two torch ops, or silu_mul), Qwen3.5's
gate (a linear of one output, a sigmoid, a mul), NemotronH's latent projections and a view,
the add. Each is a Python closure that checks its inputs and allocates its result (~5-10 us),
at batch 1 more than the block's arithmetic outside the experts. `moe_block_fn` makes one
callable for the graph (`deploy/passes/fuse_moe_blocks.py` puts it there) that calls the same C
kernels with the same arguments from one C function: the same bits. Where that path does not
apply (another dtype or device, a gradient), the chain's own callables run.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.ops import ggml_int, ggml_moe_int, ggml_tiled, linear_rows, row_kernels
from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.replay_state import register_struct

SOURCE = Path(__file__).with_name("moe_block.c")
_FLAGS = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]  # one rounding an operation
HELD_ROWS = 64  # decode and verify steps at small batch reuse the scratch
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_F32 = torch.float32
RELU2, SWIGLU = 0, 1  # moe_block.c's ACT_* values


class _Linear(ctypes.Structure):  # moe_block.c's linear_t
    _fields_ = [("fn", _P), ("kind", _I64), ("isa", _I64), ("n", _I64), ("k", _I64),
                ("w", _P), ("b", _P)]


class _Experts(ctypes.Structure):  # moe_block.c's experts_t
    _fields_ = [("fn", _P), ("tiled", _I64), ("kind_up", _I64), ("kind_down", _I64),
                ("isa", _I64), ("e", _I64), ("up_stride", _I64), ("n_up", _I64),
                ("down_stride", _I64), ("i", _I64), ("act", _I64), ("w_up", _P), ("w_down", _P),
                ("silu_mul", _P), ("tiled_fn", _P)]


class _Block(ctypes.Structure):  # moe_block.c's moe_block_t
    _fields_ = [("router", _Linear), ("lat_in", _Linear), ("lat_out", _Linear),
                ("sh_up", _Linear), ("sh_down", _Linear), ("gate", _Linear),
                ("ex", _Experts), ("route", _P), ("silu_mul", _P), ("elementwise", _P),
                ("k", _I64), ("mode", _I64), ("n_group", _I64), ("topk_group", _I64),
                ("renorm", _I64), ("sh_act", _I64), ("sh_ff", _I64), ("sigmoid_op", _I64),
                ("scale", _F), ("corr", _P)]


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(this library, None) or (None, why not): it needs every callee's library too."""
    rows, fp32 = row_kernels._library(), linear_rows.library()
    moe, why_moe = ggml_moe_int._library()
    why = (why_moe or ("the row kernels could not be built" if rows is None else None)
           or ("the fp32 row linear could not be built" if fp32 is None else None))
    if why:
        return None, why
    lib, errors = _gl.load_compiled("moe_block", SOURCE, _FLAGS, {
        "moe_block_work_floats": ([_P, _I64, _I64], _I64),
        "moe_block_rows": ([_P, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int)})
    if lib is None:
        why = "; ".join(errors)
        _gl.warn_unbuilt("the fused MoE block", why)
        return None, why
    return lib, None


def unavailable() -> str | None:
    """None when the fused block can run here, else why not."""
    return _library()[1]


class LinearCall(NamedTuple):
    """A linear closure's fixed kernel arguments: a block kernel's (`kind` >= 0: ggml_tiled.c's
    or ggml_kernels_int.c's, the same signature) or linear_rows' (kind -1, fp32, with `b`)."""

    fn: int
    kind: int
    isa: int
    n: int
    k: int
    w: int
    b: int | None


def linear_call(fn) -> LinearCall | None:
    """The fixed arguments of a graph's linear closure, or None when it is none this file can
    call (a bias on a block kernel, a column gather, a oneDNN or aten linear)."""
    tiled = getattr(fn, "tiled_call", None)
    if tiled is not None:
        if tiled.bias is not None or ggml_tiled.kernel_unavailable() is not None:
            return None
        return LinearCall(_addr(ggml_tiled._lib().ggml_tiled_linear), tiled.kind, tiled.isa,
                          tiled.n, tiled.k, tiled.w_ptr, None)
    call = getattr(fn, "int_call", None)
    if call is not None:
        lib = ggml_int._library()[0]
        if call.bias is not None or lib is None:
            return None
        return LinearCall(_addr(lib.ggml_linear_int), call.kind, call.isa, call.n, call.k,
                          call.w_ptr, None)
    rows = getattr(fn, "rows_call", None)
    if rows is not None and linear_rows.library() is not None:
        w, b = rows
        return LinearCall(_addr(linear_rows.library().linear_rows), -1, 0, w.shape[0],
                          w.shape[1], w.data_ptr(), None if b is None else b.data_ptr())
    return None


class Parts(NamedTuple):
    """What a matched block is made of (fuse_moe_blocks finds it): the linears' fixed calls,
    the experts closure, the routing's constants, the shared expert's activation."""

    router: LinearCall
    lat_in: LinearCall | None
    lat_out: LinearCall | None
    sh_up: LinearCall
    sh_down: LinearCall
    gate: LinearCall | None
    experts: object  # a bound_experts closure (its `moe_call`)
    sigmoid: bool  # the routing: sigmoid with groups and a selection bias, else softmax top-k
    k: int
    n_group: int
    topk_group: int
    renorm: bool
    scale: float
    sh_act: int  # RELU2 / SWIGLU
    sh_ff: int  # swiglu's width (silu_mul's n)


def _linear(c: LinearCall | None) -> _Linear:
    if c is None:
        return _Linear()
    return _Linear(c.fn, c.kind, c.isa, c.n, c.k, c.w, c.b)


def parts_fit(p: Parts) -> bool:
    """Whether the parts' widths line up (the pass matched shapes it could not see)."""
    m = p.experts.moe_call
    h = p.sh_down.n
    hx = p.lat_in.n if p.lat_in else h
    act = p.sh_ff if p.sh_act == SWIGLU else p.sh_up.n
    return (p.router.k == h and p.sh_up.k == h and p.sh_down.k == act and m.h == hx
            and p.router.n == m.e and (p.lat_in is None or p.lat_in.k == h)
            and (p.lat_out is None or (p.lat_out.k == hx and p.lat_out.n == h))
            and (p.gate is None or (p.gate.k == h and p.gate.n == 1))
            and (p.sh_act != SWIGLU or p.sh_up.n >= 2 * p.sh_ff))


def run_chain(chain, ext: tuple):
    """The unfused block: the matched nodes' callables as the graph ran them."""
    return chain(ext)


def moe_block_fn(parts: Parts, chain, x_pos: int, corr_pos: int | None, out_rows_only: bool):
    """The graph's callable for one block: (*the chain's external inputs) -> the block's output.
    `chain(ext)` runs the matched nodes themselves (the fallback); ext[x_pos] is the block's
    input [..., H], ext[corr_pos] the sigmoid router's selection bias (None: none);
    `out_rows_only`: the output is [R, H] (else x's leading dims)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"fused MoE block unavailable: {why}")
    rows_lib, moe_lib = row_kernels._library(), ggml_moe_int._library()[0]
    m = parts.experts.moe_call
    ex = _Experts(_addr(moe_lib.ggml_moe_tiled if m.tiled else moe_lib.ggml_moe_int),
                  int(m.tiled), m.kind_up, m.kind_down, m.isa, m.e, m.up_stride, m.n_up,
                  m.down_stride, m.i, m.act, m.w_up, m.w_down, moe_lib.silu_mul,
                  moe_lib.tiled if m.tiled else None)
    block = _Block(_linear(parts.router), _linear(parts.lat_in), _linear(parts.lat_out),
                   _linear(parts.sh_up), _linear(parts.sh_down), _linear(parts.gate), ex,
                   _addr(rows_lib.moe_route_rows), _addr(rows_lib.silu_mul_rows),
                   _addr(rows_lib.elementwise), parts.k, int(parts.sigmoid),
                   max(parts.n_group, 1), parts.topk_group, int(parts.renorm), parts.sh_act,
                   parts.sh_ff, row_kernels.ELEMENTWISE_OPS["sigmoid"], parts.scale, None)
    register_struct(block)
    addr, run, work_floats = ctypes.addressof(block), lib.moe_block_rows, lib.moe_block_work_floats
    h = parts.sh_down.n
    held: dict = {"corr": None, "work": None, "floats": 0, "threads": 0}
    grad, threads, empty = torch.is_grad_enabled, torch.get_num_threads, torch.empty

    def scratch(rows: int, th: int) -> tuple[torch.Tensor, int]:
        floats = work_floats(addr, rows, th)
        if floats <= held["floats"] and th == held["threads"]:
            return held["work"], held["work"].data_ptr()
        buf = empty(floats, dtype=_F32)
        if rows <= HELD_ROWS:
            held.update(work=buf, floats=floats, threads=th)
        return buf, buf.data_ptr()

    def moe_block(*ext):
        x = ext[x_pos]
        corr = None if corr_pos is None else ext[corr_pos]
        if (x.dtype is _F32 and x.device.type == "cpu" and x.shape[-1] == h
                and x.is_contiguous() and not (grad() and x.requires_grad)
                and (corr is None or corr is held["corr"] or _see(corr))):
            rows = x.numel() // h
            out = empty((rows, h) if out_rows_only else x.shape, dtype=_F32)
            if rows:
                th = threads()
                buf, work = scratch(rows, th)  # noqa: F841 (buf: alive for the call)
                rc = run(addr, x.data_ptr(), rows, out.data_ptr(), work, th)
                if rc == -3:
                    raise ValueError("moe_block: expert ids out of range")
                if rc:
                    raise MemoryError("moe_block: no scratch memory")
            return out
        return run_chain(chain, ext)

    def _see(corr) -> bool:
        """The selection bias once (its pointer in the struct), where the C routing takes it."""
        if not (isinstance(corr, torch.Tensor) and corr.dtype is _F32
                and corr.device.type == "cpu" and corr.is_contiguous()
                and corr.numel() == parts.router.n and not corr.requires_grad):
            return False
        held["corr"], block.corr = corr, corr.data_ptr()
        return True

    moe_block.block = block  # NOTE: the struct lives as long as the graph's callable
    return moe_block
