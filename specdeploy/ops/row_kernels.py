"""C kernels for the row-wise small ops of a step (RMSNorm, RoPE, residual add + RMSNorm,
SiLU-gated product): one call instead of 5-6
torch ops, whose dispatch dominates these ops at decode sizes (`row_kernels.c`).

Used by the CPU fp32 kernels of `rms_norm` and `rope` when nothing needs their gradient (the
training backward recomputes through torch). Compiled on first use like the GGUF kernels (same
cache, same one-line warning when it cannot be built; then torch runs them). Portable C: no CPU
feature is required. SPECDEPLOY_ROW_KERNELS=0 turns them off.
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from specdeploy.ops import ggml_linear as _gl

SOURCE = Path(__file__).with_name("row_kernels.c")
# NOTE: -fno-trapping-math lets the SiLU loop's selects vectorize; it assumes no FP traps, it
# changes no rounding (-ffp-contract=off still forbids fused multiply-adds)
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC"]
_I64, _P, _F, _I = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECDEPLOY_ROW_KERNELS", "1") == "0":
        return None
    lib, errors = _gl.load_compiled("row_kernels", SOURCE, _FLAGS, {
        "rms_norm_rows": ([_P, _I64, _I64, _I64, _P, _F, _P, _I], None),
        "rope_rows": ([_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _I], None),
        "add_rms_norm_rows": ([_P, _P, _I64, _I64, _P, _F, _P, _P, _I], None),
        "silu_mul_rows": ([_P, _I64, _I64, _I64, _P, _I], None),
        "swiglu_oai_rows": ([_P, _I64, _I64, _I64, _F, _F, _P, _I], None),
        "elementwise": ([_I, _P, _I64, _P, _I], None),
        "conv_step_rows": ([_P, _P, _P, _P, _P, _I64, _I64, _I64, _I, _P, _P], None),
        "ssm_step_rows": ([_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P,
                           _P, _I], None),
        "gdn_step_rows": ([_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I, _F,
                           _P, _P, _I], None),
        "gated_rms_norm_rows": ([_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _F, _I, _P, _P, _I],
                                None),
        "mamba2_decode_rows": ([_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _P, _P, _P,
                                _I64, _P, _P, _I64, _P, _P, _P, _F, _F, _I64, _I64, _I64,
                                _I64, _P, _F, _I64, _P, _I], _I),
        "gdn_decode_rows": ([_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _P, _P, _P,
                             _P, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I,
                             _F, _P, _F, _I64, _P, _I], _I),
        "moe_route_rows": ([_P, _I64, _I64, _P, _I64, _I, _I64, _I64, _I, _F, _P, _P, _P, _I],
                           None),
        "promote_states": ([_I64, _P, _P, _P, _I64, _P, _P, _I64], None),
        "row_kernels_max_isa": ([_I], _I)})
    if lib is not None:
        return lib
    _gl.warn_unbuilt("the row kernels (RMSNorm, RoPE)", "; ".join(errors))
    return None


_F32 = torch.float32


@contextmanager
def max_isa(level: int):
    """Within: the kernels take no clone wider than `level` (0 generic C, 1 AVX2, 2 AVX-512;
    each still only where the CPU has it). For tests: every clone must give the generic bits."""
    lib = _library()
    before = lib.row_kernels_max_isa(level)
    try:
        yield
    finally:
        lib.row_kernels_max_isa(before)


def _usable(*ts: torch.Tensor) -> bool:
    # NOTE: called ~150 times a decode step: plain loops and `is`, no generator expressions
    for t in ts:
        if t.dtype is not _F32 or t.device.type != "cpu":
            return False
    if torch.is_grad_enabled():
        for t in ts:
            if t.requires_grad:
                return False
    return _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim, or None when the kernel does not take these tensors."""
    n = x.shape[-1]
    if not _usable(x, weight) or weight.numel() != n or x.numel() == 0:
        return None
    x2 = x.reshape(-1, n)  # a view for the usual layouts (rows with a stride, last dim dense)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _library().rms_norm_rows(x2.data_ptr(), x2.shape[0], n, x2.stride(0), w.data_ptr(),
                             float(eps), out.data_ptr(), torch.get_num_threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of x [B, T, H, D] with cos/sin [B, T, R], or None when the kernel does
    not take these tensors."""
    if not _usable(x, cos, sin) or x.dim() != 4 or x.numel() == 0:
        return None
    b, t, h, d = x.shape
    r = cos.shape[-1]
    if r % 2 or r > d or tuple(cos.shape) != (b, t, r) or sin.shape != cos.shape:
        return None
    x3 = x.reshape(b * t, h, d)  # a view when tokens are strided rows of dense heads
    if x3.stride(2) != 1 or x3.stride(1) != d:
        x3 = x3.contiguous()
    c, s = cos.reshape(b * t, r).contiguous(), sin.reshape(b * t, r).contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _library().rope_rows(x3.data_ptr(), b * t, h, d, x3.stride(0), c.data_ptr(), s.data_ptr(),
                         r, out.data_ptr(), torch.get_num_threads())
    return out


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + b, RMSNorm(a + b)), or None when the kernel does not take these tensors."""
    n = a.shape[-1]
    if (not _usable(a, b, weight) or a.shape != b.shape or weight.numel() != n
            or a.numel() == 0):
        return None
    # NOTE: contiguous() returns the tensor itself when it already is: no copies at decode
    a2, b2, w = a.contiguous(), b.contiguous(), weight.contiguous()
    total, out = torch.empty(a.shape, dtype=_F32), torch.empty(a.shape, dtype=_F32)
    _library().add_rms_norm_rows(a2.data_ptr(), b2.data_ptr(), a2.numel() // n, n, w.data_ptr(),
                                 float(eps), total.data_ptr(), out.data_ptr(),
                                 torch.get_num_threads())
    return total, out


