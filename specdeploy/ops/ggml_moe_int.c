/* A MoE layer's routed experts on GGUF blocks in one call, with the integer-dot kernels of
 * ggml_kernels_int.c (kernels="fast"): per layer one C call and one OpenMP region instead of
 * two ctypes calls (and their Python: gathers, activation, scatter-add) per chosen expert,
 * most of a decode step's MoE time at batch 8 where each expert gets ~1 row.
 *
 * What each output is (the same as ops/moe.py `moe_experts_loop` over ggml_linear_int calls,
 * the activation aside): the (token, slot) pairs sorted by expert, stably (token order within
 * an expert); each expert's rows through its up matrix, the activation (swiglu: silu(gate) * up
 * by row_kernels.c's silu_mul_rows, passed in as a pointer; relu2: max(h, 0)^2), its down
 * matrix; then out[t] = 0 + y_1 * w_1 + y_2 * w_2 + ... over t's pairs in that expert order.
 * gpt-oss's experts (the *_ex entry points, ops/moe_bias.py): each up row plus its expert's up
 * bias, row_kernels.c's clamped SwiGLU (passed in), each down row plus its down bias, one
 * rounding each, as the per-expert loop's `y += b` (deploy/passes/ggml_experts.py).
 * Every row goes through the kernels alone (an output never depends on R or the threads), and
 * the sum per token takes a fixed order, so a token's output is the same bits whatever tokens
 * share the call: a verify step's rows equal the decode rows they replay.
 * Compiled by ops/ggml_moe_int.py, with the flags of ggml_kernels_int.c (-ffp-contract=off).
 */
#include "ggml_kernels_int.c"

typedef void (*silu_mul_fn)(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                            float *out, int threads);

typedef void (*swiglu_oai_fn)(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                              float alpha, float limit, float *out, int threads);

enum { ACT_SWIGLU = 0, ACT_RELU2 = 1, ACT_SWIGLU_OAI = 2 };

/* what gpt-oss's experts add (NULL for the others): biases b_up [E, N_up] and b_down [E, H]
 * (either may be NULL), the clamped SwiGLU's kernel and constants */
typedef struct {
    const float *b_up, *b_down;
    swiglu_oai_fn oai;
    float alpha, limit;
} extra_t;

/* row[j] = row[j] + b[j]: one rounding, as torch's `y += b` */
static void add_bias(float *row, const float *b, int n) {
    for (int j = 0; j < n; j++) row[j] = row[j] + b[j];
}

/* -3 for an activation whose arguments are missing */
static int check_act(int act, const extra_t *x) {
    return act < 0 || act > ACT_SWIGLU_OAI || (act == ACT_SWIGLU_OAI && !(x && x->oai)) ? -3 : 0;
}

/* The P (token, slot) pairs sorted by expert, stably: expert e's are order[start[e] ..
 * start[e + 1]) (start: E + 1 zeros in), pos[p] = pair p's place; -1 without memory. */
static int sort_pairs(const int64_t *ids, size_t P, int E, size_t *start, size_t *order,
                      size_t *pos) {
    size_t *fill = (size_t *)malloc(((size_t)E + 1) * sizeof(size_t));
    if (!fill) return -1;
    for (size_t p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, ((size_t)E + 1) * sizeof(size_t));
    for (size_t p = 0; p < P; p++) {
        pos[p] = fill[ids[p]]++;
        order[pos[p]] = p;
    }
    free(fill);
    return 0;
}

/* ggml_tiled.c's ggml_tiled_grouped: rows start[e] .. start[e + 1] of x [R, K] through the
 * tiled copy of weight e (at w + e * stride), into y [R, N], in one OpenMP region */
typedef int (*tiled_fn)(int kind, int isa, const float *x, int R, int K, const int64_t *start,
                        int E, const uint8_t *w, int64_t stride, int N, float *y, int nthreads);

