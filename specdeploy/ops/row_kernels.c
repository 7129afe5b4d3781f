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
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* one row's RMSNorm: eight partial sums of squares (lane j: elements j, j + 8, ...), a fixed
 * tree over them, then x * inv * w. Plain mul / add (-ffp-contract=off), so the generic and the
 * AVX2 clone below give the same bits (and the same as the torch-free reference order). */
#define RMS_ROW_BODY                                                                           \
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                   \
    int64_t i = 0;                                                                             \
    for (; i + 8 <= n; i += 8)                                                                 \
        for (int j = 0; j < 8; j++) acc[j] += xr[i + j] * xr[i + j];                           \
    for (int j = 0; i < n; i++, j++) acc[j] += xr[i] * xr[i];                                  \
    const float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])); \
    const float inv = 1.0f / sqrtf(s / (float)n + eps);                                        \
    for (i = 0; i < n; i++) o[i] = (xr[i] * inv) * w[i];

static void rms_row_generic(const float *xr, int64_t n, const float *w, float eps, float *o) {
    RMS_ROW_BODY
}

/* sum = a + b (torch's rounding), then that row's RMSNorm */
static void add_rms_row_generic(const float *a, const float *b, int64_t n, const float *w,
                                float eps, float *sum, float *o) {
    for (int64_t i = 0; i < n; i++) sum[i] = a[i] + b[i];
    const float *xr = sum;
    RMS_ROW_BODY
}

#if defined(__x86_64__)
/* the same C for AVX2: ~0.8 -> ~0.15 us a 576-wide row here (2026-12-05), on every layer's two
 * norms of every row of a step */
__attribute__((target("avx2"))) static void rms_row_avx2(const float *xr, int64_t n,
                                                         const float *w, float eps, float *o) {
    RMS_ROW_BODY
}

__attribute__((target("avx2"))) static void add_rms_row_avx2(const float *a, const float *b,
                                                             int64_t n, const float *w,
                                                             float eps, float *sum, float *o) {
    for (int64_t i = 0; i < n; i++) sum[i] = a[i] + b[i];
    const float *xr = sum;
    RMS_ROW_BODY
}
#endif

/* the widest clone a call may take: 0 generic, 1 AVX2, 2 AVX-512 (tests lower it to check
 * that every clone gives the generic code's bits) */
static int max_isa = 2;

int row_kernels_max_isa(int level) {
    const int before = max_isa;
    if (level >= 0) max_isa = level;
    return before;
}

static int have_avx2(void) {
#if defined(__x86_64__)
    return max_isa >= 1 && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int have_avx512(void) {
#if defined(__x86_64__)
    return max_isa >= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* out[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * w; x rows `x_stride` apart. */
void rms_norm_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, const float *w,
                   float eps, float *out, int threads) {
    const int avx2 = have_avx2();
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx2) {
            rms_row_avx2(x + r * x_stride, n, w, eps, out + r * n);
            continue;
        }
#endif
        rms_row_generic(x + r * x_stride, n, w, eps, out + r * n);
    }
    (void)avx2;
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

/* RoPE's cos / sin rows (ops/rope.py `rope_cos_sin`): slot j of token i has the frequency
 * f = (float)pos[ax(j) * n + i] * inv[j] (the cast and the product rounded as torch's), and
 * cos_[i, j] = cos_[i, j + half] = cosf(f) * scale, sin_ likewise (libm's to <= 1 ulp, where
 * torch's vectorized ones are too: not its bits). ax(j): 0 for mode 0 (one axis of positions);
 * multimodal RoPE's (temporal, height, width) axes otherwise: mode 1 interleaved (slot j with
 * j % 3 == a in {1, 2} and j < 3 * sa is axis a), mode 2 in blocks of s0, s1, s2 slots (the
 * rest, if any, axis 0: as _merge_mrope). */
void rope_cos_sin_rows(const int64_t *pos, int64_t n, int mode, int64_t s0, int64_t s1,
                       int64_t s2, const float *inv, int64_t half, float scale, float *cos_,
                       float *sin_) {
    for (int64_t i = 0; i < n; i++) {
        float *c = cos_ + i * 2 * half, *s = sin_ + i * 2 * half;
        for (int64_t j = 0; j < half; j++) {
            int64_t ax = 0;
            if (mode == 1)
                ax = (j % 3 == 1 && j < 3 * s1) ? 1 : (j % 3 == 2 && j < 3 * s2) ? 2 : 0;
            else if (mode == 2)
                ax = j < s0 ? 0 : j < s0 + s1 ? 1 : j < s0 + s1 + s2 ? 2 : 0;
            const float f = (float)pos[ax * n + i] * inv[j];
            c[j] = c[j + half] = cosf(f) * scale;
            s[j] = s[j + half] = sinf(f) * scale;
        }
    }
}

/* sum[r, :] = a[r, :] + b[r, :] (torch's rounding) and out[r, :] = RMSNorm of that row, as
 * rms_norm_rows computes it; a, b rows dense (`n` apart). */
void add_rms_norm_rows(const float *a, const float *b, int64_t rows, int64_t n, const float *w,
                       float eps, float *sum, float *out, int threads) {
    const int avx2 = have_avx2();
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx2) {
            add_rms_row_avx2(a + r * n, b + r * n, n, w, eps, sum + r * n, out + r * n);
            continue;
        }
#endif
        add_rms_row_generic(a + r * n, b + r * n, n, w, eps, sum + r * n, out + r * n);
    }
    (void)avx2;
}

/* sum[r, :] = a[r, :] + (b[r, :] + c[r, :]) (torch's two adds in that order: a MoE layer's
 * routed + shared outputs, then the residual) and out[r, :] = RMSNorm of that row, as
 * add_rms_norm_rows computes it; a, b, c rows dense (`n` apart). */
void add3_rms_norm_rows(const float *a, const float *b, const float *c, int64_t rows, int64_t n,
                        const float *w, float eps, float *sum, float *out, int threads) {
    const int avx2 = have_avx2();
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *s = sum + r * n;
        for (int64_t i = 0; i < n; i++) s[i] = b[r * n + i] + c[r * n + i];
#if defined(__x86_64__)
        if (avx2) { /* (reads each s[i] before writing it: in place is safe) */
            add_rms_row_avx2(a + r * n, s, n, w, eps, s, out + r * n);
            continue;
        }
#endif
        add_rms_row_generic(a + r * n, s, n, w, eps, s, out + r * n);
    }
    (void)avx2;
}

/* e^x for x <= 0: x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
 * (relative error < 2e-7), times 2^k through the exponent bits; below -87 about 1e-38. Plain
 * mul / add (-ffp-contract=off), so the generic and the AVX2 clone below give the same bits. */
