"""One C call per Llama-type decoder layer on the CPU fast path (`layer_rows.c`, issue 21).

After the other fusions a layer is still ~9 graph calls (the q/k/v, o, gate/up and down tiled
linears, `qkv_attention`, a reshape, two `add_rms_norm`, `silu_mul`), each a Python closure that
checks its inputs, allocates its result and calls one C kernel: ~25% of a decode step on the
default model. `decoder_layer_fn` makes one callable for the graph (`deploy/passes/
fuse_layers.py` puts it there) that calls those same C kernels, with the same arguments in the
same order, from one C function: the same bits. Where that path does not apply to a call
(another dtype or device, a gradient, metadata the attention kernel does not take: what the
chain's own fast-path checks reject), it runs the chain's callables themselves.

Memory: the intermediates of a layer live in one scratch buffer shared by the fused layers of a
graph (they run one after another), held up to HELD_ROWS rows and allocated per call above that
(prefill chunks, where the arithmetic dwarfs an allocation). The two results flow on to the next
layer: where the pass found that layer to be their only reader (`out_parity`), they are two
held pairs taken in turn (layer i writes pair i % 2 while it reads pair (i - 1) % 2, which no
one reads after it); elsewhere (the last layer, captured hidden states) they are fresh tensors.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from specdeploy.ops import attention_rows, ggml_tiled, row_kernels
from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.ggml_tiled import TiledCall
from specdeploy.ops.replay_state import register_struct

SOURCE = Path(__file__).with_name("layer_rows.c")
_FLAGS = ["-O2", "-shared", "-fPIC"]  # no arithmetic here: no ISA or FP flags to keep
HELD_ROWS = 64  # decode and verify steps at small batch reuse the scratch; prefill does not
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_F32, _I64T = torch.float32, torch.int64


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I64), ("isa", _I64), ("n", _I64), ("k", _I64), ("w", _P)]


class _Layer(ctypes.Structure):  # layer_rows.c's layer_t
    _fields_ = [("linear", _P), ("rope", _P), ("attend", _P), ("add_norm", _P),
                ("silu_mul", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("hq", _I64), ("hkv", _I64), ("d", _I64), ("dv", _I64),
                ("n_ff", _I64), ("page_size", _I64), ("kv", _I64), ("k_cache", _P),
                ("v_cache", _P), ("w_post", _P), ("w_next", _P), ("scale", _F),
                ("eps_post", _F), ("eps_next", _F), ("window", _I64), ("sinks", _P)]


class _Step(ctypes.Structure):  # layer_rows.c's step_t
    _fields_ = [("rows", _I64), ("rot", _I64), ("S", _I64), ("P", _I64), ("threads", _I64),
                ("cos_", _P), ("sin_", _P), ("slots", _P), ("cu", _P), ("lens", _P),
                ("page_table", _P)]


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, tuple | None, str | None]:
    """(this library, the callees' addresses, None) or (None, None, why not)."""
    if os.environ.get("SPECDEPLOY_LAYER_KERNEL", "1") == "0":
        return None, None, "SPECDEPLOY_LAYER_KERNEL=0"
    rows, (attn, why_attn), (tiled, why_tiled) = (row_kernels._library(),
                                                  attention_rows._library(),
                                                  ggml_tiled._library())
    if rows is None or attn is None or tiled is None:  # each warned for itself
        return None, None, why_attn or why_tiled or "the row kernels are unavailable"
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    path = _gl._cache_dir() / f"layer_rows-{digest}.so"
    err = None if path.exists() else _gl._compile(path, False, source=SOURCE, flags=_FLAGS)
    if err is None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            err = f"{path}: {e}"
    if err is not None:
        _gl.warn_unbuilt("the fused decoder layer", err)
        return None, None, err
    lib.layer_work_floats.argtypes, lib.layer_work_floats.restype = [_P], _I64
    lib.decoder_layer_rows.argtypes = [_P] * 7
    lib.decoder_layer_rows.restype = ctypes.c_int
    attention_rows._write_attend_fn(True)  # NOTE: sets its argtypes; the address is the same
    fns = (tiled.ggml_tiled_linear, rows.rope_rows, attn.write_attend_rows_ex,
           rows.add_rms_norm_rows, rows.silu_mul_rows)
    return lib, tuple(_addr(f) for f in fns), None


def unavailable() -> str | None:
    """None when the fused layer can run here, else why not."""
    return _library()[2]


class LayerChain(NamedTuple):
    """The callables one layer's graph nodes called, in order (the fallback runs them)."""

    qkv: Callable
    attention: Callable
    reshape: Callable
    o: Callable
    add_norm_post: Callable
    gate_up: Callable
    silu_mul: Callable
    down: Callable
    add_norm_next: Callable


def run_chain(c: LayerChain, res, normed, attn_args, shape, w_post, eps_post, n_ff, w_next,
              eps_next):
    """The unfused layer, call for call as the graph ran it -> (res3, normed3)."""
    attn = c.reshape(c.attention(c.qkv(normed), *attn_args), shape)
    res2, normed2 = c.add_norm_post(res, c.o(attn), w_post, eps_post)
    return c.add_norm_next(res2, c.down(c.silu_mul(c.gate_up(normed2), n_ff)), w_next, eps_next)


class Shared:
    """What the fused layers of one graph share: the scratch buffer and the current step's
    metadata (checked once, for the first layer of a step; the others find it by identity)."""

    def __init__(self):
        self.work, self.work_ptr, self.work_floats = None, 0, 0
        self.key: tuple = ()
        self.step, self.step_addr, self.rows, self.rot = _Step(), 0, 0, 0
        self.pairs: list = [(), ()]  # per parity: (shape, res, normed)

    def outputs(self, shape: tuple, parity: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's two results [1, R, H]: pair `parity`, reallocated when R or H changes, or
        fresh ones (no parity, or a step above HELD_ROWS rows)."""
        if parity is None or shape[1] > HELD_ROWS:
            return torch.empty(shape, dtype=_F32), torch.empty(shape, dtype=_F32)
        pair = self.pairs[parity]
        if not pair or pair[0] != shape:
            pair = self.pairs[parity] = (shape, torch.empty(shape, dtype=_F32),
                                         torch.empty(shape, dtype=_F32))
        return pair[1], pair[2]

    def scratch(self, rows: int, per_row: int) -> tuple[torch.Tensor | None, int]:
        """(a buffer to keep alive for the call or None, its address) of rows * per_row floats:
        the held one up to HELD_ROWS rows (grown when a step has more), else a fresh one."""
        floats = rows * per_row
        if floats <= self.work_floats:
            return None, self.work_ptr
        buf = torch.empty(floats, dtype=_F32)
        if rows <= HELD_ROWS:
            self.work, self.work_ptr, self.work_floats = buf, buf.data_ptr(), floats
        return buf, buf.data_ptr()

    def step_of(self, cos, sin, cu_host, lens_host, page_table, slots) -> int:
        """The step struct's address, or 0 where the C attention does not take this step.
        NOTE: the key holds the tensors, so their ids cannot be reused by a later step."""
        k = self.key
        if (k and slots is k[0] and cos is k[1] and sin is k[2] and cu_host is k[3]
                and lens_host is k[4] and page_table is k[5]):
            threads = torch.get_num_threads()
            if threads != self.step.threads:
                self.step.threads = threads
            return self.step_addr
        self.key = (slots, cos, sin, cu_host, lens_host, page_table,
                    cos.contiguous(), sin.contiguous())  # (held: the struct points into them)
        self.step_addr = self._check(*self.key)
        return self.step_addr

    def _check(self, slots, cos, sin, cu_host, lens_host, page_table, c, s) -> int:
        if slots is None or not all(
                isinstance(x, torch.Tensor) and x.dtype is _I64T and x.is_contiguous()
                and x.device.type == "cpu" and x.dim() == n
                for x, n in ((slots, 1), (cu_host, 1), (lens_host, 1), (page_table, 2))):
            return 0
        rows = cos.shape[1] if cos.dim() == 3 else 0
        if (cos.dtype is not _F32 or sin.dtype is not _F32 or cos.device.type != "cpu"
                or cos.dim() != 3 or tuple(cos.shape[:2]) != (1, rows) or cos.shape[-1] % 2
                or sin.shape != cos.shape or rows == 0):
            return 0
        st = self.step
        st.rows, st.rot, st.S, st.P = rows, cos.shape[-1], lens_host.shape[0], page_table.shape[1]
        st.threads = torch.get_num_threads()
        st.cos_, st.sin_, st.slots = c.data_ptr(), s.data_ptr(), slots.data_ptr()
        st.cu, st.lens, st.page_table = (cu_host.data_ptr(), lens_host.data_ptr(),
                                         page_table.data_ptr())
        self.rows, self.rot = rows, st.rot
        return ctypes.addressof(st)


def _linear(call: TiledCall) -> _Linear:
    return _Linear(call.kind, call.isa, call.n, call.k, call.w_ptr)


def decoder_layer_fn(chain: LayerChain, calls: tuple[TiledCall, ...], shared: Shared,
                     hq: int, hkv: int, d: int, n_ff: int, scale: float, eps_post: float,
                     eps_next: float, out_parity: int | None = None):
    """The graph's callable for one layer: (res [1, R, H], normed [1, R, qkv.k], the attention's
    arguments after qkv, the reshape's shape, w_post, eps_post, n_ff, w_next, eps_next) ->
    (res3, normed3).
    `calls`: the q/k/v, o, gate/up and down linears' fixed kernel arguments (no biases).
    `out_parity`: results in `shared`'s held pair of that parity (only where the next fused
    layer, of the other parity, is their only reader), else fresh."""
    lib, fns, why = _library()
    if lib is None:
        raise RuntimeError(f"fused decoder layer unavailable: {why}")
    qkv, o, gu, dn = calls
    h, h_in = o.n, qkv.k  # h_in > h: the EAGLE-3 layer's q/k/v read cat(embeds, hidden)
    layer = _Layer(*fns, _linear(qkv), _linear(o), _linear(gu), _linear(dn), hq, hkv, d, 0,
                   n_ff, 0, 0, None, None, None, None, scale, eps_post, eps_next, 0, None)
    register_struct(layer)
    register_struct(shared.step)
    addr, run, outputs = ctypes.addressof(layer), lib.decoder_layer_rows, shared.outputs
    seen: list = [None, None, None, None, 0]  # k_cache, v_cache, w_post, w_next, floats/row

    def see(k_cache, v_cache, w_post, w_next) -> bool:
        """The layer's fixed inputs once: what the chain's kernels would check every call."""
        dv = v_cache.shape[-1]
        ok = (attention_rows.fits(k_cache.new_empty(0, hq, d, dtype=_F32), k_cache, v_cache)
              and k_cache.shape[2] == hkv and k_cache.shape[-1] == d and o.k == hq * dv
              and qkv.n >= (hq + hkv) * d + hkv * dv
              and all(w.dtype is _F32 and w.device.type == "cpu" and w.is_contiguous()
                      and w.numel() == h for w in (w_post, w_next)))
        seen[:] = [k_cache, v_cache, w_post, w_next, 0]  # 0: refused (the chain runs)
        if not ok:
            return False
        layer.dv, layer.page_size = dv, k_cache.shape[1]
        layer.kv = attention_rows._KV_DTYPES.index(k_cache.dtype)
        layer.k_cache, layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        layer.w_post, layer.w_next = w_post.data_ptr(), w_next.data_ptr()
        seen[4] = lib.layer_work_floats(addr)
        return True

    def decoder_layer(res, normed, cos, sin, k_cache, v_cache, cu_seqlens, cu_seqlens_host,
                      cache_lens, cache_lens_host, page_table, scale_, sliding_window,
                      slot_mapping, hq_, hkv_, d_, shape, w_post, eps_post_, n_ff_, w_next,
                      eps_next_):
        step = shared.step_of(cos, sin, cu_seqlens_host, cache_lens_host, page_table,
                              slot_mapping)
        if sliding_window != layer.window:  # a constant of the layer's graph node: set once
            layer.window = sliding_window
        rows = shared.rows
        if (step and res.dtype is _F32 and normed.dtype is _F32 and res.is_cpu
                and normed.is_cpu and normed.shape == (1, rows, h_in) and res.shape == (1, rows, h)
                and normed.is_contiguous() and res.is_contiguous() and shared.rot <= d
                and not (torch.is_grad_enabled() and (
                    res.requires_grad or normed.requires_grad or cos.requires_grad
                    or sin.requires_grad or w_post.requires_grad or w_next.requires_grad))
                and (seen[4] if (k_cache is seen[0] and v_cache is seen[1]
                                 and w_post is seen[2] and w_next is seen[3])
                     else see(k_cache, v_cache, w_post, w_next))):
            res3, normed3 = outputs((1, rows, h), out_parity)
            held, work = shared.scratch(rows, seen[4])  # noqa: F841 (alive for the call)
            rc = run(addr, step, res.data_ptr(), normed.data_ptr(), res3.data_ptr(),
                     normed3.data_ptr(), work)
            if rc == -2:
                raise ValueError("write_attend_rows: a position lies outside its sequence's "
                                 "pages")
            if rc:
                raise MemoryError("decoder_layer_rows: no scratch memory")
            return res3, normed3
        attn_args = (cos, sin, k_cache, v_cache, cu_seqlens, cu_seqlens_host, cache_lens,
                     cache_lens_host, page_table, scale_, sliding_window, slot_mapping, hq_,
                     hkv_, d_)
        return run_chain(chain, res, normed, attn_args, shape, w_post, eps_post_, n_ff_,
                         w_next, eps_next_)

    decoder_layer.chain, decoder_layer.out_parity = chain, out_parity
    return decoder_layer
