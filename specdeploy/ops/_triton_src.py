"""The Triton kernels of `gpu_kernels` and their launchers (imported only where Triton is).
Shapes and the math each one reproduces are in `gpu_kernels`' docstrings; every kernel loads
in the tensors' dtype, computes in fp32, and rounds where the torch chain it replaces rounds."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rms_norm_k(x_ptr, b_ptr, w_ptr, out_ptr, total_ptr, n, sx, sb, so, st, eps,
                HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    if HAS_B:  # the residual sum, rounded to the dtype as `a + b` is, then normed
        b = tl.load(b_ptr + row * sb + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * st + cols, x, mask=mask)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, ((xf * r) * w).to(x.dtype), mask=mask)


def rms_norm_rows(x, b, weight, eps, out, total) -> None:
    rows, n = x.shape
    block = triton.next_power_of_2(n)
    _rms_norm_k[(rows,)](x, x if b is None else b, weight, out, out if total is None else total,
                         n, x.stride(0), 0 if b is None else b.stride(0), out.stride(0),
                         0 if total is None else total.stride(0), float(eps),
                         HAS_B=b is not None, BLOCK=block)


@triton.jit
def _silu_mul_k(x_ptr, out_ptr, n, sx, so, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * sx + n + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu rounds to the dtype, then the mul
    tl.store(out_ptr + row * so + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)


def silu_mul_rows(x, n, out) -> None:
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_k[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0),
                                                     BLOCK=block)


@triton.jit
def _norm_linear_k(x_ptr, b_ptr, nw_ptr, w_ptr, bias_ptr, out_ptr, total_ptr, n_out, sx, sb,
                   sw, so, st, eps, K: tl.constexpr, KB: tl.constexpr, HAS_B: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """One row x BLOCK_N outputs of linear(rms_norm(x [+ b]), W) [-> silu(gate) * up]: the
    row's norm in one block (as `_rms_norm_k`), then the dot products over K in chunks of
    BLOCK_K. A row's result never depends on the other rows (batch-invariant)."""
    row = tl.program_id(1)
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, KB)
    m = cols < K
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    if HAS_B:
        x = (x.to(tl.float32) + tl.load(b_ptr + row * sb + cols, mask=m,
                                        other=0.0).to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = ns < n_out
    acc = tl.zeros((BLOCK_N,), tl.float32)
    acc_up = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        km = ks < K
        xk = tl.load(x_ptr + row * sx + ks, mask=km, other=0.0)
        if HAS_B:  # the residual sum, rounded to the dtype as `a + b` is
            xk = (xk.to(tl.float32) + tl.load(b_ptr + row * sb + ks, mask=km,
                                              other=0.0).to(tl.float32)).to(dt)
            tl.store(total_ptr + row * st + ks, xk, mask=km & (pid == 0))
        w_n = tl.load(nw_ptr + ks, mask=km, other=0.0).to(tl.float32)
        # rms_norm's output, rounded to the dtype as the op's is
        xk = ((xk.to(tl.float32) * r) * w_n).to(dt).to(tl.float32)
        wm = nm[:, None] & km[None, :]
        w = tl.load(w_ptr + ns[:, None] * sw + ks[None, :], mask=wm, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        if GLU:  # the up half's rows: n_out further down the fused gate/up weight
            wu = tl.load(w_ptr + (ns + n_out)[:, None] * sw + ks[None, :], mask=wm, other=0.0)
            acc_up += tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=nm, other=0.0).to(tl.float32)
        if GLU:
            acc_up += tl.load(bias_ptr + n_out + ns, mask=nm, other=0.0).to(tl.float32)
    y = acc.to(dt)  # the linear's output, rounded as the matmul's is
    if GLU:  # then silu_mul as `_silu_mul_k`
        g = y.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt)
        y = (silu.to(tl.float32) * acc_up.to(dt).to(tl.float32)).to(dt)
    tl.store(out_ptr + row * so + ns, y, mask=nm)


# A decode step's GEMV is latency-bound: each chunk of K is a dependent round trip to memory, so
# a program takes its whole row of weights in as few chunks as its registers allow (K = 576: one)
GEMV_BLOCK_K = 1024


