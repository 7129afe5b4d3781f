/* Paged causal attention for the query rows of a step (decode rows, verify segments, prefill
 * chunks):
 *     out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g]) v[j, g],  j = 0..pos[t], g = h / rep
 * (with a sliding window W only keys j > pos[t] - W; with attention sinks a per-head logit
 * sink[h] joins each softmax's denominator, as gpt-oss's, and weighs no value)
 * computed chunk by chunk of keys at fixed positions (see "chunked attention" below), so that a
 * row's output is bit-identical in a 1-row decode and in a K + 1-row verify step, at any thread
 * count (batch invariance; one SDPA over the segment sums in another order). Keys and values
 * are read from the paged cache [num_pages, page_size, Hkv, D], fp32, bf16, fp16, FP8 E4M3 or
 * FP8 E5M2 (`kv`: KV_F32 / KV_BF16 / KV_F16 / KV_F8 / KV_F8E5; each value widened exactly to
 * fp32, all arithmetic in fp32).
 * Built at run time by attention_rows.py; AVX2 + FMA + F16C required (checked there),
 * -ffp-contract=off.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* KV_F8: float8_e4m3fn; KV_F8E5: float8_e5m2 (fp16's top byte) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_F8 = 3, KV_F8E5 = 4 };

static inline int kv_bytes(const int kv) { return kv == KV_F32 ? 4 : kv >= KV_F8 ? 1 : 2; }

/* float8_e4m3fn bytes as fp32, exactly, through fp16 (whose 5 exponent bits hold E4M3's 4):
 * a byte sign-extended to 16 bits and shifted left by 7 has its sign at bit 15 (a copy at bit
 * 14, cleared) and its exponent and mantissa at fp16's bits 13..7: the fp16 value 2^-8 times
 * the E4M3 one (bias 15 for 7; subnormals land on fp16 subnormals), which F16C widens and a
 * multiply by 2^8 rescales, both exact. 0x7F / 0xFF (NaN: E4M3 "fn" has no infinities) would
 * read 480: they become fp16 NaN first. f8_half: 16 bytes at p as fp16 bits. */
AVX2 static inline __m256i f8_half(const uint8_t *p) {
    __m256i h = _mm256_and_si256(
        _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), 7),
        _mm256_set1_epi16((short)0xBF80));
    return _mm256_or_si256(h, _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)),
                                                 _mm256_set1_epi16(0x3F80)));
}

AVX2 static inline __m256 f8_wide(const __m128i h) {
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}

AVX2 static inline __m256 load8_f8(const uint8_t *p) { /* 8 bytes (reads 8, not 16) */
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7),
                              _mm_set1_epi16((short)0xBF80));
    h = _mm_or_si128(h, _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)),
                                        _mm_set1_epi16(0x3F80)));
    return f8_wide(h);
}

/* 8 cache values at p as fp32 (exact: bf16, fp16 and FP8 widen without rounding) */
AVX2 static inline __m256 load8(const uint8_t *p, const int kv) {
    if (kv == KV_F32) return _mm256_loadu_ps((const float *)p);
    if (kv == KV_F8) return load8_f8(p);
    if (kv == KV_F8E5) /* the fp16 value whose top byte it is */
        return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (kv == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

AVX2 static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* e^x for x <= 0 (scores minus their max), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2, e^r by
 * its degree-6 Taylor polynomial (relative error < 2e-7 there), times 2^n through the exponent
 * bits; below -87 it returns ~1e-38, which no sum of weights >= 1 notices. Deterministic: the
 * same x gives the same bits wherever it sits in the row. */
AVX2 static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* ---- chunked attention ------------------------------------------------------------------
 * Keys are cut into chunks of CH at absolute positions (chunk c: keys c*CH .. c*CH + CH - 1).
 * A query row at position pos attends chunks 0..pos / CH; chunk c gives the partial
 *     m_c = max_j s_j,  l_c = sum_j e^(s_j - m_c),  o_c = sum_j e^(s_j - m_c) v_j
 * over its keys j <= pos (s_j = scale * q . k_j), and the row's output is
 *     sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,  M = max_c m_c,  chunks in order.
 * That is the definition of the result, bit for bit: which thread computes which chunk, and
 * which other rows or heads share the pass, changes nothing (batch and thread invariance). A
 * pass over a chunk serves every query row of the segment and every query head of one KV head
 * at once, so the chunk's keys and values are read from the cache (and widened to fp32) once
 * per step, not once per (row, head): verify rows and grouped heads cost the arithmetic only. */
#define CH 32
#define WINDOW 64 /* query rows per pass: bounds the partials' memory for long prefill chunks */

/* 8 keys' dot products with q at once: each key's is an fma chain over d (8 lanes, from zero),
 * then one fixed reduction tree per lane; the same bits for a key wherever it sits */
AVX2 static inline __m256 dot8(const float *q, const float *k, int D) {
    __m256 a[8];
    for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + u * D + d), a[u]);
    }
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* keys/values lo..hi-1 of one KV head g, from the paged cache into dense fp32 rows */
AVX2 static inline void widen(const uint8_t *cache, int64_t row_bytes, int64_t off, int n,
                              const int64_t *pages, int page_size, int lo, int hi, float *dst,
                              const int kv) {
    const size_t es = kv_bytes(kv);
    for (int j = lo; j < hi;) {
        const int in_page = j % page_size, take = page_size - in_page < hi - j ? page_size - in_page : hi - j;
        const uint8_t *src = cache + ((size_t)pages[j / page_size] * page_size + in_page) * row_bytes + off;
        for (int i = 0; i < take; i++, j++, src += row_bytes) {
            float *d = dst + (size_t)(j - lo) * n;
            int x = 0;
            if (kv == KV_F8) /* 16 at a time: the byte-to-half steps serve two vectors */
                for (; x + 16 <= n; x += 16) {
                    const __m256i h = f8_half(src + x);
                    _mm256_storeu_ps(d + x, f8_wide(_mm256_castsi256_si128(h)));
                    _mm256_storeu_ps(d + x + 8, f8_wide(_mm256_extracti128_si256(h, 1)));
                }
            if (kv == KV_F8E5)
                for (; x + 16 <= n; x += 16) {
                    const __m256i h = _mm256_slli_epi16(
                        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + x))), 8);
                    _mm256_storeu_ps(d + x, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
                    _mm256_storeu_ps(d + x + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
                }
            for (; x < n; x += 8) _mm256_storeu_ps(d + x, load8(src + x * es, kv));
        }
    }
}