/* pair row h (of expert e): its up bias added in place, then the activation into o */
static void activate(float *h, int N_up, int I, int act, silu_mul_fn silu_mul,
                     const extra_t *x, int64_t e, float *o) {
    if (x && x->b_up) add_bias(h, x->b_up + e * N_up, N_up);
    if (act == ACT_SWIGLU_OAI) {
        x->oai(h, 1, I, N_up, x->alpha, x->limit, o, 1);
    } else if (act == ACT_SWIGLU) {
        silu_mul(h, 1, I, N_up, o, 1);
    } else {
        for (int j = 0; j < I; j++) {
            const float v = h[j] > 0.f ? h[j] : 0.f;
            o[j] = v * v;
        }
    }
}

/* out[r] = 0 + y_1 * w_1 + ... over row r's pairs in expert order (their places in `order`) */
static void combine(const float *ydown, const size_t *order, const size_t *pos, const float *wts,
                    int k, int H, int r, float *o) {
    size_t ps[64];
    for (int j = 0; j < H; j++) o[j] = 0.f;
    for (int j = 0; j < k; j++) {
        const size_t pj = pos[(size_t)r * k + j];
        int at = j;
        while (at > 0 && ps[at - 1] > pj) {
            ps[at] = ps[at - 1];
            at--;
        }
        ps[at] = pj;
    }
    for (int j = 0; j < k; j++) {
        const float *y = ydown + ps[j] * H, w = wts[order[ps[j]]];
        for (int i = 0; i < H; i++) o[i] = o[i] + y[i] * w;
    }
}

/* The experts on tiled copies of their blocks (ggml_tiled.c's kinds, 16-multiple outputs):
 * the pairs' rows gathered by expert, every expert's up matrix in one ggml_tiled_grouped call
 * (the tiled kernel: ~2x the per-output kernel's speed at decode sizes), the activation, the
 * down matrices likewise; the same sum per token as ggml_moe_int. up / down: E tiled copies,
 * `up_stride` / `down_stride` bytes apart. */
