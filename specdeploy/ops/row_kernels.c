/* Row-wise small ops of a decode / verify step in one C call each: RMSNorm and rotate-half
 * RoPE. In torch each is 5-6 tensor ops of a few microseconds of dispatch apiece, on ~60 calls
 * a step; here each call costs about one.
 *
 * Each row is computed on its own by the same instruction sequence (portable C, no ISA
 * assumptions, -ffp-contract=off), so a row's output is bit-identical whatever the other rows
 * and the thread count (batch invariance: a decode row equals that row inside a verify step).
 * RoPE rounds exactly as `x * cos + rotate_half(x) * sin` does in torch (mul, mul, add), so it
 * is bit-identical to the torch kernel; RMSNorm sums the squares in row order, which may differ
 * from torch's reduction in the last bit. Built at run time by row_kernels.py.
 */
#include <math.h>
#include <stdint.h>

/* out[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * w; x rows `x_stride` apart. */
void rms_norm_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, const float *w,
                   float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        /* eight partial sums, then a fixed tree: same order for every row of every call */
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += xr[i + j] * xr[i + j];
        for (int j = 0; i < n; i++, j++) acc[j] += xr[i] * xr[i];
        float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        const float inv = 1.0f / sqrtf(s / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* out[t, h, :] = rotate-half RoPE of x[t, h, :] over its first `rot` dims (the rest copied);
 * x rows (tokens) `x_stride` apart, heads `d` apart; cos/sin [T, rot]. */
void rope_rows(const float *x, int64_t t, int64_t heads, int64_t d, int64_t x_stride,
               const float *cos_, const float *sin_, int64_t rot, float *out, int threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) if (t >= 64 && threads > 1)
    for (int64_t r = 0; r < t; r++) {
        const float *c = cos_ + r * rot, *s = sin_ + r * rot;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + r * x_stride + h * d;
            float *o = out + (r * heads + h) * d;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i] * c[i], b = xr[i + half] * s[i];
                o[i] = a + (-b);
            }
            for (int64_t i = half; i < rot; i++) {
                const float a = xr[i] * c[i], b = xr[i - half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = rot; i < d; i++) o[i] = xr[i];
        }
    }
}

/* sum[r, :] = a[r, :] + b[r, :] (torch's rounding) and out[r, :] = RMSNorm of that row, as
 * rms_norm_rows computes it; a, b rows dense (`n` apart). */
void add_rms_norm_rows(const float *a, const float *b, int64_t rows, int64_t n, const float *w,
                       float eps, float *sum, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *s = sum + r * n;
        for (int64_t i = 0; i < n; i++) s[i] = a[r * n + i] + b[r * n + i];
        rms_norm_rows(s, 1, n, n, w, eps, out + r * n, 1);
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, n + i] for i < n: the gate and up halves of one fused
 * projection row (rows `x_stride` apart). silu(v) = v / (1 + e^-v). */
void silu_mul_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, float *out,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}
