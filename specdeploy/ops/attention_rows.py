"""Batch-invariant CPU attention for short segments (decode rows, verify steps): a C kernel that
computes each (query row, head) on its own, so a row's output is bit-identical whether it is a
1-row decode or one row of a K + 1-row verify step (`attention_rows.c`). One SDPA call over a
segment sums in another order than a 1-row call (~1e-7 apart); the fast integer-dot linears
round activations to 8 bits, which can blow that up into a different greedy token, and greedy
speculative decoding must give greedy plain decoding's tokens.

Compiled on first use like the GGUF kernels (same cache, same one-line warning when it cannot be
built); needs x86-64 with AVX2 + FMA + F16C, fp32 queries, fp32 / bf16 / fp16 / FP8 E4M3 or E5M2
caches (read exactly as fp32), head sizes that are multiples of 8. `unavailable()` says why not; the
caller then runs its per-row SDPA fallback. Value widths past 256 (absorbed MLA's 512-dim latent
values) take `attention_wide.c`: a running softmax per (row, head) over tiles of keys instead of
per-chunk partials, so its scratch does not grow with the context; it runs on any x86-64, in
generic C (the same bits) where AVX2 + FMA + F16C are missing (`wide_unavailable()`). A bf16
cache (the fast path's) on a CPU with AVX512-BF16 takes bf16 dot products instead (`bf16_dots`):
the query and the softmax weights are rounded to bf16 too, below the 8-bit activation rounding
of the fast linears that read the output; still batch and thread invariant. Sliding windows (a
row attends its last `window` keys) and attention sinks (gpt-oss's per-head logit in each
softmax's denominator) run on the fp32 path only (bf16 caches widened exactly)."""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from specdeploy.ops import ggml_linear as _gl
from specdeploy.ops.paged_kv import value_in_key

SOURCE = Path(__file__).with_name("attention_rows.c")
# the C file's KV_* values, in order
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
              torch.float8_e5m2)
_FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if os.environ.get("SPECDEPLOY_ATTENTION_KERNEL", "1") == "0":
        return None, "SPECDEPLOY_ATTENTION_KERNEL=0"
    ptr, int_ = ctypes.c_void_p, ctypes.c_int
    lib, errors = _gl.load_compiled("attention_rows", SOURCE, _FLAGS, {
        "attention_rows": ([ptr, int_, int_, int_, int_, ptr, ptr, int_, int_, ptr, int_,
                            ctypes.c_float, ptr, int_, int_], int_),
        "attention_rows_ex": ([ptr, int_, int_, int_, int_, ptr, ptr, int_, int_, ptr, int_,
                               ctypes.c_float, ptr, int_, int_, int_, ptr], int_),
        "attention_rows_v": ([ptr, int_, int_, int_, int_, ptr, ptr, int_, int_, ptr, int_,
                              ctypes.c_float, ptr, int_, int_, int_, ptr, ctypes.c_int64,
                              ctypes.c_int64], int_),
        "attention_rows_bf16_dots": ([int_], int_),
        "attention_rows_wide_mode": ([int_], int_),
        "attention_rows_wide_calls": ([], ctypes.c_int64)})
    missing = [f for f in ("avx2", "fma", "f16c") if f not in _gl._cpu_flags()]
    if lib is not None and missing:
        # NOTE: the library, not None: its wide path (value widths past 256) runs generic C
        why = f"this CPU lacks {', '.join(missing)}"
        _gl.warn_unbuilt("the batch-invariant attention kernel", why)
        return lib, why
    if lib is not None:
        return lib, None
    why = "; ".join(errors)
    _gl.warn_unbuilt("the batch-invariant attention kernel", why)
    return None, why


def unavailable() -> str | None:
    """Why the kernel does not run here at every width (None: it does)."""
    return _library()[1]


def wide_unavailable() -> str | None:
    """Why value widths past 256 (attention_wide.c) do not run here (None: they do, on the
    AVX2 kernels or, on an x86-64 CPU without them, on the generic C ones)."""
    lib, why = _library()
    return why if lib is None else None