/* the cache rows of keys lo..hi-1 of one KV head toward this core's caches: the next work
 * item's, fetched while this one computes (the cache is cold after the layer's weights) */
static inline void prefetch_rows(const uint8_t *cache, int64_t row_bytes, int64_t off,
                                 int64_t bytes, const int64_t *pages, int page_size, int lo,
                                 int hi) {
    for (int j = lo; j < hi; j++) {
        const uint8_t *src = cache + ((size_t)pages[j / page_size] * page_size + j % page_size) * row_bytes + off;
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)(src + b), _MM_HINT_T0);
    }
}

typedef struct { /* query rows t0..t1-1 of one sequence, row t at position pos0 + t - t0 */
    int t0, t1, pos0;
    const int64_t *pages;
    int64_t first; /* its first work item */
    int c0;        /* its first chunk (past 0 under a sliding window) */
} piece_t;

typedef struct {
    const float *q; int64_t q_row; /* (row t, head h) query at q + t * q_row + h * D */
    int Hq, Hkv, D, Dv, page_size;
    const uint8_t *k_cache, *v_cache;
    float scale;
    float *out; /* [T, Hq, Dv] */
    int kv;
    int window;         /* sliding window in keys (0: none) */
    const float *sinks; /* [Hq] sink logits, or NULL */
    int64_t v_row, v_head; /* values: elements a token's row, a KV head (Hkv * Dv, Dv when
                            * dense; the key's when the values are its leading dims) */
} attn_t;

static inline int piece_last(const piece_t *p) { return p->pos0 + (p->t1 - 1 - p->t0); }

/* the first key a row at position pos attends */
static inline int first_key(const attn_t *A, int pos) {
    return A->window > 0 && pos - A->window + 1 > 0 ? pos - A->window + 1 : 0;
}

static void prefetch_item(const attn_t *A, const piece_t *p, int g, int c) {
    const int es = kv_bytes(A->kv), lo = c * CH, last = piece_last(p);
    const int hi = last + 1 < lo + CH ? last + 1 : lo + CH;
    prefetch_rows(A->k_cache, (int64_t)A->Hkv * A->D * es, (int64_t)g * A->D * es,
                  (int64_t)A->D * es, p->pages, A->page_size, lo, hi);
    prefetch_rows(A->v_cache, A->v_row * es, (int64_t)g * A->v_head * es,
                  (int64_t)A->Dv * es, p->pages, A->page_size, lo, hi);
}

/* one work item: chunk c of KV head g for the rows of piece p of the window starting at row w0.
 * part: [WINDOW, Hq, nc, 2 + Dv] partials; scratch kc [CH, D], vc [CH, Dv], e [CH] */