/* x = k ln2 + r: k (rounded to nearest even by the 1.5 * 2^23 trick, exact for |v| < 2^22: no
 * libm call) and e^r */
static inline float exp_reduced(float x, float *k_out) {
    const float k = (x * 1.44269504f + 12582912.f) - 12582912.f;
    float r = x - k * 0.693145752f;
    r = r - k * 1.42860677e-6f;
    float p = 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    *k_out = k;
    return p * r + 1.f;
}

static inline float exp_le0(float x) {
    x = x > -87.f ? x : -87.f;
    float k;
    const float p = exp_reduced(x, &k);
    const int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, 4);
    return p * two_k;
}

/* silu(g) * u = g / (1 + e^-g) * u, with e^-|g| only (no overflow): for g < 0,
 * g / (1 + e^-g) = g e^g / (1 + e^g). Selects only, so the loop vectorizes (with
 * -fno-trapping-math, which changes no result: row_kernels.py). */
#define SILU_MUL_BODY                                                                          \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const float *g = x + r * x_stride, *u = g + n;                                         \
        float *o = out + r * n;                                                                \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float t = exp_le0(-fabsf(g[i]));                                             \
            const float num = g[i] * (g[i] >= 0.f ? 1.f : t);                                  \
            o[i] = (num / (1.f + t)) * u[i];                                                   \
        }                                                                                      \
    }

static void silu_mul_generic(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                             float *out) {
    SILU_MUL_BODY
}

#if defined(__x86_64__)
/* the same C, vectorized for AVX2 (no FMA contraction: the same bits as the generic one) */
__attribute__((target("avx2"))) static void silu_mul_avx2(const float *x, int64_t rows,
                                                          int64_t n, int64_t x_stride,
                                                          float *out) {
    SILU_MUL_BODY
}

/* and for AVX-512: a 1536-wide row ~1.0 -> ~0.65 us on a Zen 4 (2026-12-05; the divisions) */
__attribute__((target("avx2,avx512f,avx512vl"))) static void silu_mul_avx512(
    const float *x, int64_t rows, int64_t n, int64_t x_stride, float *out) {
    SILU_MUL_BODY
}
#endif

/* out[r, i] = silu(x[r, i]) * x[r, n + i] for i < n: the gate and up halves of one fused
 * projection row (rows `x_stride` apart). Rows split across threads for big batches only. */
void silu_mul_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, float *out,
                   int threads) {
    const int avx2 = have_avx2(), avx512 = have_avx512();
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx512) {
            silu_mul_avx512(x + r * x_stride, 1, n, x_stride, out + r * n);
            continue;
        }
        if (avx2) {
            silu_mul_avx2(x + r * x_stride, 1, n, x_stride, out + r * n);
            continue;
        }
#endif
        silu_mul_generic(x + r * x_stride, 1, n, x_stride, out + r * n);
    }
    (void)avx2;
    (void)avx512;
}

/* gpt-oss's clamped SwiGLU (ops/moe_bias.py `clamped_swiglu`), in torch's order of operations:
 * g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * (g * sigmoid(g * alpha)), the
 * sigmoid as the elementwise op 0 below (e^-|z| only, so no overflow; exp_le0: relative error
 * < 2e-7 against torch's libm-accurate sigmoid). NaN stays NaN through the clamps (compares
 * that fail keep the value). Plain operations, selects only: the generic and the ISA clones give
 * the same bits, wherever the element sits in the row. */
#define SWIGLU_OAI_BODY                                                                        \
    for (int64_t r = 0; r < rows; r++) {                                                       \
        const float *gt = x + r * x_stride, *up = gt + n;                                      \
        float *o = out + r * n;                                                                \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float g = gt[i] > limit ? limit : gt[i];                                     \
            const float u0 = up[i] > limit ? limit : up[i];                                    \
            const float u = u0 < -limit ? -limit : u0;                                         \
            const float z = g * alpha, t = exp_le0(-fabsf(z));                                 \
            const float s = (z >= 0.f ? 1.f : t) / (1.f + t);                                  \
            o[i] = (u + 1.f) * (g * s);                                                        \
        }                                                                                      \
    }

static void swiglu_oai_generic(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                               float alpha, float limit, float *out) {
    SWIGLU_OAI_BODY
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void swiglu_oai_avx2(const float *x, int64_t rows,
                                                            int64_t n, int64_t x_stride,
                                                            float alpha, float limit,
                                                            float *out) {
    SWIGLU_OAI_BODY
}

__attribute__((target("avx2,avx512f,avx512vl"))) static void swiglu_oai_avx512(
    const float *x, int64_t rows, int64_t n, int64_t x_stride, float alpha, float limit,
    float *out) {
    SWIGLU_OAI_BODY
}
#endif

/* out[r, i] = the clamped SwiGLU of x[r, i] (gate) and x[r, n + i] (up), i < n; rows
 * `x_stride` apart; rows split across threads for big batches only (as silu_mul_rows). */
void swiglu_oai_rows(const float *x, int64_t rows, int64_t n, int64_t x_stride, float alpha,
                     float limit, float *out, int threads) {
    const int avx2 = have_avx2(), avx512 = have_avx512();
#pragma omp parallel for num_threads(threads) if (rows >= 64 && threads > 1)
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx512) {
            swiglu_oai_avx512(x + r * x_stride, 1, n, x_stride, alpha, limit, out + r * n);
            continue;
        }
        if (avx2) {
            swiglu_oai_avx2(x + r * x_stride, 1, n, x_stride, alpha, limit, out + r * n);
            continue;
        }
#endif
        swiglu_oai_generic(x + r * x_stride, 1, n, x_stride, alpha, limit, out + r * n);
    }
    (void)avx2;
    (void)avx512;
}

/* e^x over the whole float range by the operations of exp_le0 (the range reduction, the same
 * polynomial), 2^k applied as two factors so that results down to the subnormals come out;
 * e^x rounds to 0 below about -103.9 (so e^-inf = 0), to inf above 88.72; NaN stays NaN */
static inline float exp_any(float x) {
    const float xc = x < -104.f ? -104.f : (x > 88.75f ? 88.75f : x);
    float k;
    const float p = exp_reduced(xc, &k);
    const int32_t k1 = (int32_t)k / 2, k2 = (int32_t)k - k1; /* each within [-75, 64] */
    const int32_t b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
    float f1, f2;
    memcpy(&f1, &b1, 4);
    memcpy(&f2, &b2, 4);
    const float e = (p * f1) * f2;
    return x != x ? x : (x > 88.7228f ? INFINITY : e);
}

