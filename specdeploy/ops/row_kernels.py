"""C kernels for the row-wise small ops of a step (RMSNorm, RoPE, residual add + RMSNorm,
SiLU-gated product): one call instead of 5-6
torch ops, whose dispatch dominates these ops at decode sizes (`row_kernels.c`).

Used by the CPU fp32 kernels of `rms_norm` and `rope` when nothing needs their gradient (the
training backward recomputes through torch). Compiled on first use like the GGUF kernels (same
cache, same one-line warning when it cannot be built; then torch runs them). Portable C: no CPU
feature is required. SPECDEPLOY_ROW_KERNELS=0 turns them off. The recurrent mixers' decode
steps, built into the same library, are called from state_rows.py.
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
        "rope_cos_sin_rows": ([_P, _I64, _I, _I64, _I64, _I64, _P, _I64, _F, _P, _P], None),
        "add_rms_norm_rows": ([_P, _P, _I64, _I64, _P, _F, _P, _P, _I], None),
        "add3_rms_norm_rows": ([_P, _P, _P, _I64, _I64, _P, _F, _P, _P, _I], None),
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
        "promote_states": ([_I64, _P, _P, _P, _I64, _P, _P, _I64, _I], None),
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


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, sections: list[int],
                 interleaved: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(cos, sin) [B, T, 2 * len(inv_freq)] fp32 from positions [B, T] or [3, B, T] (C, one
    call; see row_kernels.c `rope_cos_sin_rows`), or None where the kernel does not take these
    tensors. NOTE: no temporaries: a CPU graph replays the call on these same buffers."""
    lib = _library()
    if (lib is None or position_ids.device.type != "cpu" or position_ids.dtype != torch.int64
            or inv_freq.dtype != _F32 or inv_freq.device.type != "cpu" or inv_freq.dim() != 1
            or not inv_freq.is_contiguous() or position_ids.dim() not in (2, 3)
            or (position_ids.dim() == 3 and (position_ids.shape[0] != 3 or not sections))
            or (sections and len(sections) != 3)):
        return None
    pos = position_ids.contiguous()
    shape = pos.shape[-2:]
    n, half = shape[0] * shape[1], inv_freq.shape[0]
    mode = 0 if not sections or pos.dim() == 2 else (1 if interleaved else 2)
    s0, s1, s2 = (int(v) for v in sections) if sections else (0, 0, 0)
    cos, sin = (torch.empty(*shape, 2 * half, dtype=_F32) for _ in range(2))
    lib.rope_cos_sin_rows(pos.data_ptr(), n, mode, s0, s1, s2, inv_freq.data_ptr(), half,
                          float(scaling), cos.data_ptr(), sin.data_ptr())
    return cos, sin


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


def add3_rms_norm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + (b + c), RMSNorm of it), the adds rounded as torch's in that order; None when the
    kernel does not take these tensors (other shapes: torch would broadcast)."""
    n = a.shape[-1]
    if (not _usable(a, b, c, weight) or a.shape != b.shape or a.shape != c.shape
            or weight.numel() != n or a.numel() == 0):
        return None
    a2, b2, c2, w = a.contiguous(), b.contiguous(), c.contiguous(), weight.contiguous()
    total, out = torch.empty(a.shape, dtype=_F32), torch.empty(a.shape, dtype=_F32)
    _library().add3_rms_norm_rows(a2.data_ptr(), b2.data_ptr(), c2.data_ptr(), a2.numel() // n,
                                  n, w.data_ptr(), float(eps), total.data_ptr(), out.data_ptr(),
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


ELEMENTWISE_OPS = {"sigmoid": 0, "softplus": 1, "exp": 2, "silu": 3, "relu2": 4}


def elementwise(name: str, x: torch.Tensor) -> torch.Tensor | None:
    """sigmoid / softplus (torch's beta 1, threshold 20) / exp / silu / relu2 (relu then
    square: torch's bits) of every element, each by the same operations wherever it sits
    (row_kernels.c `elementwise`: torch's vectorized kernels round a tensor's tail otherwise);
    None when the kernel does not take `x`."""
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


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


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
