/* y[r, n] = x[r, :] . w[n, :] (+ b[n]) over fp32 weights, each output computed on its own by
 * one fixed sequence of fp32 operations: eight lanes (lane j takes k = j, j + 8, ...; a fused
 * multiply-add each), a fixed tree over the lanes, then the bias. So an output's bits do not
 * depend on how many rows the call has, which rows sit beside it, or the thread count (a BLAS
 * picks GEMV / GEMM / K-split by shape: a decode row and the same row in a verify step then
 * differ in the last bits, which the fast kernels' 8-bit activation rounding downstream can
 * turn into a different token). The AVX2 path and the generic C (fmaf per lane: the same
 * roundings) give the same bits; AVX-512 machines run the AVX2 path. Built by linear_rows.py.
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define ROW_GROUP 4
#define OUT_GROUP 2

static float tree8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* rows r0 .. r0 + rg, outputs n0 .. n0 + og (rg <= ROW_GROUP, og <= OUT_GROUP) */
static void tile_generic(const float *x, int64_t K, const float *w, const float *b, float *y,
                         int64_t N, int64_t r0, int rg, int64_t n0, int og) {
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float *xr = x + (r0 + r) * K, *wr = w + (n0 + o) * K;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int j = 0; j < 8; j++) acc[j] = fmaf(xr[k + j], wr[k + j], acc[j]);
            if (k < K) /* the masked tail: lanes past K add 0 * 0, as the AVX2 path does */
                for (int j = 0; j < 8; j++)
                    acc[j] = k + j < K ? fmaf(xr[k + j], wr[k + j], acc[j]) : fmaf(0.f, 0.f, acc[j]);
            const float s = tree8(acc);
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

#if defined(__x86_64__)
#define AVX2_FN __attribute__((target("avx2,fma"))) static inline

AVX2_FN float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* (a0+a4)+(a2+a6), (a1+a5)+(a3+a7) */
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

AVX2_FN __attribute__((always_inline)) void tile_avx2(const float *x, int64_t K, const float *w,
                                                       const float *b, float *y, int64_t N,
                                                       int64_t r0, const int rg, int64_t n0,
                                                       const int og) {
    __m256 acc[ROW_GROUP][OUT_GROUP];
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) acc[r][o] = _mm256_setzero_ps();
    const float *xr = x + r0 * K, *wr = w + n0 * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[OUT_GROUP];
        for (int o = 0; o < og; o++) wv[o] = _mm256_loadu_ps(wr + o * K + k);
        for (int r = 0; r < rg; r++) {
            const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
            for (int o = 0; o < og; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);
        }
    }
    if (k < K) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(K - k)), lane);
        for (int r = 0; r < rg; r++) {
            const __m256 xv = _mm256_maskload_ps(xr + r * K + k, mask);
            for (int o = 0; o < og; o++)
                acc[r][o] = _mm256_fmadd_ps(xv, _mm256_maskload_ps(wr + o * K + k, mask),
                                            acc[r][o]);
        }
    }
    for (int r = 0; r < rg; r++)
        for (int o = 0; o < og; o++) {
            const float s = hsum8(acc[r][o]);
            y[(r0 + r) * N + n0 + o] = b ? s + b[n0 + o] : s;
        }
}

/* the tile shapes as constants, so the accumulators stay in registers */
__attribute__((target("avx2,fma"))) static void tile_avx2_any(const float *x, int64_t K,
                                                              const float *w, const float *b,
                                                              float *y, int64_t N, int64_t r0,
                                                              int rg, int64_t n0, int og) {
#define TILE_CASE(R, O)                                                                        \
    case R * 8 + O: tile_avx2(x, K, w, b, y, N, r0, R, n0, O); break;
    switch (rg * 8 + og) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(2, 1) TILE_CASE(2, 2)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(4, 1) TILE_CASE(4, 2)
    }
#undef TILE_CASE
}
#endif

/* the widest path a call may take: 0 generic, 1 AVX2 (tests lower it to compare the bits) */
static int max_isa = 1;

int linear_rows_max_isa(int level) {
    const int before = max_isa;
    if (level >= 0) max_isa = level;
    return before;
}

/* x [R, K], w [N, K], b [N] or NULL, y [R, N]; rows in blocks of 64 so that a block's inputs
 * stay in cache while the weights stream once per block; outputs split across threads. */
void linear_rows(const float *x, int64_t R, int64_t K, const float *w, int64_t N,
                 const float *b, float *y, int threads) {
#if defined(__x86_64__)
    const int avx2 = max_isa >= 1 && __builtin_cpu_supports("avx2") &&
                     __builtin_cpu_supports("fma");
#else
    const int avx2 = 0;
#endif
    const int64_t pairs = (N + OUT_GROUP - 1) / OUT_GROUP;
    for (int64_t rb = 0; rb < R; rb += 64) {
        const int64_t re = rb + 64 < R ? rb + 64 : R;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && pairs >= 8)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t n0 = p * OUT_GROUP;
            const int og = N - n0 < OUT_GROUP ? (int)(N - n0) : OUT_GROUP;
            for (int64_t r0 = rb; r0 < re; r0 += ROW_GROUP) {
                const int rg = re - r0 < ROW_GROUP ? (int)(re - r0) : ROW_GROUP;
#if defined(__x86_64__)
                if (avx2) {
                    tile_avx2_any(x, K, w, b, y, N, r0, rg, n0, og);
                    continue;
                }
#endif
                tile_generic(x, K, w, b, y, N, r0, rg, n0, og);
            }
        }
    }
    (void)avx2;
}
