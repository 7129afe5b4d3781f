/* Paged causal attention for the few query rows of one sequence (a decode row, a verify
 * segment), one (row, head) at a time:
 *     out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g]) v[j, g],  j = 0..pos[t], g = h / rep
 * Each (row, head) is computed by the same instruction sequence from its own query and the keys
 * up to its position only, whatever the other rows and the thread count: a row's output is
 * bit-identical in a 1-row decode and in a K + 1-row verify step (batch invariance; one SDPA
 * over the segment sums in another order). Keys and values are read in place from the paged
 * cache [num_pages, page_size, Hkv, D], fp32, bf16 or fp16 (`kv`: KV_F32 / KV_BF16 / KV_F16;
 * each value widened exactly to fp32, all arithmetic in fp32). Built at run time by
 * attention_rows.py; AVX2 + FMA + F16C required (checked there), -ffp-contract=off.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define AVX2 __attribute__((target("avx2,fma,f16c")))

enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };

/* 8 cache values at p as fp32 (exact: bf16 and fp16 widen without rounding) */
AVX2 static inline __m256 load8(const uint8_t *p, const int kv) {
    if (kv == KV_F32) return _mm256_loadu_ps((const float *)p);
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

/* one (row, head): q [D], scores scratch [pos + 1], out [Dv] */
AVX2 static inline __attribute__((always_inline)) void one(
    const float *q, int D, int Dv, const uint8_t *k_cache, const uint8_t *v_cache, int page_size,
    int Hkv, int g, const int64_t *pages, int pos, float scale, float *s, float *out,
    const int kv) {
    const size_t es = kv == KV_F32 ? 4 : 2;
    const size_t row_k = (size_t)Hkv * D * es, row_v = (size_t)Hkv * Dv * es;
    float m = -INFINITY;
    /* scores, 4 keys at a time for 4 independent fma chains; each key's own arithmetic is the
     * same in a group of 4 or alone */
    int j = 0;
    for (; j + 4 <= pos + 1; j += 4) {
        const uint8_t *k[4];
        __m256 acc[4];
        for (int u = 0; u < 4; u++) {
            const int jj = j + u;
            const size_t slot = (size_t)pages[jj / page_size] * page_size + jj % page_size;
            k[u] = k_cache + slot * row_k + (size_t)g * D * es;
            acc[u] = _mm256_setzero_ps();
        }
        for (int d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            for (int u = 0; u < 4; u++)
                acc[u] = _mm256_fmadd_ps(qv, load8(k[u] + d * es, kv), acc[u]);
        }
        for (int u = 0; u < 4; u++) {
            s[j + u] = hsum8(acc[u]) * scale;
            m = s[j + u] > m ? s[j + u] : m;
        }
    }
    for (; j <= pos; j++) {
        const size_t slot = (size_t)pages[j / page_size] * page_size + j % page_size;
        const uint8_t *k = k_cache + slot * row_k + (size_t)g * D * es;
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d * es, kv), acc);
        s[j] = hsum8(acc) * scale;
        m = s[j] > m ? s[j] : m;
    }
    /* the weights, 8 at a time; the tail as a full vector padded with m (e^0), its pad lanes
     * masked out of the sum */
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= pos + 1; j += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sv = _mm256_add_ps(sv, e);
    }
    if (j <= pos) {
        float tail[8];
        const int left = pos + 1 - j;
        for (int i = 0; i < 8; i++) tail[i] = i < left ? s[j + i] : m;
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane));
        const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_loadu_ps(tail), mv)), keep);
        _mm256_storeu_ps(tail, e);
        for (int i = 0; i < left; i++) s[j + i] = tail[i];
        sv = _mm256_add_ps(sv, e);
    }
    const float sum = hsum8(sv);
    /* Dv <= 256: the output row stays in up to 32 registers' worth of stack (no aliasing) */
    __m256 o[32];
    const int nv = Dv / 8;
    for (int c = 0; c < nv; c++) o[c] = _mm256_setzero_ps();
    for (j = 0; j <= pos; j++) {
        const size_t slot = (size_t)pages[j / page_size] * page_size + j % page_size;
        const uint8_t *v = v_cache + slot * row_v + (size_t)g * Dv * es;
        const __m256 p = _mm256_set1_ps(s[j]);
        for (int c = 0; c < nv; c++)
            o[c] = _mm256_fmadd_ps(p, load8(v + 8 * c * es, kv), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int c = 0; c < nv; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(o[c], inv));
}

/* one (row, head) per cache dtype: each compiles to its own loop */
AVX2 static void one_f32(const float *q, int D, int Dv, const uint8_t *k, const uint8_t *v,
                         int ps, int Hkv, int g, const int64_t *pages, int pos, float scale,
                         float *s, float *out) {
    one(q, D, Dv, k, v, ps, Hkv, g, pages, pos, scale, s, out, KV_F32);
}
AVX2 static void one_bf16(const float *q, int D, int Dv, const uint8_t *k, const uint8_t *v,
                          int ps, int Hkv, int g, const int64_t *pages, int pos, float scale,
                          float *s, float *out) {
    one(q, D, Dv, k, v, ps, Hkv, g, pages, pos, scale, s, out, KV_BF16);
}
AVX2 static void one_f16(const float *q, int D, int Dv, const uint8_t *k, const uint8_t *v,
                         int ps, int Hkv, int g, const int64_t *pages, int pos, float scale,
                         float *s, float *out) {
    one(q, D, Dv, k, v, ps, Hkv, g, pages, pos, scale, s, out, KV_F16);
}