def silu_mul(x: torch.Tensor, n: int) -> torch.Tensor | None:
    """silu(x[..., :n]) * x[..., n:2n], or None when the kernel does not take this tensor."""
    if not _usable(x) or x.shape[-1] < 2 * n or x.numel() == 0 or x.stride(-1) != 1:
        return None
    if x.is_contiguous():  # the usual case: no reshape (a torch call) needed
        x2, rows, stride = x, x.numel() // x.shape[-1], x.shape[-1]
    else:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows, stride = x2.shape[0], x2.stride(0)
    out = torch.empty((*x.shape[:-1], n), dtype=_F32)
    _library().silu_mul_rows(x2.data_ptr(), rows, n, stride, out.data_ptr(),
                             torch.get_num_threads())
    return out


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor | None:
    """gpt-oss's clamped SwiGLU of h [..., 2n] (gate | up) -> [..., n] (ops/moe_bias.py
    `clamped_swiglu`, within 1e-6 relative: the sigmoid's exp is row_kernels.c's), each element
    by the same operations wherever it sits (batch-invariant); None when the kernel does not
    take `h`."""
    if not _usable(h) or h.shape[-1] % 2 or h.stride(-1) != 1:
        return None
    n = h.shape[-1] // 2
    h2 = h.reshape(-1, h.shape[-1]).contiguous()
    out = torch.empty((*h.shape[:-1], n), dtype=_F32)
    if h2.numel():
        _library().swiglu_oai_rows(h2.data_ptr(), h2.shape[0], n, h2.stride(0), alpha, limit,
                                   out.data_ptr(), torch.get_num_threads())
    return out




ELEMENTWISE_OPS = {"sigmoid": 0, "softplus": 1, "exp": 2, "silu": 3}


def elementwise(name: str, x: torch.Tensor) -> torch.Tensor | None:
    """sigmoid / softplus (torch's beta 1, threshold 20) / exp / silu of every element, each
    by the same operations wherever it sits (row_kernels.c `elementwise`: torch's vectorized
    kernels round a tensor's tail otherwise); None when the kernel does not take `x`."""
    if not _usable(x):
        return None
    x2 = x.contiguous()
    out = torch.empty(x.shape, dtype=_F32)
    _library().elementwise(ELEMENTWISE_OPS[name], x2.data_ptr(), x2.numel(), out.data_ptr(),
                           torch.get_num_threads())
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor | None:
    return elementwise("sigmoid", x)