AVX2 static inline void chunk_item(const attn_t *A, const piece_t *p, int g, int c, int w0,
                                   int nc, float *part, float *kc, float *vc, float *e,
                                   const int kv) {
    const int D = A->D, Dv = A->Dv, rep = A->Hq / A->Hkv, lo = c * CH;
    const int maxpos = p->pos0 + (p->t1 - 1 - p->t0);
    const int hi = maxpos + 1 < lo + CH ? maxpos + 1 : lo + CH;
    const size_t es = kv_bytes(kv);
    widen(A->k_cache, (int64_t)A->Hkv * D * es, (int64_t)g * D * es, D, p->pages, A->page_size,
          lo, hi, kc, kv);
    widen(A->v_cache, A->v_row * (int64_t)es, (int64_t)g * A->v_head * es, Dv, p->pages,
          A->page_size, lo, hi, vc, kv);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 sc = _mm256_set1_ps(A->scale);
    for (int t = p->t0; t < p->t1; t++) {
        const int pos = p->pos0 + (t - p->t0), fk = first_key(A, pos);
        if (pos < lo || fk >= lo + CH) continue; /* the chunk lies outside the row's keys */
        const int n = pos + 1 - lo < CH ? pos + 1 - lo : CH; /* keys lo..lo+n-1 */
        const int j0 = fk > lo ? fk - lo : 0, j8 = j0 & ~7;   /* keys before j0: outside */
        const __m256i lo_lane = _mm256_sub_epi32(lane, _mm256_set1_epi32(j0));
        for (int r = 0; r < rep; r++) {
            const int h = g * rep + r;
            const float *q = A->q + (size_t)t * A->q_row + (size_t)h * D;
            /* the chunk's max score, 8 lanes at a time: max_ps(s, m) keeps m where s is not
             * greater (a NaN score included), as the scalar `s > m ? s : m` did; lanes past
             * the row's keys are -inf. A max is exact in any order: the same m. */
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            __m256 mx = ninf;
            for (int j = j8; j < n; j += 8) {
                const __m256 s = _mm256_mul_ps(dot8(q, kc + (size_t)j * D, D), sc);
                _mm256_storeu_ps(e + j, s);
                const __m256 live = _mm256_castsi256_ps(_mm256_andnot_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(-j), lo_lane),
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), lane)));
                mx = _mm256_max_ps(_mm256_blendv_ps(ninf, s, live), mx);
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float m = _mm_cvtss_f32(m4);
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sv = _mm256_setzero_ps();
            for (int j = j8; j < n; j += 8) {
                const __m256 keep = _mm256_castsi256_ps(_mm256_andnot_si256(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(-j), lo_lane),
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), lane)));
                const __m256 w = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_loadu_ps(e + j), mv)), keep);
                _mm256_storeu_ps(e + j, w);
                sv = _mm256_add_ps(sv, w);
            }
            float *dst = part + (((size_t)(t - w0) * A->Hq + h) * nc + c) * (2 + Dv);
            dst[0] = m;
            dst[1] = hsum8(sv);
            int x = 0;
            for (; x + 64 <= Dv; x += 64) { /* 8 accumulators a strip: all in registers */
                __m256 o[8];
                for (int v = 0; v < 8; v++) o[v] = _mm256_setzero_ps();
                for (int j = j0; j < n; j++) {
                    const __m256 w = _mm256_set1_ps(e[j]);
                    const float *vr = vc + (size_t)j * Dv + x;
                    for (int v = 0; v < 8; v++) o[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * v), o[v]);
                }
                for (int v = 0; v < 8; v++) _mm256_storeu_ps(dst + 2 + x + 8 * v, o[v]);
            }
            for (; x < Dv; x += 8) { /* the rest, a vector at a time (same sums per element) */
                __m256 o = _mm256_setzero_ps();
                for (int j = j0; j < n; j++)
                    o = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_loadu_ps(vc + (size_t)j * Dv + x), o);
                _mm256_storeu_ps(dst + 2 + x, o);
            }
        }
    }
}

/* ---- bf16 dot products (AVX512-BF16) ------------------------------------------------------
 * With a bf16 cache on a CPU with AVX512-BF16 (and `bf16_dots` on), a work item takes its
 * dot products with vdpbf16ps: 32 bf16 products an instruction where fp32 FMAs do 8, and the
 * keys are read from the cache as they are stored (no widening). The query (per row and head)
 * and the softmax weights are rounded to bf16 (to nearest even) for it; the max, the
 * exponentials, the weights' sum and the partials stay fp32, and the weights' sum adds the
 * rounded weights (the partial output is a convex combination of the values). On the fast
 * path (bf16 cache) that rounding is below the 8-bit activation rounding of the o projection
 * that reads this output. A key's score and a row's output still depend on that row and the
 * keys alone, in a fixed order: batch and thread invariance hold as on the fp32 path.
 * Needs D % 32 == 0 and Dv % 32 == 0 (else the fp32 path runs). */
static int bf16_dots = 1;

int attention_rows_bf16_dots(int on) { /* the switch (tests); returns the previous value */
    const int before = bf16_dots;
    if (on >= 0) bf16_dots = on;
    return before;
}

#define BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))

/* s[j] = the sum of the 16 lanes of v[j], j = 0..15: 256-bit halves, then 128-bit quarters,
 * then lane pairs, then lanes, each step adding two shuffles; the last permute puts key j in
 * lane j. A fixed order for every key. */
BF16 static inline __m512 sum16x16(const __m512 *v) {
    __m512 w[8], z[4], u[2];
    for (int m = 0; m < 8; m++)
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
    for (int p = 0; p < 4; p++)
        z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * p], w[2 * p + 1], 0xDD));
    for (int q = 0; q < 2; q++)
        u[q] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * q], z[2 * q + 1], 0x44),
                             _mm512_shuffle_ps(z[2 * q], z[2 * q + 1], 0xEE));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88),
                                   _mm512_shuffle_ps(u[0], u[1], 0xDD));
    const __m512i key = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(key, s);
}


/* the partial output's dims x .. x + 32 NB - 1 from the interleaved values vi and the weight
 * pairs ew of keys 0..n-1: per dim the even key pairs' chain plus the odd ones' (two chains for
 * the dot product's latency), then their sum. NB constant where inlined: all in registers. */
