"""Triton kernels for the small ops of a step on a CUDA device: RMSNorm (and residual add +
RMSNorm), the SiLU-gated product, and a Llama-type layer's attention from its fused q/k/v
projection (RoPE on q and k, the new keys and values into the paged cache, paged attention of
uniform steps), and RMSNorm fused with the linear that reads it (`norm_linear`, off by default:
ops/norm_linear.py). One launch each where the torch chains they replace take 6-30: a batch-1 decode
step of a small model is launch-bound (1,729 kernels, 4.1 ms a replayed step of the default
model on an H200 before these), so the count of launches is its cost.

Each kernel is row-wise or per (sequence, head, query), so a row's result does not depend on
what else is in the batch (greedy speculation stays lossless), and computes in fp32 as the refs
do. They run where `enabled(x)`: switched on, a CUDA tensor, and Triton importable. A kernel
that fails (Triton cannot build it here) turns them all off with a one-line warning and the
torch chains run, as on any other device.

On by default (SPECDEPLOY_TRITON=0 or `set_enabled(False)` turns them off): the `cuda` tests
passed with them on an H200 (2026-12-04, bench/gpu_check.sh), where they took a replayed
batch-1 decode step of the default model from 3.86 ms and 1,729 launches to 1.65 ms and 281
(bench/results/gpu_h200_1204.json). Under Triton's interpreter on a CPU (TRITON_INTERPRET=1;
tests/cuda/test_gpu_kernels.py::test_kernels_under_the_interpreter) they match the refs too.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache

import torch

_STATE = {"on": os.environ.get("SPECDEPLOY_TRITON", "1") != "0",
          # the fused norm + linear (`norm_linear`): off by default until a GPU run measures it
          "gemv": os.environ.get("SPECDEPLOY_TRITON_GEMV", "0") == "1"}
GEMV_ROWS = 32  # rows a fused norm + linear takes (decode and verify steps); more: cuBLAS
GEMV_MAX_K = 16384  # the norm's row is one register block
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET = _INTERPRET  # Triton's interpreter: the kernels run on CPU tensors (tests)


def set_enabled(on: bool) -> None:
    _STATE["on"] = bool(on)


def set_gemv(on: bool) -> None:
    """The fused RMSNorm + linear (+ SiLU-gated product) kernel of `norm_linear` on or off."""
    _STATE["gemv"] = bool(on)


def gemv_on() -> bool:
    return _STATE["gemv"]


@lru_cache(maxsize=1)
def _triton():
    try:
        import triton  # noqa: F401

        from specdeploy.ops import _triton_src
    except Exception:  # no Triton (CPU builds of torch), or one that does not import
        return None
    return _triton_src


def candidate(x: torch.Tensor) -> bool:
    """Whether a call site should try these kernels: a CUDA tensor, or any tensor under Triton's
    interpreter (TRITON_INTERPRET=1: whole models on the CPU run them, for the tests)."""
    return x.is_cuda or _INTERPRET


def enabled(x: torch.Tensor) -> bool:
    return _STATE["on"] and (x.is_cuda or _INTERPRET) and _triton() is not None


def _failed(what: str, e: Exception, key: str = "on") -> None:
    _STATE[key] = False  # "on": every kernel off; "gemv": the fused norm + linear only
    warnings.warn(f"specdeploy: the Triton {what} kernel failed ({type(e).__name__}: {e}); "
                  "the torch ops run instead", stacklevel=3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., N] -> rms_norm_ref(x, weight, eps), or None (not here: run the torch ops)."""
    if not enabled(x) or x.stride(-1) != 1:
        return None
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    out = torch.empty_like(rows)
    try:
        _triton().rms_norm_rows(rows, None, weight, eps, out, None)
    except Exception as e:
        _failed("RMSNorm", e)
        return None
    return out.view(x.shape)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a + b, rms_norm(a + b)) in one pass, or None."""
    if not enabled(a) or a.shape != b.shape or a.dtype != b.dtype or a.stride(-1) != 1 \
            or b.stride(-1) != 1:
        return None
    n = a.shape[-1]
    ra, rb = a.reshape(-1, n), b.reshape(-1, n)
    total, out = torch.empty_like(ra), torch.empty_like(ra)
    try:
        _triton().rms_norm_rows(ra, rb, weight, eps, out, total)
    except Exception as e:
        _failed("add + RMSNorm", e)
        return None
    return total.view(a.shape), out.view(a.shape)


def silu_mul(x: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [..., >= 2n] (gate, up) -> silu(gate) * up [..., n], or None."""
    if not enabled(x) or x.stride(-1) != 1:
        return None
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    try:
        _triton().silu_mul_rows(rows, n, out)
    except Exception as e:
        _failed("SiLU-gated product", e)
        return None
    return out.view(*x.shape[:-1], n)