def bf16_dots_supported() -> bool:
    """Whether bf16 caches take the AVX512-BF16 dot products here (attention_rows.c: the query
    and the softmax weights rounded to bf16 as well; head sizes multiples of 32)."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= _gl._cpu_flags()


@contextmanager
def bf16_dots(on: bool):
    """Within: bf16 caches use the bf16 dot products (where supported) or not (every value read
    exactly as fp32). For tests and benches; the default is on."""
    lib = _library()[0]
    before = lib.attention_rows_bf16_dots(int(on))
    try:
        yield
    finally:
        lib.attention_rows_bf16_dots(before)


@contextmanager
def wide_mode(every: bool = True, scalar: bool = False):
    """Within: every value width takes attention_wide.c's path (`every`), on its generic C
    kernels and cache writes (`scalar`) or the AVX2 ones where the CPU has them. For tests and
    benches."""
    lib = _library()[0]
    before = lib.attention_rows_wide_mode(int(every) | 2 * int(scalar))
    try:
        yield
    finally:
        lib.attention_rows_wide_mode(before)


def wide_calls() -> int:
    """How many calls took attention_wide.c's path in this process (any caller: the Python
    wrappers, the fused layers and CPU graph replays that call the C entry points by address)."""
    return _library()[0].attention_rows_wide_calls()


def _rows_dense(v_cache: torch.Tensor) -> bool:
    """Value rows the kernel can address: dense dims, pages of whole rows (a contiguous cache,
    or a contiguous key cache's leading dims: paged_kv.value_in_key)."""
    st = v_cache.stride()
    return st[-1] == 1 and st[0] == v_cache.shape[1] * st[1]


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (else the caller's fallback runs)."""
    d, dv = k_cache.shape[-1], v_cache.shape[-1]
    return (q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in _KV_DTYPES
            and q.device.type == "cpu" and k_cache.is_contiguous() and _rows_dense(v_cache)
            and d % 8 == 0 and dv % 8 == 0 and q.shape[-2] % k_cache.shape[2] == 0
            and (unavailable() is None or (dv > 256 and wide_unavailable() is None)))


def _sinks(sinks: torch.Tensor | None, hq: int) -> torch.Tensor | None:
    if sinks is None:
        return None
    if sinks.shape != (hq,):
        raise ValueError(f"attention sinks: expected one per query head ({hq}), "
                         f"got shape {tuple(sinks.shape)}")
    return sinks.detach().to(torch.float32).contiguous()


def attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pages: torch.Tensor, pos0: int, scale: float, window: int = 0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D]: one sequence's rows at positions pos0 .. pos0 + T - 1, each attending the
    keys up to itself (the last `window` of them where window > 0); caches [num_pages,
    page_size, Hkv, D(v)] fp32 / bf16 / fp16; pages: that sequence's page table row (int64);
    sinks: [Hq] logits joining each softmax's denominator, or None. -> [T, Hq, Dv]."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"attention kernel unavailable: {why}")
    q = q.contiguous()
    pages = pages.to(torch.int64).contiguous()
    t, hq, d = q.shape
    dv = v_cache.shape[-1]
    if pos0 < 0 or pos0 + t > pages.numel() * k_cache.shape[1]:
        raise ValueError(f"attention_rows: positions {pos0}..{pos0 + t - 1} outside the "
                         f"sequence's {pages.numel()} pages")
    out = torch.empty(t, hq, dv, dtype=torch.float32)
    sk = _sinks(sinks, hq)
    rc = lib.attention_rows_v(q.data_ptr(), t, hq, d, dv, k_cache.data_ptr(),
                              v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[2],
                              pages.data_ptr(), pos0, float(scale), out.data_ptr(),
                              torch.get_num_threads(), _KV_DTYPES.index(k_cache.dtype),
                              max(int(window), 0), None if sk is None else sk.data_ptr(),
                              v_cache.stride(1), v_cache.stride(2))
    if rc != 0:
        raise MemoryError("attention_rows: no scratch memory for the scores")
    return out


def _write_attend_fn(ex: bool = False, strided: bool = False):
    """`write_attend_rows` (layer_rows.py calls it by address) or, with ex, its form taking a
    sliding window and sinks; with strided too, value cache strides (write_attend_rows_v)."""
    lib, _ = _library()
    if lib is None:
        return None
    fn = lib.write_attend_rows_v if strided else (
        lib.write_attend_rows_ex if ex else lib.write_attend_rows)
    if not fn.argtypes:
        P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64  # noqa: N806
        fn.argtypes = [P, P, L, I, I, I, I, I, P, P, I, P, I, P, P, P, I,
                       ctypes.c_float, P, I, I] + ([I, P] if ex or strided else []) + (
                           [L, L] if strided else [])
        fn.restype = I
    return fn


def write_attend_rows(qk: torch.Tensor, qkv: torch.Tensor, v_offset: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, cu_host: torch.Tensor,
                      lens_host: torch.Tensor, page_table: torch.Tensor, scale: float,
                      window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The keys qk[:, Hq:] and values qkv[0, :, v_offset:] into the caches at `slots`, then each
    row of qk[:, :Hq] attending its segment's keys up to itself, as `attention_rows` computes
    it (the same bits). qk [T, Hq + Hkv, D] fp32 dense; qkv [1, T, W] fp32, last dim dense;
    slots [T], cu_host [S + 1], lens_host [S], page_table [S, P]: int64, dense, on the CPU.
    The caller checks `fits` for the caches. window, sinks: as `attention_rows`'. A value
    cache that is the key cache's leading dims (paged_kv.value_in_key) is written with the
    keys; qkv's values are not read. -> [T, Hq, Dv]."""
    ex = window > 0 or sinks is not None
    shared = value_in_key(k_cache, v_cache)
    strided = shared or not v_cache.is_contiguous()
    fn = _write_attend_fn(ex, strided)
    if fn is None:
        raise RuntimeError(f"attention kernel unavailable: {unavailable()}")
    t, heads, d = qk.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    hq = heads - hkv
    out = torch.empty(t, hq, dv, dtype=torch.float32)
    args = [qk.data_ptr(), None if shared else qkv.data_ptr() + 4 * v_offset, qkv.stride(1),
            t, hq, hkv, d, dv,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1], slots.data_ptr(),
            lens_host.shape[0], cu_host.data_ptr(), lens_host.data_ptr(), page_table.data_ptr(),
            page_table.shape[1], float(scale), out.data_ptr(), torch.get_num_threads(),
            _KV_DTYPES.index(k_cache.dtype)]
    if ex or strided:
        sk = _sinks(sinks, hq)
        args += [max(int(window), 0), None if sk is None else sk.data_ptr()]
    if strided:
        args += [v_cache.stride(1), v_cache.stride(2)]
    rc = fn(*args)
    if rc == -2:
        raise ValueError("write_attend_rows: a position lies outside its sequence's pages")
    if rc != 0:
        raise MemoryError("write_attend_rows: no scratch memory for the scores")
    return out