BF16 static inline __attribute__((always_inline)) void pv_blocks(
    const uint16_t *vi, int Dv, int x, const uint32_t *ew, int n, float *dst, const int NB) {
    const __m512i out0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i out1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
    const __m512i even = _mm512_set1_epi32(0xFFFF);
    __m512 a0[4], a1[4]; /* even / odd pairs; per 32-dim block: lo, hi */
    for (int u = 0; u < 2 * NB; u++) a0[u] = a1[u] = _mm512_setzero_ps();
    const int pairs = (n + 1) / 2;
    int i = 0;
    for (; i + 1 < pairs; i += 2) {
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)ew[i]);
        const __m512bh w1 = (__m512bh)_mm512_set1_epi32((int)ew[i + 1]);
        const uint16_t *s0 = vi + ((size_t)i * Dv + x) * 2, *s1 = s0 + (size_t)Dv * 2;
        for (int u = 0; u < 2 * NB; u++) {
            __m512i v1 = _mm512_loadu_si512((const void *)(s1 + 32 * u));
            /* key n is not this row's: its value must not be read at all (a weight of 0 times
             * a NaN is NaN) */
            if (2 * (i + 1) + 1 == n) v1 = _mm512_and_si512(v1, even);
            a0[u] = _mm512_dpbf16_ps(a0[u], (__m512bh)_mm512_loadu_si512((const void *)(s0 + 32 * u)), w0);
            a1[u] = _mm512_dpbf16_ps(a1[u], (__m512bh)v1, w1);
        }
    }
    if (i < pairs) { /* a last even pair */
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)ew[i]);
        const uint16_t *s0 = vi + ((size_t)i * Dv + x) * 2;
        for (int u = 0; u < 2 * NB; u++) {
            __m512i v0 = _mm512_loadu_si512((const void *)(s0 + 32 * u));
            if (2 * i + 1 == n) v0 = _mm512_and_si512(v0, even);
            a0[u] = _mm512_dpbf16_ps(a0[u], (__m512bh)v0, w0);
        }
    }
    for (int u = 0; u < NB; u++) {
        const __m512 lo = _mm512_add_ps(a0[2 * u], a1[2 * u]);
        const __m512 hi = _mm512_add_ps(a0[2 * u + 1], a1[2 * u + 1]);
        _mm512_storeu_ps(dst + 32 * u, _mm512_permutex2var_ps(lo, out0, hi));
        _mm512_storeu_ps(dst + 32 * u + 16, _mm512_permutex2var_ps(lo, out1, hi));
    }
}

/* the scaled scores of keys 0..n-1 (rows kr) for query q (fp32, rounded to bf16 here) into
 * e (whole groups of 16: lanes past n are computed and not used); returns their lane-wise max
 * over live keys (max_ps keeps the running max where a score is NaN: NaN scores are ignored,
 * as on the fp32 path). NB = D / 32, constant where inlined. */
BF16 static inline __attribute__((always_inline)) __m512 qk_scores(
    const float *q, const uint8_t *const *kr, int n, float scale, float *e, const int NB) {
    __m512bh qb[8];
    for (int b = 0; b < NB; b++)
        qb[b] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * b + 16), _mm512_loadu_ps(q + 32 * b));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 sc = _mm512_set1_ps(scale);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < n; j0 += 16) {
        __m512 dots[16];
        for (int u = 0; u < 16; u++) {
            __m512 acc = _mm512_setzero_ps();
            for (int b = 0; b < NB; b++)
                acc = _mm512_dpbf16_ps(acc, qb[b],
                                       (__m512bh)_mm512_loadu_si512((const void *)(kr[j0 + u] + 64 * b)));
            dots[u] = acc;
        }
        const __m512 s = _mm512_mul_ps(sum16x16(dots), sc);
        _mm512_storeu_ps(e + j0, s);
        const __mmask16 live = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(n - j0), lane);
        mx = _mm512_mask_max_ps(mx, live, s, mx);
    }
    return mx;
}

BF16 static __m512 qk_scores_any(const float *q, const uint8_t *const *kr, int n, float scale,
                                 float *e, int nb) { /* D = 96, 160, ...: the same, not unrolled */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    switch (nb) {
    case 3: mx = qk_scores(q, kr, n, scale, e, 3); break;
    case 5: mx = qk_scores(q, kr, n, scale, e, 5); break;
    case 6: mx = qk_scores(q, kr, n, scale, e, 6); break;
    case 7: mx = qk_scores(q, kr, n, scale, e, 7); break;
    default: mx = qk_scores(q, kr, n, scale, e, 8); break;
    }
    return mx;
}

/* chunk_item's partials (m, l, o) with bf16 dot products. scratch: vi [CH / 2, Dv, 2] bf16
 * (the chunk's values, key pairs interleaved), e [CH] */
