/* One Llama-type decoder layer for the R rows of a step in one C call (issue 21):
 *     qkv = linear(normed); qk = rope(q, k heads); cache writes + attention;
 *     o = linear(attn); (res2, normed2) = add_rms_norm(res, o);
 *     gu = linear(normed2); m = silu_mul(gu); dn = linear(m);
 *     (res3, normed3) = add_rms_norm(res2, dn)   (the next layer's input norm, or the final one)
 * The graph ran these as ~9 Python calls a layer (closures, torch.empty per result, checks),
 * a quarter of a decode step on the default model. Here the same exported C functions the graph
 * called (ggml_tiled.c, row_kernels.c, attention_rows.c) are called through their addresses
 * with the same arguments, in the same order: the result is the graph's bits. Nothing of the
 * arithmetic lives in this file, so it needs no ISA flags and no OpenMP (the callees have both).
 * Built at run time by layer_rows.py.
 */
#include <stdint.h>

typedef int (*linear_fn)(int kind, int isa, const float *x, int R, int K, const uint8_t *w, int N,
                         float *y, int nthreads);
typedef void (*rope_fn)(const float *x, int64_t t, int64_t heads, int64_t d, int64_t x_stride,
                        const float *cos_, const float *sin_, int64_t rot, float *out,
                        int threads);
typedef int (*attend_fn)(const float *qk, const float *v, int64_t v_stride, int T, int Hq,
                         int Hkv, int D, int Dv, void *k_cache, void *v_cache, int page_size,
                         const int64_t *slots, int S, const int64_t *cu, const int64_t *lens,
                         const int64_t *page_table, int P, float scale, float *out,
                         int nthreads, int kv, int window, const float *sinks);
typedef void (*add_norm_fn)(const float *a, const float *b, int64_t rows, int64_t n,
                            const float *w, float eps, float *sum, float *out, int threads);
typedef void (*silu_mul_fn)(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                            float *out, int threads);

typedef struct { /* a tiled linear: ggml_tiled_linear's fixed arguments */
    int64_t kind, isa, n, k;
    const uint8_t *w;
} linear_t;

typedef struct { /* one layer, fixed at deployment (the caches and norm weights: once seen) */
    linear_fn linear;
    rope_fn rope;
    attend_fn attend;
    add_norm_fn add_norm;
    silu_mul_fn silu_mul;
    linear_t qkv, o, gate_up, down;
    int64_t hq, hkv, d, dv, n_ff, page_size, kv;
    void *k_cache, *v_cache;
    const float *w_post, *w_next;
    float scale, eps_post, eps_next;
    int64_t window;      /* sliding window (0: none) */
    const float *sinks;  /* [hq] attention sinks or NULL */
} layer_t;

typedef struct { /* one step's metadata: the same for every layer of the step */
    int64_t rows, rot, S, P, threads;
    const float *cos_, *sin_;
    const int64_t *slots, *cu, *lens, *page_table;
} step_t;

/* floats of scratch per row: qkv, qk, attn, o, res2, normed2, gu, m, dn */
int64_t layer_work_floats(const layer_t *L) {
    const int64_t h = L->o.n;
    return L->qkv.n + (L->hq + L->hkv) * L->d + L->hq * L->dv + 4 * h + L->gate_up.n + L->n_ff;
}

static int linear(const layer_t *L, const linear_t *w, const float *x, int R, float *y, int th) {
    return L->linear((int)w->kind, (int)w->isa, x, R, (int)w->k, w->w, (int)w->n, y, th);
}

/* res, normed [R, H] in; res_out, normed_out [R, H] out; work: layer_work_floats * R floats.
 * Returns 0, -1 without scratch memory (a callee's), -2 for a position outside its pages. */
int decoder_layer_rows(const layer_t *L, const step_t *st, const float *res, const float *normed,
                       float *res_out, float *normed_out, float *work) {
    const int R = (int)st->rows, th = (int)st->threads;
    const int64_t h = L->o.n, heads = L->hq + L->hkv;
    float *qkv = work, *qk = qkv + R * L->qkv.n, *attn = qk + R * heads * L->d;
    float *o = attn + R * L->hq * L->dv, *res2 = o + R * h, *normed2 = res2 + R * h;
    float *gu = normed2 + R * h, *m = gu + R * L->gate_up.n, *dn = m + R * L->n_ff;
    if (linear(L, &L->qkv, normed, R, qkv, th)) return -1;
    L->rope(qkv, R, heads, L->d, L->qkv.n, st->cos_, st->sin_, st->rot, qk, th);
    const int rc = L->attend(qk, qkv + heads * L->d, L->qkv.n, R, (int)L->hq, (int)L->hkv,
                             (int)L->d, (int)L->dv, L->k_cache, L->v_cache, (int)L->page_size,
                             st->slots, (int)st->S, st->cu, st->lens, st->page_table, (int)st->P,
                             L->scale, attn, th, (int)L->kv, (int)L->window, L->sinks);
    if (rc) return rc;
    if (linear(L, &L->o, attn, R, o, th)) return -1;
    L->add_norm(res, o, R, h, L->w_post, L->eps_post, res2, normed2, th);
    if (linear(L, &L->gate_up, normed2, R, gu, th)) return -1;
    L->silu_mul(gu, R, L->n_ff, L->gate_up.n, m, th);
    if (linear(L, &L->down, m, R, dn, th)) return -1;
    L->add_norm(res2, dn, R, h, L->w_next, L->eps_next, res_out, normed_out, th);
    return 0;
}