/* log(1 + t) for 0 <= t <= 1 as 2 atanh(s), s = t / (2 + t) <= 1/3: 2 (s + s^3/3 + ... +
 * s^19/19), the next term below 2e-10 of the sum, accurate for tiny t too (plain operations) */
static inline float log1p_01(float t) {
    const float s = t / (2.f + t), s2 = s * s;
    float p = 1.f / 19;
    p = p * s2 + 1.f / 17;
    p = p * s2 + 1.f / 15;
    p = p * s2 + 1.f / 13;
    p = p * s2 + 1.f / 11;
    p = p * s2 + 1.f / 9;
    p = p * s2 + 1.f / 7;
    p = p * s2 + 1.f / 5;
    p = p * s2 + 1.f / 3;
    p = p * s2 + 1.f;
    return 2.f * s * p;
}

/* Elementwise functions whose every element is computed by the same plain operations wherever
 * it sits in the tensor (generic and AVX2 clones alike): torch's vectorized kernels run a
 * tensor's tail through their scalar path, whose exp / log round otherwise, so an element's
 * bits depended on the tensor's size and its place in it (a decode row's gate or decay on
 * whether it was the last of a batch; deploy/passes/row_linears.py, ops/elementwise.py).
 * op 0: sigmoid 1 / (1 + e^-x) with e^-|x| only; 1: softplus as torch's (beta 1, threshold
 * 20), max(x, 0) + log(1 + e^-|x|); 2: e^x; 3: silu x * sigmoid(x), as silu_mul_rows;
 * 4: relu(x)^2, torch.square(torch.relu(x))'s bits. */
#define ELEMENTWISE_BODY                                                                       \
    switch (op) {                                                                              \
    case 0:                                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float t = exp_le0(-fabsf(x[i]));                                             \
            out[i] = (x[i] >= 0.f ? 1.f : t) / (1.f + t);                                      \
        }                                                                                      \
        break;                                                                                 \
    case 1:                                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float v = x[i], l = log1p_01(exp_le0(-fabsf(v)));                             \
            out[i] = v > 20.f ? v : (v > 0.f ? v : 0.f) + l;                                  \
        }                                                                                      \
        break;                                                                                 \
    case 2:                                                                                    \
        for (int64_t i = 0; i < n; i++) out[i] = exp_any(x[i]);                                \
        break;                                                                                 \
    case 4: /* ReLU^2 (NemotronH): torch's relu (NaN stays NaN), then one multiply */          \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float v = (x[i] > 0.f || x[i] != x[i]) ? x[i] : 0.f;                         \
            out[i] = v * v;                                                                    \
        }                                                                                      \
        break;                                                                                 \
    default:                                                                                   \
        for (int64_t i = 0; i < n; i++) {                                                      \
            const float t = exp_le0(-fabsf(x[i]));                                             \
            out[i] = (x[i] * (x[i] >= 0.f ? 1.f : t)) / (1.f + t);                             \
        }                                                                                      \
    }

static void elementwise_generic(int op, const float *x, int64_t n, float *out) {
    ELEMENTWISE_BODY
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void elementwise_avx2(int op, const float *x, int64_t n,
                                                             float *out) {
    ELEMENTWISE_BODY
}
#endif

/* out[i] = f_op(x[i]); blocks of 16384 elements split across threads for big tensors */
void elementwise(int op, const float *x, int64_t n, float *out, int threads) {
    const int avx2 = have_avx2();
    const int64_t block = 16384, nblocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(threads) if (nblocks > 1 && threads > 1)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t lo = b * block, m = n - lo < block ? n - lo : block;
#if defined(__x86_64__)
        if (avx2) {
            elementwise_avx2(op, x + lo, m, out + lo);
            continue;
        }
#endif
        elementwise_generic(op, x + lo, m, out + lo);
    }
    (void)avx2;
}

/* The recurrent layers' decode steps. Each row's state is read at row `slots[r]` of `state`
 * and written at row `slots[r]` of `new_state` (slots NULL: row r of each). With slots and
 * new_state == state the step updates the cache's slots in place: every state element is read
 * before its own write, and no other element reads it, so the bits are those of the copy form
 * (run_cached's decode steps skip a gather, a copy and a scatter of each state). state NULL:
 * zeros. Every (row, channel / head) by the same plain operations in a fixed order whatever
 * the rows beside it and the thread count: batch-invariant, so a verify step's token-by-token
 * rows equal decode rows; the generic, AVX2 and AVX-512 clones give the same bits
 * (-ffp-contract=off, no reassociation). */

static inline int64_t slot_row(const int64_t *slots, int64_t r) { return slots ? slots[r] : r; }

/* parallel over rows x heads when a step's state is big enough to pay for the threads */
#define STEP_THREADS(work) ((work) >= (int64_t)1 << 16 && threads > 1)

/* A depthwise causal conv1d's decode step (ops/conv.py, one token a row): per row r and
 * channel c, the window (state[r, c, 0 .. W-2], x[r, c]) dotted with weight[c] in that order
 * from 0, plus bias[c], then silu as `elementwise` op 3 (act 1) or nothing (act 0); the state
 * moves on by one. x [R, C], state and new_state [*, C, W - 1], weight [C, W], y [R, C].
 * Three passes over the channels (the dots, the activation, the shift): the activation's
 * loop vectorizes (~16 -> ~3 us for 1,024 channels here, 2026-12-06), each value by the same
 * operations as before. */
