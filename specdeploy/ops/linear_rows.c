/* y[r, n] = x[r, :] . w[n, :] (+ b[n]) over fp32 weights, each output computed on its own by
 * one fixed sequence of fp32 operations: sixteen lanes (lane j takes k = j, j + 16, ...; a
 * fused multiply-add each), lanes j and j + 8 added, a fixed tree over those eight, then the
 * bias. So an output's bits do not depend on how many rows the call has, which rows sit beside
 * it, or the thread count (a BLAS picks GEMV / GEMM / K-split by shape: a decode row and the
 * same row in a verify step then differ in the last bits, which the fast kernels' 8-bit
 * activation rounding downstream can turn into a different token). The AVX-512 path (one
 * register per accumulator), the AVX2 path (two: lanes 0-7 and 8-15) and the generic C (fmaf
 * per lane: the same roundings) give the same bits. Weights are fp32, bf16 (`wt` 1) or fp16
 * (`wt` 2), each 16-bit weight widened to the fp32 it is, exactly, as it is loaded. `moe_rows` runs a MoE
 * layer's routed experts on these tiles in one call. Built by linear_rows.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 16

static float finish(const float *a) { /* lanes j + 8 onto j, then the eight in a fixed tree */
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = a[j] + a[j + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static inline float bf16_f32(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> fp32, exactly (what F16C's vcvtph2ps gives): subnormals, +-inf, NaN kept */
static inline float f16_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13); /* rebias 15 -> 127 */
    else {                                                 /* 0 or m * 2^-24: exact in fp32 */
        const float f = (float)m * 5.9604644775390625e-08f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float half_f32(uint16_t v, int wt) { return wt == 2 ? f16_f32(v) : bf16_f32(v); }

/* weight element i of an fp32 (wt 0), bf16 (wt 1) or fp16 (wt 2) matrix */
static inline float wval(const void *w, int64_t i, int wt) {
    return wt ? half_f32(((const uint16_t *)w)[i], wt) : ((const float *)w)[i];
}

/* the 16 (fewer at a tail: zeros after) 16-bit weights from w[i] widened to fp32, for the tails
 * of the SIMD paths (a full load past the row's end could leave the allocation) */
static inline void half_tail(const void *w, int64_t i, int64_t left, float *buf, int wt) {
    for (int j = 0; j < LANES; j++)
        buf[j] = j < left ? half_f32(((const uint16_t *)w)[i + j], wt) : 0.f;
}

/* rows r0 .. r0 + rg, outputs n0 .. n0 + og */
static void tile_generic(const float *x, int64_t K, const void *w, int wt, const float *b,
                         float *y, int64_t N, int64_t r0, int rg, int64_t n0, int og) {
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float *xr = x + (r0 + r) * K;
            const int64_t wr = (n0 + o) * K;
            float acc[LANES] = {0};
            int64_t k = 0;
            for (; k + LANES <= K; k += LANES)
                for (int j = 0; j < LANES; j++)
                    acc[j] = fmaf(xr[k + j], wval(w, wr + k + j, wt), acc[j]);
            if (k < K) /* the masked tail: lanes past K add 0 * 0, as the SIMD paths do */
                for (int j = 0; j < LANES; j++)
                    acc[j] = k + j < K ? fmaf(xr[k + j], wval(w, wr + k + j, wt), acc[j])
                                       : fmaf(0.f, 0.f, acc[j]);
            const float s = finish(acc);
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma,f16c"))) static inline
#define AVX512_FN __attribute__((target("avx2,fma,f16c,avx512f"))) static inline

AVX2_FN float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* (t0+t4)+(t2+t6), (t1+t5)+(t3+t7) */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

AVX2_FN __m256i tail_mask(int64_t left) { /* lanes < left */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

AVX2_FN __m256 ldw8(const void *w, int64_t i, const int wt) {
    if (!wt) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (wt == 2) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define RG2 2
#define OG2 2
AVX2_FN __attribute__((always_inline)) void tile_avx2(const float *x, int64_t K, const void *w,
                                                       const int wt, const float *b, float *y,
                                                       int64_t N, int64_t r0, const int rg,
                                                       int64_t n0, const int og) {
    __m256 lo[RG2][OG2], hi[RG2][OG2];
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) lo[r][o] = hi[r][o] = _mm256_setzero_ps();
    const float *xr = x + r0 * K;
    const int64_t wr = n0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m256 wl[OG2], wh[OG2];
        for (int o = 0; o < og; o++) {
            wl[o] = ldw8(w, wr + o * K + k, wt);
            wh[o] = ldw8(w, wr + o * K + k + 8, wt);
        }
        for (int r = 0; r < rg; r++) {
            const __m256 xl = _mm256_loadu_ps(xr + r * K + k), xh = _mm256_loadu_ps(xr + r * K + k + 8);
            for (int o = 0; o < og; o++) {
                lo[r][o] = _mm256_fmadd_ps(xl, wl[o], lo[r][o]);
                hi[r][o] = _mm256_fmadd_ps(xh, wh[o], hi[r][o]);
            }
        }
    }
    if (k < K) {
        const __m256i ml = tail_mask(K - k), mh = tail_mask(K - k - 8);
        for (int r = 0; r < rg; r++) {
            const __m256 xl = _mm256_maskload_ps(xr + r * K + k, ml);
            const __m256 xh = _mm256_maskload_ps(xr + r * K + k + 8, mh);
            for (int o = 0; o < og; o++) {
                __m256 wlo, whi;
                if (wt) {
                    float buf[LANES];
                    half_tail(w, wr + o * K + k, K - k, buf, wt);
                    wlo = _mm256_loadu_ps(buf), whi = _mm256_loadu_ps(buf + 8);
                } else {
                    wlo = _mm256_maskload_ps((const float *)w + wr + o * K + k, ml);
                    whi = _mm256_maskload_ps((const float *)w + wr + o * K + k + 8, mh);
                }
                lo[r][o] = _mm256_fmadd_ps(xl, wlo, lo[r][o]);
                hi[r][o] = _mm256_fmadd_ps(xh, whi, hi[r][o]);
            }
        }
    }
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float s = hsum8(_mm256_add_ps(lo[r][o], hi[r][o]));
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

AVX512_FN __m512 ldw16(const void *w, int64_t i, const int wt) {
    if (!wt) return _mm512_loadu_ps((const float *)w + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (wt == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define RG5 4
#define OG5 4
AVX512_FN __attribute__((always_inline)) void tile_avx512(const float *x, int64_t K,
                                                           const void *w, const int wt,
                                                           const float *b, float *y, int64_t N,
                                                           int64_t r0, const int rg, int64_t n0,
                                                           const int og) {
    __m512 acc[RG5][OG5];
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) acc[r][o] = _mm512_setzero_ps();
    const float *xr = x + r0 * K;
    const int64_t wr = n0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m512 wv[OG5];
        for (int o = 0; o < og; o++) wv[o] = ldw16(w, wr + o * K + k, wt);
        for (int r = 0; r < rg; r++) {
            const __m512 xv = _mm512_loadu_ps(xr + r * K + k);
            for (int o = 0; o < og; o++) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        for (int r = 0; r < rg; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xr + r * K + k);
            for (int o = 0; o < og; o++) {
                __m512 wv;
                if (wt) {
                    float buf[LANES];
                    half_tail(w, wr + o * K + k, K - k, buf, wt);
                    wv = _mm512_loadu_ps(buf);
                } else {
                    wv = _mm512_maskz_loadu_ps(m, (const float *)w + wr + o * K + k);
                }
                acc[r][o] = _mm512_fmadd_ps(xv, wv, acc[r][o]);
            }
        }
    }
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const __m512 a = acc[r][o];
            const __m256 h = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
            const float s = hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), h));
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

/* the tile shapes as constants, so the accumulators stay in registers */
#define TILE_CASES(FN, R, O, WT)                                                                   \
    switch (rg * 8 + og) {                                                                     \
    case 1 * 8 + 1: FN(x, K, w, WT, b, y, N, r0, 1, n0, 1); break;                                 \
    case 1 * 8 + 2: FN(x, K, w, WT, b, y, N, r0, 1, n0, 2); break;                                 \
    case 2 * 8 + 1: FN(x, K, w, WT, b, y, N, r0, 2, n0, 1); break;                                 \
    case 2 * 8 + 2: FN(x, K, w, WT, b, y, N, r0, 2, n0, 2); break;                                 \
    default: if (R > 2) switch (rg * 8 + og) {                                                 \
        case 1 * 8 + 3: FN(x, K, w, WT, b, y, N, r0, 1, n0, 3 < O ? 3 : O); break;                \
        case 1 * 8 + 4: FN(x, K, w, WT, b, y, N, r0, 1, n0, 4 < O ? 4 : O); break;                \
        case 2 * 8 + 3: FN(x, K, w, WT, b, y, N, r0, 2, n0, 3 < O ? 3 : O); break;                \
        case 2 * 8 + 4: FN(x, K, w, WT, b, y, N, r0, 2, n0, 4 < O ? 4 : O); break;                \
        case 3 * 8 + 1: FN(x, K, w, WT, b, y, N, r0, 3 < R ? 3 : R, n0, 1); break;                \
        case 3 * 8 + 2: FN(x, K, w, WT, b, y, N, r0, 3 < R ? 3 : R, n0, 2); break;                \
        case 3 * 8 + 3: FN(x, K, w, WT, b, y, N, r0, 3 < R ? 3 : R, n0, 3 < O ? 3 : O); break;    \
        case 3 * 8 + 4: FN(x, K, w, WT, b, y, N, r0, 3 < R ? 3 : R, n0, 4 < O ? 4 : O); break;    \
        case 4 * 8 + 1: FN(x, K, w, WT, b, y, N, r0, 4 < R ? 4 : R, n0, 1); break;                \
        case 4 * 8 + 2: FN(x, K, w, WT, b, y, N, r0, 4 < R ? 4 : R, n0, 2); break;                \
        case 4 * 8 + 3: FN(x, K, w, WT, b, y, N, r0, 4 < R ? 4 : R, n0, 3 < O ? 3 : O); break;    \
        default: FN(x, K, w, WT, b, y, N, r0, 4 < R ? 4 : R, n0, 4 < O ? 4 : O); break;          \
        }                                                                                      \
    }

/* the weight type as a constant too: each tile shape is compiled once per type */
__attribute__((target("avx2,fma,f16c"))) static void tile_avx2_any(const float *x, int64_t K,
                                                                   const void *w, int wt,
                                                                   const float *b, float *y,
                                                                   int64_t N, int64_t r0, int rg,
                                                                   int64_t n0, int og) {
    if (wt == 2) {
        TILE_CASES(tile_avx2, RG2, OG2, 2)
    } else if (wt) {
        TILE_CASES(tile_avx2, RG2, OG2, 1)
    } else {
        TILE_CASES(tile_avx2, RG2, OG2, 0)
    }
}

__attribute__((target("avx2,fma,f16c,avx512f"))) static void tile_avx512_any(
    const float *x, int64_t K, const void *w, int wt, const float *b, float *y, int64_t N,
    int64_t r0, int rg, int64_t n0, int og) {
    if (wt == 2) {
        TILE_CASES(tile_avx512, RG5, OG5, 2)
    } else if (wt) {
        TILE_CASES(tile_avx512, RG5, OG5, 1)
    } else {
        TILE_CASES(tile_avx512, RG5, OG5, 0)
    }
}
#endif

/* the widest path a call may take: 0 generic, 1 AVX2, 2 AVX-512 (tests lower it: the same
 * bits on each) */
static int max_isa = 2;

int linear_rows_max_isa(int level) {
    const int before = max_isa;
    if (level >= 0) max_isa = level;
    return before;
}

static int pick_isa(void) {
    int isa = 0;
#if defined(__x86_64__)
    if (max_isa >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        isa = max_isa >= 2 && __builtin_cpu_supports("avx512f") ? 2 : 1;
#endif
    return isa;
}

static void tile(int isa, const float *x, int64_t K, const void *w, int wt, const float *b,
                 float *y, int64_t N, int64_t r0, int rg, int64_t n0, int og) {
#if defined(__x86_64__)
    if (isa == 2) {
        tile_avx512_any(x, K, w, wt, b, y, N, r0, rg, n0, og);
        return;
    }
    if (isa == 1) {
        tile_avx2_any(x, K, w, wt, b, y, N, r0, rg, n0, og);
        return;
    }
#endif
    (void)isa;
    tile_generic(x, K, w, wt, b, y, N, r0, rg, n0, og);
}

/* x [R, K], w [N, K], b [N] or NULL, y [R, N]; rows in blocks of 64 so that a block's inputs
 * stay in cache while the weights stream once per block; outputs split across threads. */
void linear_rows(const float *x, int64_t R, int64_t K, const float *w, int64_t N,
                 const float *b, float *y, int threads) {
    const int isa = pick_isa();
    const int rgm = isa == 2 ? 4 : 2, ogm = isa == 2 ? 4 : 2;
    const int64_t tiles = (N + ogm - 1) / ogm;
    for (int64_t rb = 0; rb < R; rb += 64) {
        const int64_t re = rb + 64 < R ? rb + 64 : R;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles >= 8)
        for (int64_t p = 0; p < tiles; p++) {
            const int64_t n0 = p * ogm;
            const int og = N - n0 < ogm ? (int)(N - n0) : ogm;
            for (int64_t r0 = rb; r0 < re; r0 += rgm) {
                const int rg = re - r0 < rgm ? (int)(re - r0) : rgm;
                tile(isa, x, K, w, 0, b, y, N, r0, rg, n0, og);
            }
        }
    }
}

/* ---- a MoE layer's routed experts in one call ---- */

typedef void (*silu_mul_fn)(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                            float *out, int threads);

enum { ACT_SWIGLU = 0, ACT_RELU2 = 1, ACT_SWIGLU_OAI = 2 };

/* gpt-oss's clamped SwiGLU (ops/moe_bias.py `clamped_swiglu`) over one row h [2 I] (gate | up):
 * o[j] = (clamp(up, +-limit) + 1) * (g * sigmoid(alpha * g)), g = min(gate, limit); the
 * comparisons keep a NaN as torch's clamp does */
static void swiglu_oai(const float *h, int64_t I, float alpha, float limit, float *o) {
    for (int64_t j = 0; j < I; j++) {
        const float g = h[j] > limit ? limit : h[j];
        float u = h[I + j] > limit ? limit : h[I + j];
        u = u < -limit ? -limit : u;
        o[j] = (u + 1.f) * (g * (1.f / (1.f + expf(-(g * alpha)))));
    }
}

/* outputs n0 .. n1 of rows 0 .. R of x [R, K] through w [N, K] into y [R, N]: linear_rows'
 * tiles (rows in blocks of 64) for one thread's slice */
static void slice_rows(int isa, const float *x, int64_t R, int64_t K, const void *w, int wt,
                       const float *b, int64_t N, float *y, int64_t n0, int64_t n1) {
    const int rgm = isa == 2 ? 4 : 2, ogm = isa == 2 ? 4 : 2;
    for (int64_t rb = 0; rb < R; rb += 64) {
        const int64_t re = rb + 64 < R ? rb + 64 : R;
        for (int64_t o = n0; o < n1; o += ogm) {
            const int og = n1 - o < ogm ? (int)(n1 - o) : ogm;
            for (int64_t r0 = rb; r0 < re; r0 += rgm)
                tile(isa, x, K, w, wt, b, y, N, r0, re - r0 < rgm ? (int)(re - r0) : rgm, o, og);
        }
    }
}

/* this thread's contiguous slice of n outputs, in multiples of 4 */
static void out_slice(int64_t n, int t, int nt, int64_t *n0, int64_t *n1) {
    const int64_t per = ((n + nt - 1) / nt + 3) / 4 * 4;
    *n0 = t * per < n ? t * per : n;
    *n1 = *n0 + per < n ? *n0 + per : n;
}

/* thread t of nt: its slice of the N outputs of every expert's rows start[e] .. start[e + 1] of
 * x [R, K] through that expert's matrix (w: E matrices [N, K], fp32 or bf16) into y [R, N] */
static void experts_slice(int isa, const float *x, int64_t K, const int64_t *start, int64_t E,
                          const void *w, int wt, const float *b, int64_t N, float *y, int t,
                          int nt) {
    int64_t n0, n1;
    out_slice(N, t, nt, &n0, &n1);
    const size_t bytes = (size_t)(N * K) * (wt ? 2 : 4);
    for (int64_t e = 0; e < E && n0 < n1; e++) {
        const int64_t s0 = start[e], n = start[e + 1] - s0;
        if (n)
            slice_rows(isa, x + s0 * K, n, K, (const char *)w + (size_t)e * bytes, wt,
                       b ? b + e * N : NULL, N, y + s0 * N, n0, n1);
    }
}

/* x [T, H] fp32; ids [T, k] int64 in [0, E); wts [T, k] fp32; w_up [E, N_up, H] (swiglu: N_up
 * = 2 I, gate rows first; relu2: N_up = I) and w_down [E, H, I], fp32 (wt 0), bf16 (wt 1) or
 * fp16 (wt 2), contiguous; b_up [E, N_up] / b_down [E, H] fp32 biases or NULL; out [T, H]. The (token,
 * slot) pairs sorted by expert, stably; each expert's rows through its up matrix (+ its bias;
 * each thread a slice of every chosen expert's outputs), the activation (swiglu: `silu_mul`,
 * row_kernels.c's; relu2: max(h, 0)^2; swiglu_oai: gpt-oss's, with alpha and limit), the down
 * matrix (+ its bias); then out[t] = 0 + y_1 * w_1 + ... + y_k * w_k over t's slots in order.
 * Every output is a tile's fixed
 * sequence of operations and each token's sum a fixed order, so a token's output does not
 * depend on the other tokens of the call or the threads. Returns 0; -1 without scratch memory;
 * -3 for an id outside [0, E) or k outside 1 .. 64 (out untouched then). */
int moe_rows(const float *x, int64_t T, int64_t H, const int64_t *ids, const float *wts,
             int64_t k, int64_t E, const void *w_up, int64_t N_up, const void *w_down, int64_t I,
             int wt, int act, silu_mul_fn silu_mul, float *out, int threads, const float *b_up,
             const float *b_down, float alpha, float limit) {
    if (k < 1 || k > 64) return -3;
    const int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -3;
    int64_t *start = (int64_t *)calloc((size_t)E + 2, sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((size_t)(P ? P : 1) * 2 * sizeof(int64_t));
    float *fs = (float *)malloc((size_t)(P * H + P * N_up + P * I + P * H + 1) * sizeof(float));
    if (!start || !order || !fs) {
        free(start), free(order), free(fs);
        return -1;
    }
    int64_t *pos = order + P, *fill = start + 1; /* fill: E + 1 counters, shifted by one */
    float *xg = fs, *hup = xg + P * H, *hact = hup + P * N_up, *ydown = hact + P * I;
    /* a counting sort: fill[e] = start[e + 1] counts to where expert e's pairs begin, then
     * (placing them) runs to where they end, which is where expert e + 1's begin */
    for (int64_t p = 0; p < P; p++) fill[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) fill[e + 1] += fill[e];
    for (int64_t p = 0; p < P; p++) {
        pos[p] = fill[ids[p]]++;
        order[pos[p]] = p;
    }
    const int isa = pick_isa();
#pragma omp parallel num_threads(threads) if (threads > 1 && P * (N_up + I) * H >= (1 << 16))
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++)
            memcpy(xg + i * H, x + (order[i] / k) * H, (size_t)H * sizeof(float));
        experts_slice(isa, xg, H, start, E, w_up, wt, b_up, N_up, hup, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < P; i++) {
            const float *h = hup + i * N_up;
            float *o = hact + i * I;
            if (act == ACT_SWIGLU) {
                silu_mul(h, 1, I, N_up, o, 1);
            } else if (act == ACT_SWIGLU_OAI) {
                swiglu_oai(h, I, alpha, limit, o);
            } else {
                for (int64_t j = 0; j < I; j++) {
                    const float v = h[j] > 0.f ? h[j] : 0.f;
                    o[j] = v * v;
                }
            }
        }
        experts_slice(isa, hact, I, start, E, w_down, wt, b_down, H, ydown, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t r = 0; r < T; r++) {
            float *o = out + r * H;
            for (int64_t j = 0; j < H; j++) o[j] = 0.f;
            for (int64_t j = 0; j < k; j++) {
                const float *y = ydown + pos[r * k + j] * H, w = wts[r * k + j];
                for (int64_t i = 0; i < H; i++) o[i] = o[i] + y[i] * w;
            }
        }
    }
    free(start), free(order), free(fs);
    return 0;
}