/* q [T, Hq, D], out [T, Hq, Dv] row-major fp32; row t sits at position pos0 + t (it attends
 * keys 0..pos0 + t); pages: the sequence's page table; kv: the caches' dtype. D and Dv
 * multiples of 8, Dv <= 256 (checked by the caller). Returns 0, or -1 when scratch memory
 * could not be had. */
int attention_rows(const float *q, int T, int Hq, int D, int Dv, const void *k_cache,
                   const void *v_cache, int page_size, int Hkv, const int64_t *pages, int pos0,
                   float scale, float *out, int nthreads, int kv) {
    void (*fn)(const float *, int, int, const uint8_t *, const uint8_t *, int, int, int,
               const int64_t *, int, float, float *, float *) =
        kv == KV_BF16 ? one_bf16 : kv == KV_F16 ? one_f16 : one_f32;
    const int maxpos = pos0 + T - 1;
    const int rep = Hq / Hkv, items = T * Hq;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *s = (float *)malloc(sizeof(float) * ((size_t)maxpos + 1));
        failed |= !s;
        /* NOTE: every thread reaches the worksharing loop, even one without scratch */
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int t = it / Hq, h = it % Hq;
            if (s)
                fn(q + ((size_t)t * Hq + h) * D, D, Dv, (const uint8_t *)k_cache,
                   (const uint8_t *)v_cache, page_size, Hkv, h / rep, pages, pos0 + t, scale, s,
                   out + ((size_t)t * Hq + h) * Dv);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* fp32 -> bf16 / fp16 bits as torch's .to() rounds them (to nearest even; NaN stays NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

AVX2 static inline uint16_t to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

/* `n` fp32 values into the cache's dtype at dst */
AVX2 static void store_row(uint8_t *dst, const float *src, int n, const int kv) {
    if (kv == KV_F32) {
        __builtin_memcpy(dst, src, (size_t)n * 4);
        return;
    }
    uint16_t *h = (uint16_t *)dst;
    for (int i = 0; i < n; i++) h[i] = kv == KV_BF16 ? to_bf16(src[i]) : to_f16(src[i]);
}

/* A step's attention of a Llama-type layer after its fused q/k/v projection and RoPE, in one
 * call: the new keys and values go into the paged cache, then every (row, head) attends as
 * attention_rows does (the same `one`, so the same bits). Segments are the step's sequences,
 * each up to a few rows (decode, verify):
 *   qk [T, Hq + Hkv, D] fp32: the roped queries then keys of each token (dense rows);
 *   v: token t's values at v + t * v_stride (fp32, Hkv * Dv);
 *   slots [T]: flat cache row (page * page_size + offset) of each token;
 *   cu [S + 1], lens [S]: segment s is tokens cu[s]..cu[s+1]-1 at positions lens[s] + i;
 *   page_table [S, P] (row stride P); out [T, Hq, Dv].
 * Returns 0, -1 without scratch memory, -2 when a position lies outside its pages. */
int write_attend_rows(const float *qk, const float *v, int64_t v_stride, int T, int Hq, int Hkv,
                      int D, int Dv, void *k_cache, void *v_cache, int page_size,
                      const int64_t *slots, int S, const int64_t *cu, const int64_t *lens,
                      const int64_t *page_table, int P, float scale, float *out, int nthreads,
                      int kv) {
    const size_t es = kv == KV_F32 ? 4 : 2;
    const size_t row_k = (size_t)Hkv * D * es, row_v = (size_t)Hkv * Dv * es;
    int maxpos = 0;
    for (int s = 0; s < S; s++) {
        const int last = (int)(lens[s] + cu[s + 1] - cu[s]) - 1;
        if (last >= P * page_size) return -2;
        maxpos = last > maxpos ? last : maxpos;
    }
    for (int t = 0; t < T; t++) {
        store_row((uint8_t *)k_cache + (size_t)slots[t] * row_k,
                  qk + ((size_t)t * (Hq + Hkv) + Hq) * D, Hkv * D, kv);
        store_row((uint8_t *)v_cache + (size_t)slots[t] * row_v, v + (size_t)t * v_stride,
                  Hkv * Dv, kv);
    }
    void (*fn)(const float *, int, int, const uint8_t *, const uint8_t *, int, int, int,
               const int64_t *, int, float, float *, float *) =
        kv == KV_BF16 ? one_bf16 : kv == KV_F16 ? one_f16 : one_f32;
    int *seg = (int *)malloc(sizeof(int) * (size_t)(T > 0 ? T : 1));
    if (!seg) return -1;
    for (int s = 0; s < S; s++)
        for (int64_t t = cu[s]; t < cu[s + 1]; t++) seg[t] = s;
    const int rep = Hq / Hkv, items = T * Hq;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *sc = (float *)malloc(sizeof(float) * ((size_t)maxpos + 1));
        failed |= !sc;
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int t = it / Hq, h = it % Hq, s = seg[t];
            if (sc)
                fn(qk + ((size_t)t * (Hq + Hkv) + h) * D, D, Dv, (const uint8_t *)k_cache,
                   (const uint8_t *)v_cache, page_size, Hkv, h / rep, page_table + (size_t)s * P,
                   (int)(lens[s] + t - cu[s]), scale, sc, out + ((size_t)t * Hq + h) * Dv);
        }
        free(sc);
    }
    free(seg);
    return failed ? -1 : 0;
}