static int moe_tiled(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                     const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                     int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride,
                     int I, int act, silu_mul_fn silu_mul, const extra_t *ex, tiled_fn tiled,
                     float *out, int nthreads) {
    if (k < 1 || k > 64 || check_act(act, ex)) return -3;
    const size_t P = (size_t)T * k;
    for (size_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -3;
    size_t *start = (size_t *)calloc((size_t)E + 2, sizeof(size_t));
    size_t *order = (size_t *)malloc((P ? P : 1) * sizeof(size_t));
    size_t *pos = (size_t *)malloc((P ? P : 1) * sizeof(size_t));
    float *fs = (float *)malloc((P * H + P * N_up + P * I + P * H + 1) * sizeof(float));
    if (!start || !order || !pos || !fs) {
        free(start), free(order), free(pos), free(fs);
        return -1;
    }
    float *xg = fs, *hup = xg + P * H, *hact = hup + P * N_up, *ydown = hact + P * I;
    if (sort_pairs(ids, P, E, start, order, pos)) {
        free(start), free(order), free(pos), free(fs);
        return -1;
    }
    for (size_t i = 0; i < P; i++)
        memcpy(xg + i * H, x + (order[i] / k) * H, (size_t)H * sizeof(float));
    int64_t *bounds = (int64_t *)malloc(((size_t)E + 1) * sizeof(int64_t));
    if (!bounds) {
        free(start), free(order), free(pos), free(fs);
        return -1;
    }
    for (int e = 0; e <= E; e++) bounds[e] = (int64_t)start[e];
    int rc = tiled(kind_up, isa, xg, (int)P, H, bounds, E, w_up, up_stride, N_up, hup, nthreads);
    for (size_t i = 0; i < P && !rc; i++)
        activate(hup + i * N_up, N_up, I, act, silu_mul, ex, ids[order[i]], hact + i * I);
    if (!rc)
        rc = tiled(kind_down, isa, hact, (int)P, I, bounds, E, w_down, down_stride, H, ydown,
                   nthreads);
    for (size_t i = 0; i < P && !rc && ex && ex->b_down; i++)
        add_bias(ydown + i * H, ex->b_down + ids[order[i]] * H, H);
    free(bounds);
    if (!rc)
        for (int r = 0; r < T; r++) combine(ydown, order, pos, wts, k, H, r, out + (size_t)r * H);
    free(start), free(order), free(pos), free(fs);
    return rc;
}

int ggml_moe_tiled(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                   const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                   int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride,
                   int I, int act, silu_mul_fn silu_mul, tiled_fn tiled, float *out,
                   int nthreads) {
    return moe_tiled(kind_up, kind_down, isa, x, T, H, ids, wts, k, E, w_up, up_stride, N_up,
                     w_down, down_stride, I, act, silu_mul, NULL, tiled, out, nthreads);
}

/* ggml_moe_tiled with gpt-oss's biases and activation (act ACT_SWIGLU_OAI, `oai` non-NULL) */
int ggml_moe_tiled_ex(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                      const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                      int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride,
                      int I, int act, silu_mul_fn silu_mul, tiled_fn tiled, const float *b_up,
                      const float *b_down, swiglu_oai_fn oai, float alpha, float limit,
                      float *out, int nthreads) {
    const extra_t ex = {b_up, b_down, oai, alpha, limit};
    return moe_tiled(kind_up, kind_down, isa, x, T, H, ids, wts, k, E, w_up, up_stride, N_up,
                     w_down, down_stride, I, act, silu_mul, &ex, tiled, out, nthreads);
}

/* this thread's contiguous slice of n outputs (multiples of 8, as ggml_linear_int) */
static void out_slice(int n, int t, int nt, int *n0, int *n1) {
    const int per = ((n + nt - 1) / nt + 7) / 8 * 8;
    *n0 = t * per < n ? t * per : n;
    *n1 = *n0 + per < n ? *n0 + per : n;
}

/* x [T, H] fp32; ids [T, k] int64 in [0, E); wts [T, k] fp32; w_up: E experts of N_up rows of
 * `kind_up` blocks over H, `up_stride` bytes apart (swiglu: N_up = 2 I, gate rows first; relu2:
 * N_up = I); w_down: E experts of H rows over I. out [T, H]. Returns 0; -1 without scratch
 * memory; -2 for an ISA this build / CPU cannot run; -3 for an expert id out of range or k
 * outside 1 .. 64 (out untouched in those cases). */
static int moe_int(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                   const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                   int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride, int I,
                   int act, silu_mul_fn silu_mul, const extra_t *ex, float *out, int nthreads) {
    if (!ggml_int_isa_supported(isa)) return -2;
    if ((IS_IQ(kind_up) || IS_IQ(kind_down)) && !iq_ready) return -4; /* no ggml_iq_init */
    if (k < 1 || k > 64 || check_act(act, ex)) return -3;
    const size_t P = (size_t)T * k;
    for (size_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -3;
    const int nbh = H / 32, nbi = I / 32;
    /* pairs by expert, stably: start[e] .. start[e + 1]; pos[p] = flat pair index p's place */
    size_t *start = (size_t *)calloc((size_t)E + 1, sizeof(size_t));
    size_t *order = (size_t *)malloc((P ? P : 1) * sizeof(size_t));
    size_t *pos = (size_t *)malloc((P ? P : 1) * sizeof(size_t));
    int8_t *qx = (int8_t *)malloc((size_t)T * H + 1);
    int8_t *qa = (int8_t *)malloc(P * H + P * I + 1), *qh = qa + P * H;
    float *fs = (float *)malloc((2 * (size_t)T * nbh + 2 * P * nbh + 2 * P * nbi +
                                 P * N_up + P * I + P * H + 1) * sizeof(float));
    if (!start || !order || !pos || !qx || !qa || !fs) {
        free(start), free(order), free(pos), free(qx), free(qa), free(fs);
        return -1;
    }
    float *dx = fs, *sx = dx + (size_t)T * nbh;       /* x's rows quantized once */
    float *da = sx + (size_t)T * nbh, *sa = da + P * nbh; /* ... gathered per pair */
    float *dh = sa + P * nbh, *sh = dh + P * nbi;     /* the activations quantized */
    float *hup = sh + P * nbi, *hact = hup + P * N_up, *ydown = hact + P * I;
    if (sort_pairs(ids, P, E, start, order, pos)) {
        free(start), free(order), free(pos), free(qx), free(qa), free(fs);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        int n0, n1;
#pragma omp for schedule(static)
        for (int r = 0; r < T; r++)
            quantize_rows(x + (size_t)r * H, 1, H, qx + (size_t)r * H, dx + (size_t)r * nbh,
                          sx + (size_t)r * nbh);
#pragma omp for schedule(static)
        for (long long i = 0; i < (long long)P; i++) {
            const size_t r = order[i] / k;
            memcpy(qa + (size_t)i * H, qx + r * H, (size_t)H);
            memcpy(da + (size_t)i * nbh, dx + r * nbh, (size_t)nbh * sizeof(float));
            memcpy(sa + (size_t)i * nbh, sx + r * nbh, (size_t)nbh * sizeof(float));
        }
        out_slice(N_up, t, nt, &n0, &n1);
        for (int e = 0; e < E && n0 < n1; e++) {
            const size_t s0 = start[e], n = start[e + 1] - s0;
            if (!n) continue;
            const act_t a = {qa + s0 * H, da + s0 * nbh, sa + s0 * nbh};
            run_tile(kind_up, isa, &a, (int)n, H, w_up + (size_t)e * up_stride, n0, n1, N_up,
                     hup + s0 * N_up);
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (long long i = 0; i < (long long)P; i++) {
            float *o = hact + (size_t)i * I;
            activate(hup + (size_t)i * N_up, N_up, I, act, silu_mul, ex, ids[order[i]], o);
            quantize_rows(o, 1, I, qh + (size_t)i * I, dh + (size_t)i * nbi,
                          sh + (size_t)i * nbi);
        }
        out_slice(H, t, nt, &n0, &n1);
        for (int e = 0; e < E && n0 < n1; e++) {
            const size_t s0 = start[e], n = start[e + 1] - s0;
            if (!n) continue;
            const act_t a = {qh + s0 * I, dh + s0 * nbi, sh + s0 * nbi};
            run_tile(kind_down, isa, &a, (int)n, I, w_down + (size_t)e * down_stride, n0, n1,
                     H, ydown + s0 * H);
        }
#pragma omp barrier
        if (ex && ex->b_down) {
#pragma omp for schedule(static)
            for (long long i = 0; i < (long long)P; i++)
                add_bias(ydown + (size_t)i * H, ex->b_down + ids[order[i]] * H, H);
        }
#pragma omp for schedule(static)
        for (int r = 0; r < T; r++) combine(ydown, order, pos, wts, k, H, r, out + (size_t)r * H);
    }
    free(start), free(order), free(pos), free(qx), free(qa), free(fs);
    return 0;
}

int ggml_moe_int(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                 const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                 int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride, int I,
                 int act, silu_mul_fn silu_mul, float *out, int nthreads) {
    return moe_int(kind_up, kind_down, isa, x, T, H, ids, wts, k, E, w_up, up_stride, N_up,
                   w_down, down_stride, I, act, silu_mul, NULL, out, nthreads);
}

/* ggml_moe_int with gpt-oss's biases and activation (act ACT_SWIGLU_OAI, `oai` non-NULL) */
int ggml_moe_int_ex(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                    const int64_t *ids, const float *wts, int k, int E, const uint8_t *w_up,
                    int64_t up_stride, int N_up, const uint8_t *w_down, int64_t down_stride,
                    int I, int act, silu_mul_fn silu_mul, const float *b_up, const float *b_down,
                    swiglu_oai_fn oai, float alpha, float limit, float *out, int nthreads) {
    const extra_t ex = {b_up, b_down, oai, alpha, limit};
    return moe_int(kind_up, kind_down, isa, x, T, H, ids, wts, k, E, w_up, up_stride, N_up,
                   w_down, down_stride, I, act, silu_mul, &ex, out, nthreads);
}