def norm_linear_rows(x, b, norm_w, eps, w, bias, out, total, glu: bool) -> None:
    """x [M, K] (+ b [M, K] -> total); norm_w [K]; w [N, K] (N = 2 n_out with glu); bias [N]
    or None; out [M, n_out]."""
    rows, k = x.shape
    n_out = out.shape[1]
    block_n = 16 if n_out >= 2048 else 8
    if _INTERPRET:  # a program at a time in Python: fewer, wider ones (a row's sums the same)
        block_n = min(128, triton.next_power_of_2(n_out))
    grid = (triton.cdiv(n_out, block_n), rows)
    _norm_linear_k[grid](x, x if b is None else b, norm_w, w,
                         w if bias is None else bias, out, out if total is None else total,
                         n_out, x.stride(0), 0 if b is None else b.stride(0), w.stride(0),
                         out.stride(0), 0 if total is None else total.stride(0), float(eps),
                         K=k, KB=triton.next_power_of_2(k), HAS_B=b is not None,
                         HAS_BIAS=bias is not None, GLU=bool(glu), BLOCK_N=block_n,
                         BLOCK_K=min(GEMV_BLOCK_K, triton.next_power_of_2(k)))


@triton.jit
def _rope_write_k(qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr, s_qkv, s_cos,
                  r, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # q heads, then k heads (each with its v head)
    j = tl.arange(0, D)
    half = r // 2
    rot = j < r
    partner = tl.where(j < half, j + half, j - half)
    base = qkv_ptr + t * s_qkv + h * D
    x = tl.load(base + j)
    xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * s_cos + j, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_cos + j, mask=rot, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    y = tl.where(rot, xf * c + tl.where(j < half, -xp, xp) * s, xf).to(x.dtype)
    if h < HQ:
        tl.store(q_ptr + (t * HQ + h) * D + j, y)
    else:
        kh = h - HQ
        row = tl.load(slot_ptr + t)
        tl.store(kc_ptr + (row * HKV + kh) * D + j, y)
        v = tl.load(qkv_ptr + t * s_qkv + (HQ + HKV + kh) * D + j)
        tl.store(vc_ptr + (row * HKV + kh) * D + j, v)


def rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, q, hq, hkv, d) -> None:
    """qkv [T, >= (Hq + 2 Hkv) D]; cos, sin [T, R]; caches [pages, page_size, Hkv, D]."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.stride(-1) == 1
            and sin.stride() == cos.stride()):
        raise ValueError("rope_write_kv: needs contiguous caches and rows of cos / sin")
    _rope_write_k[(qkv.shape[0], hq + hkv)](qkv, cos, sin, k_cache, v_cache, slot_mapping, q,
                                            qkv.stride(0), cos.stride(0), cos.shape[-1],
                                            HQ=hq, HKV=hkv, D=d)


@triton.jit
def _attn_part_k(q_ptr, kc_ptr, vc_ptr, pt_ptr, lens_ptr, m_ptr, den_ptr, acc_ptr, scale, n,
                 width, s_pt, page_size, splits, HQ: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr, CHUNK: tl.constexpr):
    """One (query, head, chunk of CHUNK keys): the chunk's max score, sum of exp and
    exp-weighted sum of values (flash-decoding's partials; a chunk past the query's position
    writes nothing and the combine never reads it)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    seq = t // n
    pos = tl.load(lens_ptr + seq) + t % n  # this query's position: keys 0..pos
    if c * CHUNK <= pos:
        kh = h // (HQ // HKV)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (t * HQ + h) * D + d).to(tl.float32) * scale
        j = c * CHUNK + tl.arange(0, CHUNK)
        valid = (j <= pos) & (j // page_size < width)
        page = tl.load(pt_ptr + seq * s_pt + j // page_size, mask=valid, other=0)
        row = (page * page_size + j % page_size) * HKV + kh
        k = tl.load(kc_ptr + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        scores = tl.where(valid, tl.sum(k.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m = tl.max(scores, axis=0)
        p = tl.exp(scores - m)
        v = tl.load(vc_ptr + row[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        part = (t * HQ + h) * splits + c
        tl.store(m_ptr + part, m)
        tl.store(den_ptr + part, tl.sum(p, axis=0))
        tl.store(acc_ptr + part * D + d, tl.sum(p[:, None] * v.to(tl.float32), axis=0))


@triton.jit
def _combine_chunk(m_ptr, den_ptr, acc_ptr, at, live, d, mx, den, acc, D: tl.constexpr):
    """Chunk `at`'s partials into the running (max, sum, weighted sum); a dead chunk loads as
    (-inf, 0, 0): a rescale by exp(0) = 1 and + 0, exactly nothing."""
    m = tl.load(m_ptr + at, mask=live, other=float("-inf"))
    new = tl.maximum(mx, m)
    alpha, w = tl.exp(mx - new), tl.exp(m - new)
    den = den * alpha + w * tl.load(den_ptr + at, mask=live, other=0.0)
    acc = acc * alpha + w * tl.load(acc_ptr + at * D + d, mask=live, other=0.0)
    return new, den, acc


@triton.jit
def _attn_combine_k(lens_ptr, m_ptr, den_ptr, acc_ptr, out_ptr, n, splits,
                    HQ: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                    SPLITS: tl.constexpr):
    """One (query, head): its live chunks' partials in chunk order, so the result depends on
    the query's position only, not on the table's width (`splits`) or on what else is in the
    step. `splits` is a runtime loop bound (one compile for every width); SPLITS > 0 (Triton's
    interpreter, which cannot loop to a runtime bound) loops to it instead."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(lens_ptr + t // n) + t % n
    base = (t * HQ + h) * splits
    d = tl.arange(0, D)
    mx = tl.full((), float("-inf"), tl.float32)
    den = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((D,), tl.float32)
    if SPLITS > 0:
        for c in range(0, SPLITS):
            mx, den, acc = _combine_chunk(m_ptr, den_ptr, acc_ptr, base + c, c * CHUNK <= pos,
                                          d, mx, den, acc, D)
    else:
        for c in range(0, splits):
            mx, den, acc = _combine_chunk(m_ptr, den_ptr, acc_ptr, base + c, c * CHUNK <= pos,
                                          d, mx, den, acc, D)
    tl.store(out_ptr + (t * HQ + h) * D + d, (acc / den).to(out_ptr.dtype.element_ty))


_RUNTIME_BOUND = [True]  # the combine loops to a runtime bound (False: to a constexpr one)
_CHUNK = 64  # keys a program attends to: a batch-1 decode at 500 tokens is 8 x heads programs


def paged_attention(q, k_cache, v_cache, page_table, cache_lens, scale, n, out) -> None:
    """q [T, Hq, D] (T = S * n, query i of sequence s at cache_lens[s] + i, its own key
    written); page_table [S, W]; out [T, Hq, D]. Split over chunks of keys, then combined
    (flash-decoding): a batch-1 step's few (query, head) pairs fill the GPU."""
    t, hq, d = q.shape
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    if page_table.stride(-1) != 1:
        page_table = page_table.contiguous()
    splits = triton.cdiv(page_table.shape[1] * page_size, _CHUNK)
    m = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)
    den = torch.empty_like(m)
    acc = torch.empty(t, hq, splits, d, dtype=torch.float32, device=q.device)
    _attn_part_k[(t, hq, splits)](q, k_cache, v_cache, page_table, cache_lens, m, den, acc,
                                  float(scale), n, page_table.shape[1], page_table.stride(0),
                                  page_size, splits, HQ=hq, HKV=hkv, D=d, CHUNK=_CHUNK)
    bound = splits if _INTERPRET or not _RUNTIME_BOUND[0] else 0
    try:
        _attn_combine_k[(t, hq)](cache_lens, m, den, acc, out, n, splits, HQ=hq, D=d,
                                 CHUNK=_CHUNK, SPLITS=bound)
    except Exception:  # NOTE: a Triton that cannot build the runtime-bound loop: a compile
        if bound:  # per page width instead (the same chunks, the same order)
            raise
        _RUNTIME_BOUND[0] = False
        _attn_combine_k[(t, hq)](cache_lens, m, den, acc, out, n, splits, HQ=hq, D=d,
                                 CHUNK=_CHUNK, SPLITS=splits)


__all__ = ["rms_norm_rows", "silu_mul_rows", "norm_linear_rows", "rope_write_kv",
           "paged_attention", "torch"]
