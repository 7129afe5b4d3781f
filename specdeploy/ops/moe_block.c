/* A MoE layer's whole block for the R rows of a step in one C call (the CPU fast path):
 *     logits = router(x); (ids, wts) = route(logits)            (sigmoid + groups, or softmax)
 *     e = [lat_out](experts([lat_in](x), ids, wts))             (NemotronH's latent projections)
 *     s = sh_down(act(sh_up(x)))                                (relu2, or swiglu)
 *     [s = sigmoid(gate(x)) * s]                                (Qwen3.5's shared-expert gate)
 *     out = e + s
 * The graph ran these as ~12 Python calls a layer (closures that check their inputs and allocate
 * their results, getitems, views, two or three torch elementwise ops): at batch 1 more time than
 * the arithmetic. Here the same exported C functions the graph called (ggml_tiled.c,
 * ggml_kernels_int.c, linear_rows.c, row_kernels.c, ggml_moe_int.c) are called through their
 * addresses with the same arguments; relu2, the gate's product and the sum are one rounding
 * each, as torch's relu / square / mul / add: the result is the graph's bits. No arithmetic of
 * its own that could round otherwise, so no ISA flags and no OpenMP (the callees have both).
 * Built at run time by moe_block.py.
 */
#include <stdint.h>

typedef int (*q_linear_fn)(int kind, int isa, const float *x, int R, int K, const void *w, int N,
                           float *y, int nthreads);
typedef void (*f_linear_fn)(const float *x, int64_t R, int64_t K, const void *w, int64_t N,
                            const float *b, float *y, int threads);
typedef void (*route_fn)(const float *logits, int64_t rows, int64_t e, const float *bias,
                         int64_t k, int mode, int64_t n_group, int64_t topk_group, int renorm,
                         float scale, int64_t *ids, float *weights, float *scratch, int threads);
typedef void (*silu_mul_fn)(const float *x, int64_t rows, int64_t n, int64_t x_stride,
                            float *out, int threads);
typedef void (*elementwise_fn)(int op, const float *x, int64_t n, float *out, int threads);
typedef int (*moe_tiled_fn)(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                            const int64_t *ids, const float *wts, int k, int E,
                            const void *w_up, int64_t up_stride, int N_up, const void *w_down,
                            int64_t down_stride, int I, int act, void *silu_mul, void *tiled,
                            float *out, int nthreads);
typedef int (*moe_int_fn)(int kind_up, int kind_down, int isa, const float *x, int T, int H,
                          const int64_t *ids, const float *wts, int k, int E, const void *w_up,
                          int64_t up_stride, int N_up, const void *w_down, int64_t down_stride,
                          int I, int act, void *silu_mul, float *out, int nthreads);

typedef struct { /* one linear: a block kernel's (kind >= 0) or linear_rows' (kind < 0) call */
    void *fn;
    int64_t kind, isa, n, k; /* n == 0: absent */
    const void *w;
    const float *b; /* linear_rows only */
} linear_t;

typedef struct { /* ggml_moe_tiled's / ggml_moe_int's fixed arguments */
    void *fn;
    int64_t tiled, kind_up, kind_down, isa, e, up_stride, n_up, down_stride, i, act;
    const void *w_up, *w_down;
    void *silu_mul, *tiled_fn;
} experts_t;

typedef struct {
    linear_t router, lat_in, lat_out, sh_up, sh_down, gate;
    experts_t ex;
    route_fn route;
    silu_mul_fn silu_mul;
    elementwise_fn elementwise;
    int64_t k, mode, n_group, topk_group, renorm, sh_act, sh_ff, sigmoid_op;
    float scale;
    const float *corr; /* the sigmoid router's selection bias, or NULL */
} moe_block_t;

enum { ACT_RELU2 = 0, ACT_SWIGLU = 1 };

static int64_t up8(int64_t floats) { return (floats + 15) & ~(int64_t)15; } /* 64-byte steps */

/* floats of scratch for R rows at `threads` threads */
int64_t moe_block_work_floats(const moe_block_t *B, int64_t R, int64_t threads) {
    const int64_t h = B->sh_down.n, hx = B->lat_in.n ? B->lat_in.n : h;
    const int64_t act = B->sh_act == ACT_SWIGLU ? B->sh_ff : B->sh_up.n;
    return up8(R * B->router.n) + up8(2 * R * B->k) + up8(R * B->k) + up8(B->router.n * threads)
           + up8(R * hx) + up8(R * hx) + up8(R * h) + up8(R * B->sh_up.n) + up8(R * act)
           + up8(R * h) + 2 * up8(R);
}