#define CONV_ROW_BODY                                                                          \
    if (s == 3 && st) { /* width 4 (Mamba2's, Qwen3.5's): the same sums, unrolled */         \
        for (int64_t ch = 0; ch < c; ch++) {                                                   \
            const float *q = st + ch * 3, *w = weight + ch * 4;                                \
            float acc = 0.f;                                                                   \
            acc = acc + q[0] * w[0];                                                           \
            acc = acc + q[1] * w[1];                                                           \
            acc = acc + q[2] * w[2];                                                           \
            acc = acc + xr[ch] * w[3];                                                         \
            yr[ch] = bias ? acc + bias[ch] : acc;                                              \
        }                                                                                      \
    } else                                                                                     \
    for (int64_t ch = 0; ch < c; ch++) {                                                       \
        const float *w = weight + ch * width;                                                  \
        float acc = 0.f;                                                                       \
        if (st)                                                                                \
            for (int64_t i = 0; i < s; i++) acc = acc + st[ch * s + i] * w[i];                 \
        else                                                                                   \
            for (int64_t i = 0; i < s; i++) acc = acc + 0.f * w[i];                            \
        acc = acc + xr[ch] * w[s];                                                             \
        if (bias) acc = acc + bias[ch];                                                        \
        yr[ch] = acc;                                                                          \
    }                                                                                          \
    if (act)                                                                                   \
        for (int64_t ch = 0; ch < c; ch++) {                                                   \
            const float a = yr[ch], t = exp_le0(-fabsf(a));                                    \
            yr[ch] = (a * (a >= 0.f ? 1.f : t)) / (1.f + t);                                   \
        }                                                                                      \
    if (s == 3 && st)                                                                          \
        for (int64_t ch = 0; ch < c; ch++) {                                                   \
            const float a = st[ch * 3 + 1], b = st[ch * 3 + 2];                                \
            ns[ch * 3] = a;                                                                    \
            ns[ch * 3 + 1] = b;                                                                \
            ns[ch * 3 + 2] = xr[ch];                                                           \
        }                                                                                      \
    else                                                                                       \
        for (int64_t ch = 0; ch < c; ch++) {                                                   \
            float *n = ns + ch * s;                                                            \
            for (int64_t i = 0; i + 1 < s; i++) n[i] = st ? st[ch * s + i + 1] : 0.f;         \
            if (s) n[s - 1] = xr[ch];                                                          \
        }

#define CONV_ROW_ARGS                                                                          \
    const float *xr, const float *st, const float *weight, const float *bias, int64_t c,      \
        int64_t width, int64_t s, int act, float *yr, float *ns

static void conv_row_generic(CONV_ROW_ARGS) { CONV_ROW_BODY }

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void conv_row_avx2(CONV_ROW_ARGS) { CONV_ROW_BODY }

__attribute__((target("avx2,avx512f,avx512vl"))) static void conv_row_avx512(CONV_ROW_ARGS) {
    CONV_ROW_BODY
}
#endif

/* rows read their state at row slots[r] of `state` and write it at row wslots[r] of
 * `new_state` (a verify step's token i: read entry i - 1 of the spec states, write entry i) */
static void conv_step_rw(const float *x, const float *state, const int64_t *slots,
                         const int64_t *wslots, const float *weight, const float *bias,
                         int64_t rows, int64_t c, int64_t width, int act, float *y,
                         float *new_state) {
    const int64_t s = width - 1;
    const int avx2 = have_avx2(), avx512 = have_avx512();
    for (int64_t r = 0; r < rows; r++) {
        const int64_t sr = slot_row(slots, r), sw = wslots ? wslots[r] : sr;
        const float *st = state ? state + sr * c * s : 0, *xr = x + r * c;
        float *yr = y + r * c, *ns = new_state + sw * c * s;
#if defined(__x86_64__)
        if (avx512) {
            conv_row_avx512(xr, st, weight, bias, c, width, s, act, yr, ns);
            continue;
        }
        if (avx2) {
            conv_row_avx2(xr, st, weight, bias, c, width, s, act, yr, ns);
            continue;
        }
#endif
        conv_row_generic(xr, st, weight, bias, c, width, s, act, yr, ns);
    }
    (void)avx2;
    (void)avx512;
}

void conv_step_rows(const float *x, const float *state, const int64_t *slots,
                    const float *weight, const float *bias, int64_t rows, int64_t c,
                    int64_t width, int act, float *y, float *new_state) {
    conv_step_rw(x, state, slots, 0, weight, bias, rows, c, width, act, y, new_state);
}

/* Mamba2's SSM decode step for one (row, head): state[p, n] = decay * state[p, n] + (dt x[p])
 * B[n], y[p] = sum_n state[p, n] C[n] + D x[p]; the sum in eight lanes (lane l: n = l, l + 8,
 * ...) then a fixed tree, so it vectorizes (a serial sum of 128 terms was ~0.15 ms a step
 * here, 2026-12-06). */
#define SSM_HEAD_BODY                                                                          \
    for (int64_t i = 0; i < p; i++) {                                                          \
        const float *st = state ? state + i * n : 0;                                           \
        float *ns = new_state + i * n;                                                         \
        const float xd = d * xs[i];                                                            \
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                               \
        int64_t j = 0;                                                                         \
        if (st) {                                                                              \
            for (; j + 8 <= n; j += 8)                                                         \
                for (int l = 0; l < 8; l++) {                                                  \
                    const float v = decay * st[j + l] + xd * b[j + l];                         \
                    ns[j + l] = v;                                                             \
                    acc[l] = acc[l] + v * c[j + l];                                            \
                }                                                                              \
            for (int l = 0; j < n; j++, l++) {                                                 \
                const float v = decay * st[j] + xd * b[j];                                     \
                ns[j] = v;                                                                     \
                acc[l] = acc[l] + v * c[j];                                                    \
            }                                                                                  \
        } else {                                                                               \
            for (; j + 8 <= n; j += 8)                                                         \
                for (int l = 0; l < 8; l++) {                                                  \
                    const float v = xd * b[j + l];                                             \
                    ns[j + l] = v;                                                             \
                    acc[l] = acc[l] + v * c[j + l];                                            \
                }                                                                              \
            for (int l = 0; j < n; j++, l++) {                                                 \
                const float v = xd * b[j];                                                     \
                ns[j] = v;                                                                     \
                acc[l] = acc[l] + v * c[j];                                                    \
            }                                                                                  \
        }                                                                                      \
        const float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +                            \
                          ((acc[2] + acc[6]) + (acc[3] + acc[7]));                             \
        y[i] = sum + dd * xs[i];                                                               \
    }

#define SSM_HEAD_ARGS                                                                          \
    const float *xs, float d, float decay, float dd, const float *b, const float *c,          \
        const float *state, int64_t p, int64_t n, float *y, float *new_state

static void ssm_head_generic(SSM_HEAD_ARGS) { SSM_HEAD_BODY }

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void ssm_head_avx2(SSM_HEAD_ARGS) { SSM_HEAD_BODY }

__attribute__((target("avx2,avx512f,avx512vl"))) static void ssm_head_avx512(SSM_HEAD_ARGS) {
    SSM_HEAD_BODY
}
#endif

/* per row r and head h (group h / rep): decay = e^(dt A_h) (exp_any). x [R, H, P], dt [R, H]
 * (already discretized), B / C [R, G, N], state / new_state [*, H, P, N], y [R, H, P]. */