BF16 static void chunk_item_bf16(const attn_t *A, const piece_t *p, int g, int c, int w0, int nc,
                                 float *part, uint16_t *vi, float *e) {
    const int D = A->D, Dv = A->Dv, rep = A->Hq / A->Hkv, lo = c * CH;
    const int maxpos = p->pos0 + (p->t1 - 1 - p->t0);
    const int hi = maxpos + 1 < lo + CH ? maxpos + 1 : lo + CH, cnt = hi - lo;
    const int64_t krow = (int64_t)A->Hkv * D * 2, vrow = A->v_row * 2;
    const uint8_t *kr[CH], *vr[CH];
    for (int j = 0, pg = lo / A->page_size, off = lo % A->page_size; j < cnt; j++) {
        const size_t row = (size_t)p->pages[pg] * A->page_size + off;
        kr[j] = A->k_cache + row * krow + (int64_t)g * D * 2;
        vr[j] = A->v_cache + row * vrow + (int64_t)g * A->v_head * 2;
        if (++off == A->page_size) off = 0, pg++;
    }
    for (int j = cnt; j < CH; j++) kr[j] = kr[0]; /* past the chunk: computed, never used */
    /* values: pairs (2i, 2i + 1) interleaved per 128-bit lane by unpacklo / unpackhi, so output
     * lane l of a 32-dim block is dim 8 (l / 4) + l % 4 (lo) or that + 4 (hi) */
    for (int i = 0; 2 * i < cnt; i++) {
        const uint8_t *a = vr[2 * i], *b = 2 * i + 1 < cnt ? vr[2 * i + 1] : NULL;
        for (int x = 0; x < Dv; x += 32) {
            const __m512i va = _mm512_loadu_si512((const void *)(a + 2 * x));
            const __m512i vb = b ? _mm512_loadu_si512((const void *)(b + 2 * x))
                                 : _mm512_setzero_si512();
            uint16_t *dst = vi + ((size_t)i * Dv + x) * 2;
            _mm512_storeu_si512((void *)dst, _mm512_unpacklo_epi16(va, vb));
            _mm512_storeu_si512((void *)(dst + 32), _mm512_unpackhi_epi16(va, vb));
        }
    }
    for (int t = p->t0; t < p->t1; t++) {
        const int pos = p->pos0 + (t - p->t0);
        if (pos < lo) continue;
        const int n = pos + 1 - lo < CH ? pos + 1 - lo : CH; /* keys lo..lo+n-1 */
        for (int r = 0; r < rep; r++) {
            const int h = g * rep + r;
            const float *q = A->q + (size_t)t * A->q_row + (size_t)h * D;
            __m512 mx;
            switch (D / 32) { /* the query in registers: a constant block count */
            case 1: mx = qk_scores(q, kr, n, A->scale, e, 1); break;
            case 2: mx = qk_scores(q, kr, n, A->scale, e, 2); break;
            case 4: mx = qk_scores(q, kr, n, A->scale, e, 4); break;
            default: mx = qk_scores_any(q, kr, n, A->scale, e, D / 32); break;
            }
            const float m = _mm512_reduce_max_ps(mx);
            /* e^(s - m) in 8 lanes (the fp32 path's exp_neg: the same weights), rounded to
             * bf16; keys past n weigh 0 */
            float lsum = 0.f;
            __m256 sv = _mm256_setzero_ps();
            const __m256 mv = _mm256_set1_ps(m);
            const __m256i lane8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for (int j = 0; j < CH; j += 8) {
                const __m256 keep = _mm256_castsi256_ps(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), lane8));
                __m256 w = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_loadu_ps(e + j), mv)), keep);
                /* to bf16 and back: the weight the products use */
                const __m128i wb = (__m128i)_mm256_cvtneps_pbh(w);
                w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(wb), 16));
                _mm256_storeu_ps(e + j, w);
                sv = _mm256_add_ps(sv, w);
            }
            lsum = hsum8(sv);
            float *dst = part + (((size_t)(t - w0) * A->Hq + h) * nc + c) * (2 + Dv);
            dst[0] = m;
            dst[1] = lsum;
            __m512bh eb[CH / 32 * 2]; /* the weights as bf16 pairs (e_2i, e_2i+1) */
            for (int j = 0; j < CH; j += 32)
                eb[j / 32] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(e + j + 16), _mm512_loadu_ps(e + j));
            const uint32_t *ew = (const uint32_t *)eb;
            for (int x = 0; x < Dv; x += 64) {
                if (Dv - x >= 64) pv_blocks(vi, Dv, x, ew, n, dst + 2 + x, 2);
                else pv_blocks(vi, Dv, x, ew, n, dst + 2 + x, 1);
            }
        }
    }
}

AVX2 static float exp_neg1(float x) {
    float b[8];
    _mm256_storeu_ps(b, exp_neg(_mm256_set1_ps(x)));
    return b[0];
}

/* the output row of (row t, head h) at position pos from its partials (chunks in order) */
AVX2 static void combine(const attn_t *A, int t, int h, int pos, int w0, int nc,
                         const float *part) {
    const int Dv = A->Dv, last = pos / CH, c0 = first_key(A, pos) / CH;
    const float *pr = part + ((size_t)(t - w0) * A->Hq + h) * nc * (2 + Dv);
    float M = -INFINITY;
    for (int c = c0; c <= last; c++) M = pr[c * (2 + Dv)] > M ? pr[c * (2 + Dv)] : M;
    float L = 0.f;
    if (A->sinks) { /* the sink's term of the denominator: e^(sink - M), M over it too */
        const float s = A->sinks[h];
        M = s > M ? s : M;
        L = exp_neg1(s - M);
    }
    float *out = A->out + ((size_t)t * A->Hq + h) * Dv;
    for (int x = 0; x < Dv; x += 8) _mm256_storeu_ps(out + x, _mm256_setzero_ps());
    for (int c = c0; c <= last; c++) {
        const float *pc = pr + (size_t)c * (2 + Dv);
        const float w = exp_neg1(pc[0] - M);
        L += w * pc[1];
        const __m256 wv = _mm256_set1_ps(w);
        for (int x = 0; x < Dv; x += 8)
            _mm256_storeu_ps(out + x, _mm256_fmadd_ps(wv, _mm256_loadu_ps(pc + 2 + x),
                                                      _mm256_loadu_ps(out + x)));
    }
    const __m256 inv = _mm256_set1_ps(1.f / L);
    for (int x = 0; x < Dv; x += 8) _mm256_storeu_ps(out + x, _mm256_mul_ps(_mm256_loadu_ps(out + x), inv));
}

