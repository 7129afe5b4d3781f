/* y[r, n] = x[r, :] . w[n, :] (+ b[n]) over fp32 weights, each output computed on its own by
 * one fixed sequence of fp32 operations: sixteen lanes (lane j takes k = j, j + 16, ...; a
 * fused multiply-add each), lanes j and j + 8 added, a fixed tree over those eight, then the
 * bias. So an output's bits do not depend on how many rows the call has, which rows sit beside
 * it, or the thread count (a BLAS picks GEMV / GEMM / K-split by shape: a decode row and the
 * same row in a verify step then differ in the last bits, which the fast kernels' 8-bit
 * activation rounding downstream can turn into a different token). The AVX-512 path (one
 * register per accumulator), the AVX2 path (two: lanes 0-7 and 8-15) and the generic C (fmaf
 * per lane: the same roundings) give the same bits. Built by linear_rows.py.
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 16

static float finish(const float *a) { /* lanes j + 8 onto j, then the eight in a fixed tree */
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = a[j] + a[j + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

/* rows r0 .. r0 + rg, outputs n0 .. n0 + og */
static void tile_generic(const float *x, int64_t K, const float *w, const float *b, float *y,
                         int64_t N, int64_t r0, int rg, int64_t n0, int og) {
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float *xr = x + (r0 + r) * K, *wr = w + (n0 + o) * K;
            float acc[LANES] = {0};
            int64_t k = 0;
            for (; k + LANES <= K; k += LANES)
                for (int j = 0; j < LANES; j++) acc[j] = fmaf(xr[k + j], wr[k + j], acc[j]);
            if (k < K) /* the masked tail: lanes past K add 0 * 0, as the SIMD paths do */
                for (int j = 0; j < LANES; j++)
                    acc[j] = k + j < K ? fmaf(xr[k + j], wr[k + j], acc[j]) : fmaf(0.f, 0.f, acc[j]);
            const float s = finish(acc);
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma"))) static inline
#define AVX512_FN __attribute__((target("avx2,fma,avx512f"))) static inline

AVX2_FN float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* (t0+t4)+(t2+t6), (t1+t5)+(t3+t7) */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

AVX2_FN __m256i tail_mask(int64_t left) { /* lanes < left */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#define RG2 2
#define OG2 2
AVX2_FN __attribute__((always_inline)) void tile_avx2(const float *x, int64_t K, const float *w,
                                                       const float *b, float *y, int64_t N,
                                                       int64_t r0, const int rg, int64_t n0,
                                                       const int og) {
    __m256 lo[RG2][OG2], hi[RG2][OG2];
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) lo[r][o] = hi[r][o] = _mm256_setzero_ps();
    const float *xr = x + r0 * K, *wr = w + n0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m256 wl[OG2], wh[OG2];
        for (int o = 0; o < og; o++) {
            wl[o] = _mm256_loadu_ps(wr + o * K + k);
            wh[o] = _mm256_loadu_ps(wr + o * K + k + 8);
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
                lo[r][o] = _mm256_fmadd_ps(xl, _mm256_maskload_ps(wr + o * K + k, ml), lo[r][o]);
                hi[r][o] = _mm256_fmadd_ps(xh, _mm256_maskload_ps(wr + o * K + k + 8, mh),
                                           hi[r][o]);
            }
        }
    }
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float s = hsum8(_mm256_add_ps(lo[r][o], hi[r][o]));
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

#define RG5 4
#define OG5 4
AVX512_FN __attribute__((always_inline)) void tile_avx512(const float *x, int64_t K,
                                                           const float *w, const float *b,
                                                           float *y, int64_t N, int64_t r0,
                                                           const int rg, int64_t n0,
                                                           const int og) {
    __m512 acc[RG5][OG5];
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) acc[r][o] = _mm512_setzero_ps();
    const float *xr = x + r0 * K, *wr = w + n0 * K;
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        __m512 wv[OG5];
        for (int o = 0; o < og; o++) wv[o] = _mm512_loadu_ps(wr + o * K + k);
        for (int r = 0; r < rg; r++) {
            const __m512 xv = _mm512_loadu_ps(xr + r * K + k);
            for (int o = 0; o < og; o++) acc[r][o] = _mm512_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        for (int r = 0; r < rg; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, xr + r * K + k);
            for (int o = 0; o < og; o++)
                acc[r][o] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, wr + o * K + k),
                                            acc[r][o]);
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
#define TILE_CASES(FN, R, O)                                                                   \
    switch (rg * 8 + og) {                                                                     \
    case 1 * 8 + 1: FN(x, K, w, b, y, N, r0, 1, n0, 1); break;                                 \
    case 1 * 8 + 2: FN(x, K, w, b, y, N, r0, 1, n0, 2); break;                                 \
    case 2 * 8 + 1: FN(x, K, w, b, y, N, r0, 2, n0, 1); break;                                 \
    case 2 * 8 + 2: FN(x, K, w, b, y, N, r0, 2, n0, 2); break;                                 \
    default: if (R > 2) switch (rg * 8 + og) {                                                 \
        case 1 * 8 + 3: FN(x, K, w, b, y, N, r0, 1, n0, 3 < O ? 3 : O); break;                \
        case 1 * 8 + 4: FN(x, K, w, b, y, N, r0, 1, n0, 4 < O ? 4 : O); break;                \
        case 2 * 8 + 3: FN(x, K, w, b, y, N, r0, 2, n0, 3 < O ? 3 : O); break;                \
        case 2 * 8 + 4: FN(x, K, w, b, y, N, r0, 2, n0, 4 < O ? 4 : O); break;                \
        case 3 * 8 + 1: FN(x, K, w, b, y, N, r0, 3 < R ? 3 : R, n0, 1); break;                \
        case 3 * 8 + 2: FN(x, K, w, b, y, N, r0, 3 < R ? 3 : R, n0, 2); break;                \
        case 3 * 8 + 3: FN(x, K, w, b, y, N, r0, 3 < R ? 3 : R, n0, 3 < O ? 3 : O); break;    \
        case 3 * 8 + 4: FN(x, K, w, b, y, N, r0, 3 < R ? 3 : R, n0, 4 < O ? 4 : O); break;    \
        case 4 * 8 + 1: FN(x, K, w, b, y, N, r0, 4 < R ? 4 : R, n0, 1); break;                \
        case 4 * 8 + 2: FN(x, K, w, b, y, N, r0, 4 < R ? 4 : R, n0, 2); break;                \
        case 4 * 8 + 3: FN(x, K, w, b, y, N, r0, 4 < R ? 4 : R, n0, 3 < O ? 3 : O); break;    \
        default: FN(x, K, w, b, y, N, r0, 4 < R ? 4 : R, n0, 4 < O ? 4 : O); break;          \
        }                                                                                      \
    }