def qkv_attention(qkv, cos, sin, k_cache, v_cache, cu_host, lens_host, page_table, cache_lens,
                  scale, sliding_window, slot_mapping, hq, hkv, d) -> torch.Tensor | None:
    """A uniform step's attention (S sequences of n <= 32 queries each: decodes and verify
    steps, the steps CUDA graphs replay) from the fused projection, or None for any other step
    (prefill chunks, mixed steps: the torch chain). qkv [1, T, >= (Hq + 2 Hkv) D]; cos, sin
    [1, T, R] (R <= D, rotate-half on the first R dims) -> [1, T, Hq, D]."""
    t, s = qkv.shape[1], page_table.shape[0]
    if (not enabled(qkv) or sliding_window or slot_mapping is None or qkv.dim() != 3
            or qkv.stride(-1) != 1 or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype
            or v_cache.shape[-1] != d or k_cache.shape[-1] != d or cos.dim() != 3
            or cos.shape[-1] % 2 or cos.shape[-1] > d or s == 0 or t % s or t // s > 32
            or hq % hkv or d & (d - 1) or cu_host.shape[0] != s + 1):
        return None
    n = t // s
    if cu_host.tolist() != list(range(0, t + 1, n)):  # host tensor: no device sync
        return None
    q = torch.empty(t, hq, d, dtype=qkv.dtype, device=qkv.device)
    out = torch.empty(1, t, hq, d, dtype=qkv.dtype, device=qkv.device)
    try:
        src = _triton()
        src.rope_write_kv(qkv[0], cos[0], sin[0], k_cache, v_cache,
                          slot_mapping, q, hq, hkv, d)
        src.paged_attention(q, k_cache, v_cache, page_table, cache_lens, scale, n, out[0])
    except Exception as e:
        _failed("paged attention", e)
        return None
    return out


def norm_linear(x: torch.Tensor, add: torch.Tensor | None, norm_w: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None, glu: int
                ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """linear(rms_norm(x [+ add]), w, bias) [-> silu_mul(., glu)] in one launch: (the sum or
    None, the output), or None (not here: the chain runs). A row's result does not depend on
    the other rows of the step (one program per row and block of outputs): batch-invariant,
    which cuBLAS's M-dependent kernels are not. Rows <= GEMV_ROWS only (decode and verify
    steps; prefill chunks are GEMMs, cuBLAS's)."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    n = w.shape[0] // 2 if glu else w.shape[0]
    if (not (_STATE["gemv"] and enabled(x)) or rows == 0 or rows > GEMV_ROWS or k > GEMV_MAX_K
            or w.dim() != 2 or w.shape[1] != k or w.dtype != x.dtype or w.stride(-1) != 1
            or x.stride(-1) != 1 or (glu and w.shape[0] != 2 * glu)
            or (add is not None and (add.shape != x.shape or add.dtype != x.dtype
                                     or add.stride(-1) != 1))
            or (bias is not None and (bias.dtype != x.dtype or bias.stride(-1) != 1))):
        return None
    xr = x.reshape(rows, k)
    ar = None if add is None else add.reshape(rows, k)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    total = None if add is None else torch.empty_like(xr)
    try:
        _triton().norm_linear_rows(xr, ar, norm_w, eps, w, bias, out, total, bool(glu))
    except Exception as e:
        _failed("RMSNorm + linear", e, "gemv")
        return None
    return (None if total is None else total.view(x.shape)), out.view(*x.shape[:-1], n)