/* every query row of `segs` (pieces over rows 0..T-1, in row order); returns 0 or -1 (memory) */
AVX2 static int attend_kv(const attn_t *A, const piece_t *segs, int S, int T, int nthreads,
                          const int kv, const int bf) {
    int failed = 0;
    piece_t *pc = (piece_t *)malloc(sizeof(piece_t) * (size_t)(S + WINDOW));
    if (!pc) return -1;
    for (int w0 = 0, s = 0; w0 < T && !failed; w0 += WINDOW) {
        const int w1 = w0 + WINDOW < T ? w0 + WINDOW : T;
        int n = 0, nc = 1;
        int64_t items = 0;
        for (; s < S && segs[s].t1 <= w0; s++) {}
        for (int i = s; i < S && segs[i].t0 < w1; i++) { /* the window's part of each segment */
            piece_t q = segs[i];
            const int a = q.t0 > w0 ? q.t0 : w0, b = q.t1 < w1 ? q.t1 : w1;
            q.pos0 += a - q.t0;
            q.t0 = a;
            q.t1 = b;
            q.first = items;
            q.c0 = first_key(A, q.pos0) / CH; /* the rows' first keys grow with them */
            const int chunks = (q.pos0 + (b - a - 1)) / CH + 1;
            nc = chunks > nc ? chunks : nc;
            items += (int64_t)(chunks - q.c0) * A->Hkv;
            pc[n++] = q;
        }
        float *part = (float *)malloc(sizeof(float) * (size_t)(w1 - w0) * A->Hq * nc * (2 + A->Dv));
        if (!part) { failed = 1; break; }
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
        {
            float *kc = (float *)calloc((size_t)CH * (A->D + A->Dv) + CH, sizeof(float));
            failed |= !kc;
            /* NOTE: every thread reaches both worksharing loops, even one without scratch */
            /* NOTE: static: a thread's items are consecutive, so the next one is its own to
             * prefetch; the items of a chunk's KV heads come together */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++) {
                int i = 0;
                while (i + 1 < n && pc[i + 1].first <= it) i++;
                const int64_t k = it - pc[i].first;
                if (it + 1 < items) {
                    const int j = i + 1 < n && pc[i + 1].first <= it + 1 ? i + 1 : i;
                    const int64_t k1 = it + 1 - pc[j].first;
                    prefetch_item(A, &pc[j], (int)(k1 % A->Hkv), pc[j].c0 + (int)(k1 / A->Hkv));
                }
                const int c = pc[i].c0 + (int)(k / A->Hkv);
                if (kc && bf)
                    chunk_item_bf16(A, &pc[i], (int)(k % A->Hkv), c, w0, nc, part,
                                    (uint16_t *)kc, kc + (size_t)CH * (A->D + A->Dv));
                else if (kc)
                    chunk_item(A, &pc[i], (int)(k % A->Hkv), c, w0, nc, part, kc,
                               kc + (size_t)CH * A->D, kc + (size_t)CH * (A->D + A->Dv), kv);
            }
            if (kc && !failed) {
#pragma omp for schedule(static)
                for (int x = 0; x < (w1 - w0) * A->Hq; x++) {
                    const int t = w0 + x / A->Hq;
                    int i = 0;
                    while (i + 1 < n && pc[i + 1].t0 <= t) i++;
                    combine(A, t, x % A->Hq, pc[i].pos0 + (t - pc[i].t0), w0, nc, part);
                }
            }
            free(kc);
        }
        free(part);
    }
    free(pc);
    return failed ? -1 : 0;
}

AVX2 static int attend_f32(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_F32, 0);
}
AVX2 static int attend_bf16(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_BF16, 0);
}
AVX2 static int attend_f16(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_F16, 0);
}
AVX2 static int attend_f8(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_F8, 0);
}
AVX2 static int attend_f8e5(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_F8E5, 0);
}

AVX2 static int attend_bf16_dots(const attn_t *A, const piece_t *s, int S, int T, int th) {
    return attend_kv(A, s, S, T, th, KV_BF16, 1);
}

#include "attention_wide.c"

/* NOTE: windows and sinks take the fp32 path: they were written on an AVX2-only machine, where
 * the bf16 path cannot run, so it has none (untested code is not shipped) */
static int bf16_dots_here(const attn_t *A) {
    __builtin_cpu_init();
    return bf16_dots && A->window == 0 && !A->sinks && A->kv == KV_BF16 && A->D % 32 == 0 && A->Dv % 32 == 0 &&
           A->D <= 256 && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bf16");
}

static int attend(const attn_t *A, const piece_t *s, int S, int T, int th) {
    if (A->Dv > 256 || (wide_mode & 1)) return attend_wide(A, s, S, T, th);
    if (bf16_dots_here(A)) return attend_bf16_dots(A, s, S, T, th);
    return A->kv == KV_BF16 ? attend_bf16(A, s, S, T, th)
         : A->kv == KV_F16  ? attend_f16(A, s, S, T, th)
         : A->kv == KV_F8   ? attend_f8(A, s, S, T, th)
         : A->kv == KV_F8E5 ? attend_f8e5(A, s, S, T, th)
                            : attend_f32(A, s, S, T, th);
}