static void ssm_step_rw(const float *x, const float *dt, const float *A, const float *Bm,
                        const float *Cm, const float *D, const float *state,
                        const int64_t *slots, const int64_t *wslots, int64_t rows, int64_t h,
                        int64_t p, int64_t n, int64_t g, float *y, float *new_state,
                        int threads) {
    const int64_t rep = h / g, hs = p * n;
    const int avx2 = have_avx2(), avx512 = have_avx512();
#pragma omp parallel for collapse(2) num_threads(threads) if (STEP_THREADS(rows * h * hs))
    for (int64_t r = 0; r < rows; r++)
        for (int64_t hh = 0; hh < h; hh++) {
            const float d = dt[r * h + hh], decay = exp_any(d * A[hh]);
            const float *b = Bm + (r * g + hh / rep) * n, *c = Cm + (r * g + hh / rep) * n;
            const int64_t sh = slot_row(slots, r) * h + hh;
            const int64_t sw = (wslots ? wslots[r] : slot_row(slots, r)) * h + hh;
            const float *st = state ? state + sh * hs : 0;
            float *ns = new_state + sw * hs, *yy = y + (r * h + hh) * p;
            const float *xs = x + (r * h + hh) * p;
#if defined(__x86_64__)
            if (avx512) {
                ssm_head_avx512(xs, d, decay, D[hh], b, c, st, p, n, yy, ns);
                continue;
            }
            if (avx2) {
                ssm_head_avx2(xs, d, decay, D[hh], b, c, st, p, n, yy, ns);
                continue;
            }
#endif
            ssm_head_generic(xs, d, decay, D[hh], b, c, st, p, n, yy, ns);
        }
    (void)avx2;
    (void)avx512;
}

void ssm_step_rows(const float *x, const float *dt, const float *A, const float *Bm,
                   const float *Cm, const float *D, const float *state, const int64_t *slots,
                   int64_t rows, int64_t h, int64_t p, int64_t n, int64_t g, float *y,
                   float *new_state, int threads) {
    ssm_step_rw(x, dt, A, Bm, Cm, D, state, slots, 0, rows, h, p, n, g, y, new_state, threads);
}

/* The gated delta rule's decode step for one (row, head) (ops/gdn.py): S = e^g S (exp_any),
 * u = (v - k^T S) beta, S += k u^T, o = q^T S; sums over the key dimension in order (each
 * output column on its own: the loops over the value dimension vectorize). */
#define GDN_HEAD_BODY                                                                          \
    for (int64_t j = 0; j < dv; j++) oo[j] = 0.f; /* k^T S first, into o */                   \
    for (int64_t i = 0; i < dk; i++)                                                           \
        for (int64_t j = 0; j < dv; j++) {                                                     \
            const float s = st ? st[i * dv + j] * e : 0.f;                                     \
            S[i * dv + j] = s;                                                                 \
            oo[j] = oo[j] + kk[i] * s;                                                         \
        }                                                                                      \
    for (int64_t j = 0; j < dv; j++) oo[j] = (vv[j] - oo[j]) * bt; /* u */                    \
    for (int64_t i = 0; i < dk; i++)                                                           \
        for (int64_t j = 0; j < dv; j++) S[i * dv + j] = S[i * dv + j] + kk[i] * oo[j];        \
    for (int64_t j = 0; j < dv; j++) oo[j] = 0.f;                                              \
    for (int64_t i = 0; i < dk; i++)                                                           \
        for (int64_t j = 0; j < dv; j++) oo[j] = oo[j] + qq[i] * S[i * dv + j];

#define GDN_HEAD_ARGS                                                                          \
    const float *qq, const float *kk, const float *vv, float e, float bt, const float *st,    \
        int64_t dk, int64_t dv, float *oo, float *S

static void gdn_head_generic(GDN_HEAD_ARGS) { GDN_HEAD_BODY }

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void gdn_head_avx2(GDN_HEAD_ARGS) { GDN_HEAD_BODY }

__attribute__((target("avx2,avx512f,avx512vl"))) static void gdn_head_avx512(GDN_HEAD_ARGS) {
    GDN_HEAD_BODY
}
#endif

/* q / k as the step reads them: with l2norm, x / sqrt(sum(x^2) + 1e-6) (fla's l2norm; the sum
 * in eight lanes, a fixed tree), then q times scale */