def softplus(x: torch.Tensor) -> torch.Tensor | None:
    return elementwise("softplus", x)


def _slot_state(state: torch.Tensor | None, slots: torch.Tensor | None, rows: int,
                shape: tuple[int, ...]) -> tuple[torch.Tensor | None, int | None] | None:
    """(the state to read, the slot indices' pointer) for a step: with `slots`, `state` is the
    cache's whole slot tensor [S, *shape], updated in place at those rows; else a [rows, *shape]
    tensor or None (zeros). None when the step cannot take them."""
    if slots is None:
        if state is not None and tuple(state.shape) != (rows, *shape):
            return None
        return (None if state is None else state.contiguous()), None
    if (state is None or tuple(state.shape[1:]) != shape or not state.is_contiguous()
            or slots.dtype is not torch.int64 or slots.device.type != "cpu"
            or tuple(slots.shape) != (rows,) or not slots.is_contiguous()):
        return None
    return state, slots.data_ptr()


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              state: torch.Tensor | None, activation: str, slots: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A depthwise causal conv1d's decode step (row_kernels.c `conv_step_rows`): x [B, 1, C],
    weight [C, W], state [B, C, W - 1] or None (zeros) -> (y [B, 1, C], the next state). With
    `slots` [B] (int64), `state` is the cache's [S, C, W - 1], moved on in place at those rows
    and returned as the next state. None when the kernel does not take these tensors."""
    ts = (x, weight) + tuple(t for t in (bias, state) if t is not None)
    if activation not in ("silu", "none") or not _usable(*ts) or x.dim() != 3 or x.shape[1] != 1:
        return None
    b, _, c = x.shape
    w = weight.shape[1]
    st = _slot_state(state, slots, b, (c, w - 1)) if weight.shape[0] == c else None
    if st is None:
        return None
    s2, slot_ptr = st
    x2, w2 = x.contiguous(), weight.contiguous()
    b2 = None if bias is None else bias.contiguous()
    y = torch.empty(b, 1, c, dtype=_F32)
    new = state if slots is not None else torch.empty(b, c, w - 1, dtype=_F32)
    _library().conv_step_rows(x2.data_ptr(), _ptr(s2), slot_ptr, w2.data_ptr(), _ptr(b2), b, c,
                              w, int(activation == "silu"), y.data_ptr(), new.data_ptr())
    return y, new


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def ssm_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, state: torch.Tensor | None,
             slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mamba2's decode step (row_kernels.c `ssm_step_rows`): x [R, H, P], dt [R, H] (already
    discretized), B / C [R, G, N], A / D [H], state [R, H, P, N] or None (zeros) -> (y [R, H, P],
    the next state); with `slots`, the cache's [S, H, P, N] updated in place at those rows (as
    conv_step). None when the kernel does not take these tensors."""
    ts = (x, dt, A, B, C, D) + (() if state is None else (state,))
    if not _usable(*ts):
        return None
    r, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    st = None if h % g else _slot_state(state, slots, r, (h, p, n))
    if st is None:
        return None
    s2, slot_ptr = st
    x, dt, A, B, C, D = (t.contiguous() for t in (x, dt, A, B, C, D))
    y = torch.empty(r, h, p, dtype=_F32)
    new = state if slots is not None else torch.empty(r, h, p, n, dtype=_F32)
    _library().ssm_step_rows(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(),
                             C.data_ptr(), D.data_ptr(), _ptr(s2), slot_ptr, r, h, p, n, g,
                             y.data_ptr(), new.data_ptr(), torch.get_num_threads())
    return y, new


def gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, state: torch.Tensor | None, slots: torch.Tensor | None = None,
             l2norm: bool = False, scale: float = 1.0
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta rule's decode step (row_kernels.c `gdn_step_rows`): q / k [R, Hk, K]
    (each serving H / Hk consecutive value heads; with `l2norm` normalized in the step, q then
    times `scale`), v [R, H, V], g / beta [R, H], state [R, H, K, V] or None -> (o [R, H, V],
    the next state); with `slots`, the cache's [S, H, K, V] updated in place at those rows (as
    conv_step). None when the kernel does not take these tensors."""
    ts = (q, k, v, g, beta) + (() if state is None else (state,))
    if not _usable(*ts) or q.dim() != 3 or q.shape != k.shape or v.dim() != 3:
        return None
    r, hk, dk = k.shape
    h, dv = v.shape[1], v.shape[2]
    if h % hk or dk > 4096 or tuple(g.shape) != (r, h) or tuple(beta.shape) != (r, h):
        return None
    st = _slot_state(state, slots, r, (h, dk, dv))
    if st is None:
        return None
    s2, slot_ptr = st
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(r, h, dv, dtype=_F32)
    new = state if slots is not None else torch.empty(r, h, dk, dv, dtype=_F32)
    _library().gdn_step_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
                             beta.data_ptr(), _ptr(s2), slot_ptr, r, h, hk, dk, dv, int(l2norm),
                             float(scale), o.data_ptr(), new.data_ptr(), torch.get_num_threads())
    return o, new


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor | None:
    """Gated RMSNorm per group of `group_size` columns (row_kernels.c `gated_rms_norm_rows`;
    ops/norm.py has the two forms), or None when the kernel does not take these tensors."""
    n = x.shape[-1]
    if (not _usable(x, gate, weight) or gate.shape != x.shape or weight.numel() != n
            or x.numel() == 0 or group_size <= 0 or n % group_size):
        return None
    x2, g2 = x.reshape(-1, n), gate.reshape(-1, n)  # views for rows with a stride
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    threads = torch.get_num_threads()
    out = torch.empty(x.shape, dtype=_F32)
    scratch = torch.empty(2 * n * threads, dtype=_F32)
    _library().gated_rms_norm_rows(x2.data_ptr(), x2.stride(0), g2.data_ptr(), g2.stride(0),
                                   x2.shape[0], n, group_size, weight.contiguous().data_ptr(),
                                   float(eps), int(norm_before_gate), out.data_ptr(),
                                   scratch.data_ptr(), threads)
    return out


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, sigmoid: bool,
              n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
              scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MoE routing of router logits [T, E] (row_kernels.c `moe_route_rows`): softmax top-k
    (`sigmoid` False) or sigmoid with a selection bias and expert groups -> (ids [T, k] int64 in
    descending selection order, weights [T, k] fp32); None when the kernel does not take these
    tensors (ops/moe.py then routes in torch)."""
    ts = (logits,) if bias is None else (logits, bias)
    if not _usable(*ts) or logits.dim() != 2:
        return None
    t, e = logits.shape
    if (not 0 < k <= e or (bias is not None and bias.numel() != e)
            or (n_group > 1 and (e % n_group or e // n_group < 2 or not 0 < topk_group <= n_group
                                 or k > topk_group * (e // n_group)))):
        return None
    x, b = logits.contiguous(), None if bias is None else bias.contiguous()
    threads = torch.get_num_threads()
    ids = torch.empty(t, k, dtype=torch.int64)
    weights = torch.empty(t, k, dtype=_F32)
    scratch = torch.empty(e * threads, dtype=_F32)
    _library().moe_route_rows(x.data_ptr(), t, e, _ptr(b), k, int(sigmoid), max(n_group, 1),
                              topk_group, int(renormalize), float(scaling_factor),
                              ids.data_ptr(), weights.data_ptr(), scratch.data_ptr(), threads)
    return ids, weights


def _rows2(x: torch.Tensor, width: int) -> torch.Tensor | None:
    """x [1, T, ...] as [T, width] rows with a stride (a view of a projection's columns), or
    None when its last dims are not `width` dense values a row."""
    if x.numel() == 0 or x.shape[0] != 1:
        return None
    x2 = x.reshape(x.shape[1], -1)
    return x2 if x2.shape[1] == width and x2.stride(1) == 1 else None


def _state_ok(state: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return tuple(state.shape[1:]) == shape and state.is_contiguous()


def _spec_ok(spec: torch.Tensor | None, shape: tuple[int, ...], ntok: int) -> bool:
    """A verify step's spec states [slots, K + 1, *shape] with room for `ntok` tokens."""
    return (spec is not None and spec.dtype is _F32 and spec.device.type == "cpu"
            and spec.dim() == len(shape) + 2 and tuple(spec.shape[2:]) == shape
            and spec.shape[1] >= ntok and spec.is_contiguous())


def mamba2_decode(xbc, z, dt, conv_w, conv_b, conv_state, slots, A, D, dt_bias, dt_min, dt_max,
                  ssm_state, norm_w, eps, group, h, p, n, g, ntok: int = 1, conv_spec=None,
                  ssm_spec=None) -> torch.Tensor | None:
    """A Mamba2 mixer's step from its in_proj columns (xbc [1, T, C], z [1, T, H P], dt
    [1, T, H]) to its gated norm's output [1, T, H P] in one C call (row_kernels.c
    `mamba2_decode_rows`: the chain's kernels in its order). T = sequences x `ntok`: without
    spec states one token each, states updated in place at `slots`; with them (a verify step)
    each sequence's tokens in turn, the states after each into its spec entries. None when the
    kernel does not take these tensors."""
    ts = [xbc, z, dt, conv_w, conv_state, A, D, dt_bias, ssm_state, norm_w]
    if conv_b is not None:
        ts.append(conv_b)
    if not _usable(*ts) or slots.dtype is not torch.int64 or not slots.is_contiguous():
        return None
    dx, c = h * p, h * p + 2 * g * n
    t, width = xbc.shape[1], conv_w.shape[-1]
    x2, z2, dt2 = _rows2(xbc, c), _rows2(z, dx), _rows2(dt, h)
    verify = conv_spec is not None or ssm_spec is not None
    if (x2 is None or z2 is None or dt2 is None or tuple(slots.shape) != (t // ntok,)
            or t % ntok or h % g or not conv_w.is_contiguous()
            or tuple(conv_w.shape) != (c, width)
            or not _state_ok(conv_state, (c, width - 1)) or not _state_ok(ssm_state, (h, p, n))
            or dx % group or norm_w.numel() != dx or A.numel() != h or D.numel() != h
            or dt_bias.numel() != h or (not verify and ntok != 1)
            or (verify and not (_spec_ok(conv_spec, (c, width - 1), ntok)
                                and _spec_ok(ssm_spec, (h, p, n), ntok)
                                and conv_spec.shape[1] == ssm_spec.shape[1]))):
        return None
    out = torch.empty(1, t, dx, dtype=_F32)
    b2 = None if conv_b is None else conv_b.contiguous()
    A, D, dt_bias, norm_w = (v.contiguous() for v in (A, D, dt_bias, norm_w))
    k1 = conv_spec.shape[1] if verify else 1
    rc = _library().mamba2_decode_rows(
        x2.data_ptr(), x2.stride(0), z2.data_ptr(), z2.stride(0), dt2.data_ptr(), dt2.stride(0),
        t // ntok, ntok, slots.data_ptr(), conv_state.data_ptr(), _ptr(conv_spec),
        conv_w.data_ptr(), _ptr(b2), width, ssm_state.data_ptr(), _ptr(ssm_spec), k1,
        A.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), float(dt_min), float(dt_max), h, p, n, g,
        norm_w.data_ptr(), float(eps), group, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise MemoryError("mamba2_decode_rows: no scratch memory")
    return out


def gdn_decode(qkv, b, a, z, conv_w, conv_b, conv_state, slots, A, dt_bias, gdn_state, l2norm,
               scale, norm_w, eps, group, hk, h, dk, dv, ntok: int = 1, conv_spec=None,
               gdn_spec=None) -> torch.Tensor | None:
    """A gated-delta (Qwen3.5) mixer's step from its in_proj columns (qkv [1, T, C], b / a
    [1, T, H], z [1, T, H, V]; the norm per head: weight [V]) to its gated norm's output
    [1, T, H, V] in one C call (row_kernels.c `gdn_decode_rows`; decode or verify as
    mamba2_decode), or None when the kernel does not take these tensors."""
    ts = [qkv, b, a, z, conv_w, conv_state, A, dt_bias, gdn_state, norm_w]
    if conv_b is not None:
        ts.append(conv_b)
    if not _usable(*ts) or slots.dtype is not torch.int64 or not slots.is_contiguous():
        return None
    vd, c = h * dv, 2 * hk * dk + h * dv
    t, width = qkv.shape[1], conv_w.shape[-1]
    q2, b2, a2, z2 = _rows2(qkv, c), _rows2(b, h), _rows2(a, h), _rows2(z, vd)
    verify = conv_spec is not None or gdn_spec is not None
    if (q2 is None or b2 is None or a2 is None or z2 is None
            or tuple(slots.shape) != (t // ntok,) or t % ntok or h % hk or dk > 4096
            or not conv_w.is_contiguous() or tuple(conv_w.shape) != (c, width)
            or not _state_ok(conv_state, (c, width - 1))
            or not _state_ok(gdn_state, (h, dk, dv)) or dv % group or norm_w.numel() != dv
            or A.numel() != h or dt_bias.numel() != h or (not verify and ntok != 1)
            or (verify and not (_spec_ok(conv_spec, (c, width - 1), ntok)
                                and _spec_ok(gdn_spec, (h, dk, dv), ntok)
                                and conv_spec.shape[1] == gdn_spec.shape[1]))):
        return None
    out = torch.empty(1, t, h, dv, dtype=_F32)
    cb = None if conv_b is None else conv_b.contiguous()
    A, dt_bias, norm_w = (v.contiguous() for v in (A, dt_bias, norm_w))
    k1 = conv_spec.shape[1] if verify else 1
    rc = _library().gdn_decode_rows(
        q2.data_ptr(), q2.stride(0), b2.data_ptr(), b2.stride(0), a2.data_ptr(), a2.stride(0),
        z2.data_ptr(), z2.stride(0), t // ntok, ntok, slots.data_ptr(), conv_state.data_ptr(),
        _ptr(conv_spec), conv_w.data_ptr(), _ptr(cb), width, gdn_state.data_ptr(),
        _ptr(gdn_spec), k1, A.data_ptr(), dt_bias.data_ptr(), hk, h, dk, dv, int(l2norm),
        float(scale), norm_w.data_ptr(), float(eps), group, out.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise MemoryError("gdn_decode_rows: no scratch memory")
    return out


def promote_states(pairs: list[tuple[torch.Tensor, torch.Tensor]], slots: list[int],
                   idx: list[int]) -> bool:
    """`main[slots[r]] = spec[slots[r], idx[r]]` for every (main [S, ...], spec [S, K1, ...])
    pair, in one C call (row_kernels.c `promote_states`). False (nothing done) where the call
    cannot take them: no library, a tensor off the CPU or not contiguous, a spec that is not
    [S, K1, *main's entry] of main's dtype; IndexError for a slot or index out of range."""
    lib = _library()
    if lib is None or not pairs:
        return False
    k1 = pairs[0][1].shape[1]
    n_slots = pairs[0][0].shape[0]
    for main, spec in pairs:
        if (main.device.type != "cpu" or spec.device.type != "cpu" or main.dtype != spec.dtype
                or not main.is_contiguous() or not spec.is_contiguous()
                or spec.shape != (main.shape[0], k1, *main.shape[1:])
                or main.shape[0] != n_slots):
            return False
    if len(slots) != len(idx):
        raise ValueError(f"promote_states: {len(slots)} slots, {len(idx)} indices")
    if any(not 0 <= s < n_slots for s in slots) or any(not 0 <= i < k1 for i in idx):
        raise IndexError(f"promote_states: slots {slots} must lie in [0, {n_slots}) and "
                         f"indices {idx} in [0, {k1})")
    if not slots:
        return True
    lists = torch.tensor([[m.data_ptr() for m, _ in pairs], [sp.data_ptr() for _, sp in pairs],
                          [m[0].nbytes for m, _ in pairs]], dtype=torch.int64)
    rows = torch.tensor([slots, idx], dtype=torch.int64)
    lib.promote_states(len(pairs), lists[0].data_ptr(), lists[1].data_ptr(),
                       lists[2].data_ptr(), k1, rows[0].data_ptr(), rows[1].data_ptr(),
                       len(slots))
    return True