/* q [T, Hq, D], out [T, Hq, Dv] row-major fp32; row t sits at position pos0 + t (it attends
 * keys 0..pos0 + t); pages: the sequence's page table; kv: the caches' dtype. D and Dv
 * multiples of 8 (checked by the caller); Dv > 256 takes attention_wide.c's path. v_row, v_head: the value cache's strides
 * in elements (a token, a KV head), so the values may be the keys' leading dims. Returns 0, or
 * -1 when scratch memory could not be had. */
int attention_rows_v(const float *q, int T, int Hq, int D, int Dv, const void *k_cache,
                     const void *v_cache, int page_size, int Hkv, const int64_t *pages, int pos0,
                     float scale, float *out, int nthreads, int kv, int window,
                     const float *sinks, int64_t v_row, int64_t v_head) {
    const attn_t A = {q, (int64_t)Hq * D, Hq, Hkv, D, Dv, page_size, (const uint8_t *)k_cache,
                      (const uint8_t *)v_cache, scale, out, kv, window, sinks, v_row, v_head};
    const piece_t seg = {0, T, pos0, pages, 0, 0};
    return T > 0 ? attend(&A, &seg, 1, T, nthreads) : 0;
}

/* the above with dense value rows */
int attention_rows_ex(const float *q, int T, int Hq, int D, int Dv, const void *k_cache,
                      const void *v_cache, int page_size, int Hkv, const int64_t *pages, int pos0,
                      float scale, float *out, int nthreads, int kv, int window,
                      const float *sinks) {
    return attention_rows_v(q, T, Hq, D, Dv, k_cache, v_cache, page_size, Hkv, pages, pos0,
                            scale, out, nthreads, kv, window, sinks, (int64_t)Hkv * Dv, Dv);
}

/* the above without a window or sinks */
int attention_rows(const float *q, int T, int Hq, int D, int Dv, const void *k_cache,
                   const void *v_cache, int page_size, int Hkv, const int64_t *pages, int pos0,
                   float scale, float *out, int nthreads, int kv) {
    return attention_rows_ex(q, T, Hq, D, Dv, k_cache, v_cache, page_size, Hkv, pages, pos0,
                             scale, out, nthreads, kv, 0, NULL);
}

/* fp32 -> bf16 / fp16 bits as torch's .to() rounds them (to nearest even; NaN stays NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

AVX2 static inline uint16_t to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

/* to_f16 without F16C: to nearest even, overflow to inf, subnormals, NaN quieted keeping its
 * top payload bits (as vcvtps2ph) */
static uint16_t to_f16_s(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7E00 | (uint16_t)((u >> 13) & 0x3FF);
    if (u >= 0x477FF000u) return sign | 0x7C00; /* 65520 and up round to inf */
    if (u >= 0x38800000u) /* a normal half: round at bit 13, rebias 127 -> 15 */
        return sign | (uint16_t)((u + 0xFFFu + ((u >> 13) & 1u) - 0x38000000u) >> 13);
    float a; /* a subnormal half (or 0): in units of 2^-24, exact before the rounding */
    __builtin_memcpy(&a, &u, 4);
    return sign | (uint16_t)__builtin_rintf(a * 16777216.f);
}

/* fp32 -> float8_e4m3fn bits as torch's .to() gives them on the CPU: to nearest even,
 * saturating at +-448 (infinities included: E4M3 "fn" has none), NaN -> 0x7F with the sign */
static inline uint8_t to_f8(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7F;
    if (u >= 0x43E00000u) return sign | 0x7E; /* 448 and up (what would round to 480 too) */
    if (u >= 0x3C800000u) /* a normal E4M3 (2^-6 and up): round at bit 20, rebias 127 -> 7 */
        return sign | (uint8_t)((u + 0x7FFFFu + ((u >> 20) & 1u) - (120u << 23)) >> 20);
    float a; /* a subnormal (or 0): in units of 2^-9, exact before the rounding */
    __builtin_memcpy(&a, &u, 4);
    return sign | (uint8_t)__builtin_rintf(a * 512.f);
}

/* fp32 -> float8_e5m2 bits as torch's .to() gives them: to nearest even at fp16's exponent
 * range (bias 15) and 2 mantissa bits, overflowing to infinity (61440 and up: E5M2 has
 * infinities, torch does not saturate it), NaN -> 0x7F with the sign */
static inline uint8_t to_f8e5(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return sign | 0x7F;
    if (u >= 0x47700000u) return sign | 0x7C;
    if (u >= 0x38800000u) /* a normal E5M2 (2^-14 and up): round at bit 21, rebias 127 -> 15 */
        return sign | (uint8_t)((u + 0xFFFFFu + ((u >> 21) & 1u) - 0x38000000u) >> 21);
    float a; /* a subnormal (or 0): in units of 2^-16, exact before the rounding */
    __builtin_memcpy(&a, &u, 4);
    return sign | (uint8_t)__builtin_rintf(a * 65536.f);
}

/* `n` fp32 values into the cache's dtype at dst */
AVX2 static void store_row(uint8_t *dst, const float *src, int n, const int kv) {
    if (kv == KV_F32) {
        __builtin_memcpy(dst, src, (size_t)n * 4);
        return;
    }
    if (kv >= KV_F8) {
        for (int i = 0; i < n; i++) dst[i] = kv == KV_F8 ? to_f8(src[i]) : to_f8e5(src[i]);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int i = 0; i < n; i++) h[i] = kv == KV_BF16 ? to_bf16(src[i]) : to_f16(src[i]);
}