static void gdn_qk(const float *q, const float *k, int64_t dk, int l2norm, float scale,
                   float *qn, float *kn) {
    float iq = 1.f, ik = 1.f;
    if (l2norm) {
        float aq[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ak[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t i = 0;
        for (; i + 8 <= dk; i += 8)
            for (int j = 0; j < 8; j++) {
                aq[j] = aq[j] + q[i + j] * q[i + j];
                ak[j] = ak[j] + k[i + j] * k[i + j];
            }
        for (int j = 0; i < dk; i++, j++) {
            aq[j] = aq[j] + q[i] * q[i];
            ak[j] = ak[j] + k[i] * k[i];
        }
        const float sq = ((aq[0] + aq[4]) + (aq[1] + aq[5])) + ((aq[2] + aq[6]) + (aq[3] + aq[7]));
        const float sk = ((ak[0] + ak[4]) + (ak[1] + ak[5])) + ((ak[2] + ak[6]) + (ak[3] + ak[7]));
        iq = 1.f / sqrtf(sq + 1e-6f);
        ik = 1.f / sqrtf(sk + 1e-6f);
    }
    for (int64_t i = 0; i < dk; i++) {
        qn[i] = l2norm ? (q[i] * iq) * scale : q[i] * scale;
        kn[i] = l2norm ? k[i] * ik : k[i];
    }
}

/* per row r and value head h (q / k head h / rep, rep = h / hk): q / k [R, Hk, K] (raw: the
 * step applies l2norm and scale, gdn_qk), v [R, H, V], g / beta [R, H], state / new_state
 * [*, H, K, V], o [R, H, V]. */
static void gdn_step_rw(const float *q, const float *k, const float *v, const float *gate,
                        const float *beta, const float *state, const int64_t *slots,
                        const int64_t *wslots, int64_t rows, int64_t h, int64_t hk, int64_t dk,
                        int64_t dv, int l2norm, float scale, float *o, float *new_state,
                        int threads) {
    const int avx2 = have_avx2(), avx512 = have_avx512();
    const int64_t rep = h / hk;
#pragma omp parallel for collapse(2) num_threads(threads) if (STEP_THREADS(rows * h * dk * dv))
    for (int64_t r = 0; r < rows; r++)
        for (int64_t hh = 0; hh < h; hh++) {
            const int64_t rh = r * h + hh, sh = slot_row(slots, r) * h + hh;
            const int64_t sw = (wslots ? wslots[r] : slot_row(slots, r)) * h + hh;
            const int64_t rk = r * hk + hh / rep;
            const float e = exp_any(gate[rh]), bt = beta[rh];
            float qq[dk], kk[dk];
            gdn_qk(q + rk * dk, k + rk * dk, dk, l2norm, scale, qq, kk);
            const float *vv = v + rh * dv;
            const float *st = state ? state + sh * dk * dv : 0;
            float *S = new_state + sw * dk * dv, *oo = o + rh * dv;
#if defined(__x86_64__)
            if (avx512) {
                gdn_head_avx512(qq, kk, vv, e, bt, st, dk, dv, oo, S);
                continue;
            }
            if (avx2) {
                gdn_head_avx2(qq, kk, vv, e, bt, st, dk, dv, oo, S);
                continue;
            }
#endif
            gdn_head_generic(qq, kk, vv, e, bt, st, dk, dv, oo, S);
        }
    (void)avx2;
    (void)avx512;
}

void gdn_step_rows(const float *q, const float *k, const float *v, const float *gate,
                   const float *beta, const float *state, const int64_t *slots, int64_t rows,
                   int64_t h, int64_t hk, int64_t dk, int64_t dv, int l2norm, float scale,
                   float *o, float *new_state, int threads) {
    gdn_step_rw(q, k, v, gate, beta, state, slots, 0, rows, h, hk, dk, dv, l2norm, scale, o,
                new_state, threads);
}

/* Gated RMSNorm over groups of `group` columns (ops/norm.py): sg = silu(gate) as
 * `elementwise` op 3; norm_before_gate 0 (Mamba2): v = x sg, out = (v inv) w; 1 (GDN):
 * out = ((x inv) w) sg; inv = 1 / sqrt(sum(v^2) / group + eps) with the sum as RMSNorm's
 * (eight lanes, a fixed tree). x / gate rows `x_stride` / `g_stride` apart, out [R, N]. */
#define GATED_ROW_BODY                                                                         \
    for (int64_t i = 0; i < n; i++) {                                                          \
        const float t = exp_le0(-fabsf(gt[i]));                                                \
        sg[i] = (gt[i] * (gt[i] >= 0.f ? 1.f : t)) / (1.f + t);                                \
        v[i] = nbg ? xr[i] : xr[i] * sg[i];                                                    \
    }                                                                                          \
    for (int64_t g0 = 0; g0 < n; g0 += group) {                                                \
        const float *vg = v + g0;                                                              \
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                               \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= group; i += 8)                                                         \
            for (int j = 0; j < 8; j++) acc[j] += vg[i + j] * vg[i + j];                       \
        for (int j = 0; i < group; i++, j++) acc[j] += vg[i] * vg[i];                          \
        const float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +                              \
                        ((acc[2] + acc[6]) + (acc[3] + acc[7]));                               \
        const float inv = 1.0f / sqrtf(s / (float)group + eps);                                \
        for (i = 0; i < group; i++) {                                                          \
            const float on = (vg[i] * inv) * w[g0 + i];                                        \
            o[g0 + i] = nbg ? on * sg[g0 + i] : on;                                            \
        }                                                                                      \
    }

#define GATED_ROW_ARGS                                                                         \
    const float *xr, const float *gt, int64_t n, int64_t group, const float *w, float eps,    \
        int nbg, float *sg, float *v, float *o

static void gated_row_generic(GATED_ROW_ARGS) { GATED_ROW_BODY }

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void gated_row_avx2(GATED_ROW_ARGS) { GATED_ROW_BODY }

__attribute__((target("avx2,avx512f,avx512vl"))) static void gated_row_avx512(GATED_ROW_ARGS) {
    GATED_ROW_BODY
}
#endif

/* scratch: 2 n floats per thread (the gate's silu and the gated values) */
void gated_rms_norm_rows(const float *x, int64_t x_stride, const float *gate, int64_t g_stride,
                         int64_t rows, int64_t n, int64_t group, const float *w, float eps,
                         int nbg, float *out, float *scratch, int threads) {
    const int avx2 = have_avx2(), avx512 = have_avx512();
    const int nt = rows >= 64 && threads > 1 ? threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        float *sg = scratch + 2 * n * (int64_t)omp_get_thread_num();
#else
        float *sg = scratch;
#endif
        float *v = sg + n;
#pragma omp for
        for (int64_t r = 0; r < rows; r++) {
            const float *xr = x + r * x_stride, *gt = gate + r * g_stride;
            float *o = out + r * n;
#if defined(__x86_64__)
            if (avx512) {
                gated_row_avx512(xr, gt, n, group, w, eps, nbg, sg, v, o);
                continue;
            }
            if (avx2) {
                gated_row_avx2(xr, gt, n, group, w, eps, nbg, sg, v, o);
                continue;
            }
#endif
            gated_row_generic(xr, gt, n, group, w, eps, nbg, sg, v, o);
        }
    }
    (void)avx2;
    (void)avx512;
}

/* MoE routing of one row of router logits (ops/moe.py), e experts -> k (ids, weights), ids in
 * descending order of their selection score (ties: the lower id first).
 * mode 0 (Qwen): p = softmax(logits) (max subtracted, exp_any, the sum in order), selection and
 * weights p; renorm: w / sum(w). mode 1 (DeepSeek-V3 / NemotronH): s = sigmoid(logits) as
 * `elementwise` op 0, selection s + bias (bias NULL: s), with n_group > 1 only among the
 * topk_group groups whose two best selection scores sum highest; weights s; renorm:
 * w / (sum(w) + 1e-20); then times scale. scratch: e floats. */
static void insert_top(float v, int64_t id, float *bv, int64_t *bi, int64_t k) {
    if (!(v > bv[k - 1])) return; /* not better than the k-th (NaN never is) */
    int64_t j = k - 1;
    while (j > 0 && v > bv[j - 1]) {
        bv[j] = bv[j - 1];
        bi[j] = bi[j - 1];
        j--;
    }
    bv[j] = v;
    bi[j] = id;
}