__attribute__((target("avx2,fma"))) static void tile_avx2_any(const float *x, int64_t K,
                                                              const float *w, const float *b,
                                                              float *y, int64_t N, int64_t r0,
                                                              int rg, int64_t n0, int og) {
    TILE_CASES(tile_avx2, RG2, OG2)
}

__attribute__((target("avx2,fma,avx512f"))) static void tile_avx512_any(
    const float *x, int64_t K, const float *w, const float *b, float *y, int64_t N, int64_t r0,
    int rg, int64_t n0, int og) {
    TILE_CASES(tile_avx512, RG5, OG5)
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

/* x [R, K], w [N, K], b [N] or NULL, y [R, N]; rows in blocks of 64 so that a block's inputs
 * stay in cache while the weights stream once per block; outputs split across threads. */
void linear_rows(const float *x, int64_t R, int64_t K, const float *w, int64_t N,
                 const float *b, float *y, int threads) {
    int isa = 0;
#if defined(__x86_64__)
    if (max_isa >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        isa = max_isa >= 2 && __builtin_cpu_supports("avx512f") ? 2 : 1;
#endif
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
#if defined(__x86_64__)
                if (isa == 2) {
                    tile_avx512_any(x, K, w, b, y, N, r0, rg, n0, og);
                    continue;
                }
                if (isa == 1) {
                    tile_avx2_any(x, K, w, b, y, N, r0, rg, n0, og);
                    continue;
                }
#endif
                tile_generic(x, K, w, b, y, N, r0, rg, n0, og);
            }
        }
    }
}