/* the same without AVX2 / F16C (the wide path's generic C runs on any x86-64) */
static void store_row_s(uint8_t *dst, const float *src, int n, const int kv) {
    if (kv == KV_F32) {
        __builtin_memcpy(dst, src, (size_t)n * 4);
        return;
    }
    if (kv >= KV_F8) {
        for (int i = 0; i < n; i++) dst[i] = kv == KV_F8 ? to_f8(src[i]) : to_f8e5(src[i]);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int i = 0; i < n; i++) h[i] = kv == KV_BF16 ? to_bf16(src[i]) : to_f16_s(src[i]);
}

/* A step's attention of a Llama-type layer after its fused q/k/v projection and RoPE, in one
 * call: the new keys and values go into the paged cache, then every (row, head) attends as
 * attention_rows does (the same `attend`, so the same bits). Segments are the step's sequences,
 * each up to a few rows (decode, verify):
 *   qk [T, Hq + Hkv, D] fp32: the roped queries then keys of each token (dense rows);
 *   v: token t's values at v + t * v_stride (fp32, Hkv * Dv), or NULL: the value cache is
 *      the keys' leading dims (v_row, v_head: its strides in elements), written with them;
 *   slots [T]: flat cache row (page * page_size + offset) of each token;
 *   cu [S + 1], lens [S]: segment s is tokens cu[s]..cu[s+1]-1 at positions lens[s] + i;
 *   page_table [S, P] (row stride P); out [T, Hq, Dv].
 * Returns 0, -1 without scratch memory, -2 when a position lies outside its pages. */
int write_attend_rows_v(const float *qk, const float *v, int64_t v_stride, int T, int Hq,
                        int Hkv, int D, int Dv, void *k_cache, void *v_cache, int page_size,
                        const int64_t *slots, int S, const int64_t *cu, const int64_t *lens,
                        const int64_t *page_table, int P, float scale, float *out, int nthreads,
                        int kv, int window, const float *sinks, int64_t v_row, int64_t v_head) {
    const size_t es = kv_bytes(kv);
    const size_t row_k = (size_t)Hkv * D * es;
    for (int s = 0; s < S; s++)
        if (lens[s] + cu[s + 1] - cu[s] > (int64_t)P * page_size) return -2;
    void (*store)(uint8_t *, const float *, int, int) = wide_generic() ? store_row_s : store_row;
    for (int t = 0; t < T; t++) {
        store((uint8_t *)k_cache + (size_t)slots[t] * row_k,
              qk + ((size_t)t * (Hq + Hkv) + Hq) * D, Hkv * D, kv);
        for (int g = 0; v && g < Hkv; g++)
            store((uint8_t *)v_cache + ((size_t)slots[t] * v_row + (size_t)g * v_head) * es,
                  v + (size_t)t * v_stride + (size_t)g * Dv, Dv, kv);
    }
    piece_t *seg = (piece_t *)malloc(sizeof(piece_t) * (size_t)(S > 0 ? S : 1));
    if (!seg) return -1;
    int n = 0;
    for (int s = 0; s < S; s++)
        if (cu[s + 1] > cu[s])
            seg[n++] = (piece_t){(int)cu[s], (int)cu[s + 1], (int)lens[s], page_table + (size_t)s * P, 0, 0};
    const attn_t A = {qk, (int64_t)(Hq + Hkv) * D, Hq, Hkv, D, Dv, page_size,
                      (const uint8_t *)k_cache, (const uint8_t *)v_cache, scale, out, kv, window,
                      sinks, v_row, v_head};
    const int rc = T > 0 ? attend(&A, seg, n, T, nthreads) : 0;
    free(seg);
    return rc;
}

/* the above with dense value rows (layer_rows.c calls it by address) */
int write_attend_rows_ex(const float *qk, const float *v, int64_t v_stride, int T, int Hq,
                         int Hkv, int D, int Dv, void *k_cache, void *v_cache, int page_size,
                         const int64_t *slots, int S, const int64_t *cu, const int64_t *lens,
                         const int64_t *page_table, int P, float scale, float *out, int nthreads,
                         int kv, int window, const float *sinks) {
    return write_attend_rows_v(qk, v, v_stride, T, Hq, Hkv, D, Dv, k_cache, v_cache, page_size,
                               slots, S, cu, lens, page_table, P, scale, out, nthreads, kv, window,
                               sinks, (int64_t)Hkv * Dv, Dv);
}

/* the above without a window or sinks (layer_rows.c calls it by address) */
int write_attend_rows(const float *qk, const float *v, int64_t v_stride, int T, int Hq, int Hkv,
                      int D, int Dv, void *k_cache, void *v_cache, int page_size,
                      const int64_t *slots, int S, const int64_t *cu, const int64_t *lens,
                      const int64_t *page_table, int P, float scale, float *out, int nthreads,
                      int kv) {
    return write_attend_rows_ex(qk, v, v_stride, T, Hq, Hkv, D, Dv, k_cache, v_cache, page_size,
                                slots, S, cu, lens, page_table, P, scale, out, nthreads, kv, 0,
                                NULL);
}