static int linear(const linear_t *L, const float *x, int64_t R, float *y, int th) {
    if (L->kind < 0) {
        ((f_linear_fn)L->fn)(x, R, L->k, L->w, L->n, L->b, y, th);
        return 0;
    }
    return ((q_linear_fn)L->fn)((int)L->kind, (int)L->isa, x, (int)R, (int)L->k, L->w,
                                (int)L->n, y, th);
}

/* x [R, H] in; out [R, H]; work: moe_block_work_floats(B, R, threads) floats.
 * Returns 0, -1 without scratch memory (a callee's), -3 for expert ids out of range. */
int moe_block_rows(const moe_block_t *B, const float *x, int64_t R, float *out, float *work,
                   int th) {
    const int64_t h = B->sh_down.n, hx = B->lat_in.n ? B->lat_in.n : h, E = B->router.n;
    const int64_t act_n = B->sh_act == ACT_SWIGLU ? B->sh_ff : B->sh_up.n;
    float *logits = work;
    int64_t *ids = (int64_t *)(logits + up8(R * E));
    float *wts = (float *)ids + up8(2 * R * B->k), *rscratch = wts + up8(R * B->k);
    float *xl = rscratch + up8(E * th), *ex = xl + up8(R * hx), *e = ex + up8(R * hx);
    float *su = e + up8(R * h), *sa = su + up8(R * B->sh_up.n), *sd = sa + up8(R * act_n);
    float *g = sd + up8(R * h), *gs = g + up8(R);

    if (linear(&B->router, x, R, logits, th)) return -1;
    B->route(logits, R, E, B->corr, B->k, (int)B->mode, B->n_group, B->topk_group,
             (int)B->renorm, B->scale, ids, wts, rscratch, th);
    const float *xe = x;
    if (B->lat_in.n) {
        if (linear(&B->lat_in, x, R, xl, th)) return -1;
        xe = xl;
    }
    const experts_t *X = &B->ex;
    float *eo = B->lat_out.n ? ex : e;
    int rc;
    if (X->tiled)
        rc = ((moe_tiled_fn)X->fn)((int)X->kind_up, (int)X->kind_down, (int)X->isa, xe, (int)R,
                                   (int)hx, ids, wts, (int)B->k, (int)X->e, X->w_up,
                                   X->up_stride, (int)X->n_up, X->w_down, X->down_stride,
                                   (int)X->i, (int)X->act, X->silu_mul, X->tiled_fn, eo, th);
    else
        rc = ((moe_int_fn)X->fn)((int)X->kind_up, (int)X->kind_down, (int)X->isa, xe, (int)R,
                                 (int)hx, ids, wts, (int)B->k, (int)X->e, X->w_up, X->up_stride,
                                 (int)X->n_up, X->w_down, X->down_stride, (int)X->i,
                                 (int)X->act, X->silu_mul, eo, th);
    if (rc) return rc;
    if (B->lat_out.n && linear(&B->lat_out, ex, R, e, th)) return -1;

    if (linear(&B->sh_up, x, R, su, th)) return -1;
    const int64_t nu = B->sh_up.n;
    if (B->sh_act == ACT_SWIGLU) {
        B->silu_mul(su, R, B->sh_ff, nu, sa, th);
    } else { /* torch.square(torch.relu(v)): relu keeps NaN, square of +-0 is +0 */
        for (int64_t j = 0; j < R * nu; j++) {
            const float v = su[j];
            const float r = v > 0.0f ? v : (v != v ? v : 0.0f);
            sa[j] = r * r;
        }
    }
    if (linear(&B->sh_down, sa, R, sd, th)) return -1;
    if (B->gate.n) {
        if (linear(&B->gate, x, R, g, th)) return -1;
        B->elementwise((int)B->sigmoid_op, g, R, gs, th);
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < h; j++) sd[r * h + j] = gs[r] * sd[r * h + j];
    }
    for (int64_t j = 0; j < R * h; j++) out[j] = e[j] + sd[j];
    return 0;
}