static void route_row(const float *x, const float *bias, int64_t e, int64_t k, int mode,
                      int64_t n_group, int64_t topk_group, int renorm, float scale, float *score,
                      int64_t *ids, float *w) {
    float bv[k > 0 ? k : 1];
    if (mode == 0) {
        float m = x[0];
        for (int64_t i = 1; i < e; i++) m = x[i] > m ? x[i] : m;
        float sum = 0.f;
        for (int64_t i = 0; i < e; i++) {
            score[i] = exp_any(x[i] - m);
            sum = sum + score[i];
        }
        for (int64_t i = 0; i < e; i++) score[i] = score[i] / sum;
    } else {
        for (int64_t i = 0; i < e; i++) {
            const float t = exp_le0(-fabsf(x[i]));
            score[i] = (x[i] >= 0.f ? 1.f : t) / (1.f + t);
        }
    }
    for (int64_t j = 0; j < k; j++) {
        bv[j] = -INFINITY;
        ids[j] = -1;
    }
    const int64_t gsize = n_group > 1 ? e / n_group : e;
    int64_t keep_n = n_group > 1 ? topk_group : 1;
    int64_t keep[n_group > 1 ? n_group : 1];
    if (n_group > 1) { /* groups ranked by the sum of their two best selection scores */
        float gv[n_group];
        int64_t gi[n_group];
        for (int64_t g = 0; g < n_group; g++) gv[g] = -INFINITY, gi[g] = -1;
        for (int64_t g = 0; g < n_group; g++) {
            float t2[2] = {-INFINITY, -INFINITY};
            int64_t i2[2] = {-1, -1};
            for (int64_t i = g * gsize; i < (g + 1) * gsize; i++)
                insert_top(score[i] + (bias ? bias[i] : 0.f), i, t2, i2, 2);
            insert_top(t2[0] + t2[1], g, gv, gi, topk_group);
        }
        for (int64_t g = 0; g < topk_group; g++) keep[g] = gi[g];
    } else {
        keep[0] = 0;
    }
    for (int64_t q = 0; q < keep_n; q++) {
        const int64_t g = keep[q];
        if (g < 0) continue;
        for (int64_t i = g * gsize; i < (g + 1) * gsize; i++)
            insert_top(mode == 1 && bias ? score[i] + bias[i] : score[i], i, bv, ids, k);
    }
    for (int64_t j = 0, next = 0; j < k; j++) { /* fewer than k comparable: the lowest ids */
        if (ids[j] >= 0) continue;
        for (;; next++) {
            int used = 0;
            for (int64_t t = 0; t < k; t++) used |= ids[t] == next;
            if (!used) break;
        }
        ids[j] = next++;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < k; j++) {
        w[j] = score[ids[j]];
        sum = sum + w[j];
    }
    if (renorm) {
        const float d = mode == 1 ? sum + 1e-20f : sum;
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / d;
    }
    if (mode == 1)
        for (int64_t j = 0; j < k; j++) w[j] = w[j] * scale;
}

void moe_route_rows(const float *logits, int64_t rows, int64_t e, const float *bias, int64_t k,
                    int mode, int64_t n_group, int64_t topk_group, int renorm, float scale,
                    int64_t *ids, float *weights, float *scratch, int threads) {
    const int nt = rows >= 64 && threads > 1 ? threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        float *score = scratch + e * (int64_t)omp_get_thread_num();
#else
        float *score = scratch;
#endif
#pragma omp for
        for (int64_t r = 0; r < rows; r++)
            route_row(logits + r * e, bias, e, k, mode, n_group, topk_group, renorm, scale,
                      score, ids + r * k, weights + r * k);
    }
}

/* ---- a recurrent mixer's whole decode or verify step in one call ---------------------------
 * (deploy/passes/fuse_mixers.py) Each calls the kernels above in the order the graph's chain
 * calls them, on the same values, so its bits are the chain's. `rows` sequences of `ntok`
 * tokens each (input row r * ntok + i is sequence r's token i), states at `slots`:
 *   spec NULL (decode, ntok 1): each state is updated in place;
 *   spec set (verify): token i reads sequence r's state after token i - 1 (the main state for
 *   token 0, else spec entry i - 1) and writes entry i of its spec states (spec rows of k1
 *   entries a slot), as run_cached's token-by-token EXTEND path does; the main state is not
 *   touched. */

static void gather_rows(const float *src, int64_t stride, int64_t rows, int64_t n, float *dst) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * n, src + r * stride, n * sizeof(float));
}

/* softplus(v + bias) per element as `elementwise` op 1 (ops/ssm.py ssm_dt, gdn's decay) */
static void softplus_bias(const float *v, int64_t stride, const float *bias, int64_t rows,
                          int64_t h, float *out, int threads) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < h; i++) out[r * h + i] = v[r * stride + i] + bias[i];
    elementwise(1, out, rows * h, out, threads);
}

/* Where token i of a step reads and writes the conv state and the other (SSM / gated-delta)
 * state (see above); rw: 2 * rows int64 of scratch. */
typedef struct {
    const int64_t *rs, *ws;
    const float *conv_read, *state_read;
    float *conv_write, *state_write;
} token_io_t;

static token_io_t token_io(const int64_t *slots, int64_t rows, int64_t i, int64_t k1,
                           int64_t *rw, float *conv_state, float *conv_spec, float *state,
                           float *spec) {
    if (!conv_spec) return (token_io_t){slots, slots, conv_state, state, conv_state, state};
    for (int64_t r = 0; r < rows; r++) {
        rw[r] = i == 0 ? slots[r] : slots[r] * k1 + i - 1;
        rw[rows + r] = slots[r] * k1 + i;
    }
    return (token_io_t){rw, rw + rows, i ? conv_spec : conv_state, i ? spec : state, conv_spec,
                        spec};
}

/* Mamba2 (NemotronH): xbc -> conv (silu) -> x / B / C; dt -> clamp(softplus(dt + dt_bias));
 * the SSM step; gated RMSNorm with z (norm after the gate). x [R, H P], B / C [R, G N].
 * Returns -1 without scratch memory. */
int mamba2_decode_rows(const float *xbc, int64_t xbc_stride, const float *z, int64_t z_stride,
                       const float *dt, int64_t dt_stride, int64_t rows, int64_t ntok,
                       const int64_t *slots, float *conv_state, float *conv_spec,
                       const float *conv_w, const float *conv_b, int64_t width,
                       float *ssm_state, float *ssm_spec, int64_t k1, const float *A,
                       const float *D, const float *dt_bias, float dt_min, float dt_max,
                       int64_t h, int64_t p, int64_t n, int64_t g, const float *norm_w,
                       float eps, int64_t group, float *out, int threads) {
    const int64_t dx = h * p, c = dx + 2 * g * n;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (4 * c + 2 * h + 2 * dx) +
                                                          2 * dx * threads));
    int64_t *rw = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * rows));
    if (!buf || !rw) {
        free(buf);
        free(rw);
        return -1;
    }
    float *xin = buf, *y = xin + rows * c, *parts = y + rows * c, *delta = parts + rows * c;
    float *ys = delta + rows * h, *zs = ys + rows * dx, *ot = zs + rows * dx;
    float *gscratch = ot + rows * dx;
    float *xs = parts, *bs = xs + rows * dx, *cs = bs + rows * g * n;
    for (int64_t i = 0; i < ntok; i++) {
        const token_io_t io = token_io(slots, rows, i, k1, rw, conv_state, conv_spec,
                                       ssm_state, ssm_spec);
        gather_rows(xbc + i * xbc_stride, xbc_stride * ntok, rows, c, xin);
        conv_step_rw(xin, io.conv_read, io.rs, io.ws, conv_w, conv_b, rows, c, width, 1, y,
                     io.conv_write);
        for (int64_t r = 0; r < rows; r++) {
            memcpy(xs + r * dx, y + r * c, dx * sizeof(float));
            memcpy(bs + r * g * n, y + r * c + dx, g * n * sizeof(float));
            memcpy(cs + r * g * n, y + r * c + dx + g * n, g * n * sizeof(float));
        }
        softplus_bias(dt + i * dt_stride, dt_stride * ntok, dt_bias, rows, h, delta, threads);
        for (int64_t j = 0; j < rows * h; j++) { /* torch's clamp(min, max); NaN stays NaN */
            float v = delta[j];
            v = v < dt_min ? dt_min : v;
            delta[j] = v > dt_max ? dt_max : v;
        }
        ssm_step_rw(xs, delta, A, bs, cs, D, io.state_read, io.rs, io.ws, rows, h, p, n, g, ys,
                    io.state_write, threads);
        gather_rows(z + i * z_stride, z_stride * ntok, rows, dx, zs);
        gated_rms_norm_rows(ys, dx, zs, dx, rows, dx, group, norm_w, eps, 0, ot, gscratch,
                            threads);
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + (r * ntok + i) * dx, ot + r * dx, dx * sizeof(float));
    }
    free(buf);
    free(rw);
    return 0;
}

/* The gated delta rule (Qwen3.5): qkv -> conv (silu) -> q / k [Hk K] and v [H V]; beta =
 * sigmoid(b) (`elementwise` op 0); decay g = A * softplus(a + dt_bias) (A = -exp(A_log));
 * the step (l2norm, scale, head sharing in it); gated RMSNorm of each head's values with z
 * (norm before the gate; weight [V]). Returns -1 without scratch memory. */
int gdn_decode_rows(const float *qkv, int64_t qkv_stride, const float *b, int64_t b_stride,
                    const float *a, int64_t a_stride, const float *z, int64_t z_stride,
                    int64_t rows, int64_t ntok, const int64_t *slots, float *conv_state,
                    float *conv_spec, const float *conv_w, const float *conv_b, int64_t width,
                    float *gdn_state, float *gdn_spec, int64_t k1, const float *A,
                    const float *dt_bias, int64_t hk, int64_t h, int64_t dk, int64_t dv,
                    int l2norm, float scale, const float *norm_w, float eps, int64_t group,
                    float *out, int threads) {
    const int64_t qk = hk * dk, vd = h * dv, c = 2 * qk + vd;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(rows * (2 * c + 2 * qk + 4 * vd +
                                                                  3 * h) + 2 * dv * threads));
    int64_t *rw = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * rows));
    if (!buf || !rw) {
        free(buf);
        free(rw);
        return -1;
    }
    float *xin = buf, *y = xin + rows * c, *qs = y + rows * c, *ks = qs + rows * qk;
    float *vs = ks + rows * qk, *beta = vs + rows * vd, *gate = beta + rows * h;
    float *sp = gate + rows * h, *o = sp + rows * h, *zs = o + rows * vd, *ot = zs + rows * vd;
    float *gscratch = ot + rows * vd;
    for (int64_t i = 0; i < ntok; i++) {
        const token_io_t io = token_io(slots, rows, i, k1, rw, conv_state, conv_spec,
                                       gdn_state, gdn_spec);
        gather_rows(qkv + i * qkv_stride, qkv_stride * ntok, rows, c, xin);
        conv_step_rw(xin, io.conv_read, io.rs, io.ws, conv_w, conv_b, rows, c, width, 1, y,
                     io.conv_write);
        for (int64_t r = 0; r < rows; r++) {
            memcpy(qs + r * qk, y + r * c, qk * sizeof(float));
            memcpy(ks + r * qk, y + r * c + qk, qk * sizeof(float));
            memcpy(vs + r * vd, y + r * c + 2 * qk, vd * sizeof(float));
        }
        gather_rows(b + i * b_stride, b_stride * ntok, rows, h, beta);
        elementwise(0, beta, rows * h, beta, threads);
        softplus_bias(a + i * a_stride, a_stride * ntok, dt_bias, rows, h, sp, threads);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < h; j++) gate[r * h + j] = A[j] * sp[r * h + j];
        gdn_step_rw(qs, ks, vs, gate, beta, io.state_read, io.rs, io.ws, rows, h, hk, dk, dv,
                    l2norm, scale, o, io.state_write, threads);
        gather_rows(z + i * z_stride, z_stride * ntok, rows, vd, zs); /* norm rows: heads */
        gated_rms_norm_rows(o, dv, zs, dv, rows * h, dv, group, norm_w, eps, 1, ot, gscratch,
                            threads);
        for (int64_t r = 0; r < rows; r++)
            memcpy(out + (r * ntok + i) * vd, ot + r * vd, vd * sizeof(float));
    }
    free(buf);
    free(rw);
    return 0;
}

/* A speculative step's commit: for each state pair p and each row r, the state slot
 * mains[p] + slots[r] gets the spec entry specs[p] + (slots[r], idx[r]) (each `bytes[p]` long,
 * k1 entries per slot). One call for every recurrent layer's states (torch's advanced indexing
 * took ~27 us a pair for a 1-row commit, most of it not the copy). */
void promote_states(int64_t pairs, const int64_t *mains, const int64_t *specs,
                    const int64_t *bytes, int64_t k1, const int64_t *slots, const int64_t *idx,
                    int64_t rows, int threads) {
    int64_t total = 0;
    for (int64_t p = 0; p < pairs; p++) total += bytes[p] * rows;
    /* NOTE: the slots written are cold (last read at the verify step's start): a copy is bound
     * by the misses in flight, which a second core doubles. hybrid-demo's commit (8 pairs,
     * 0.56 MB a row) took ~0.35 ms on one thread with the slots evicted (2-core EPYC) */
#pragma omp parallel for collapse(2) num_threads(threads) if (total >= (1 << 18) && threads > 1)
    for (int64_t p = 0; p < pairs; p++) {
        for (int64_t r = 0; r < rows; r++) {
            const size_t n = (size_t)bytes[p];
            memcpy((char *)(intptr_t)mains[p] + (size_t)slots[r] * n,
                   (const char *)(intptr_t)specs[p] + (size_t)(slots[r] * k1 + idx[r]) * n, n);
        }
    }
}
