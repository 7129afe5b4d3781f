/* ---- wide value heads (included by attention_rows.c) -------------------------------------
 * Value widths past 256 (MLA's absorbed attention: one KV head whose key is [latent 512,
 * rope 64] and whose value is the key's first 512 dims, 16..128 query heads): the chunk
 * partials above would hold (2 + Dv) floats per (row, head, 32 keys), 8 MiB per 1,000 keys of
 * one 128-head row. Here each (row, head) instead keeps a running softmax over tiles of TK keys
 * at absolute positions (tile c: keys c*TK .. c*TK + TK - 1):
 *     m' = max(m, max_j s_j),  a = e^(m - m'),  l' = a l + sum_j e^(s_j - m'),
 *     o' = a o + sum_j e^(s_j - m') v_j  (j in order, one fma chain per dim),
 * starting from the row's first tile (o = sum, l = sum, no a), then out = o / l. Tiles in
 * order; within a tile, each score is one 8-lane fma chain over the key's dims and a fixed
 * reduction tree, the max and the sum of weights go key by key. A (row, head)'s bits follow
 * from its query and keys alone: batch and thread invariant, and the same on the scalar path
 * (which emulates the 8 lanes and the tree with fmaf) as on the AVX2 one.
 * A work item is up to WIDE_PAIRS (row, head) pairs of one KV head: each tile's keys are read
 * from the cache (and widened) once per item and serve all of its rows and heads; o
 * accumulates in `out` itself. Scratch per thread: TK (D + Dv) + 2 HS TK + 2 WIDE_PAIRS floats
 * (the values' TK Dv only where they are not the keys' leading dims): ~150 KB at 576 / 512 in
 * one cache, whatever the context length; plus the work item list, 5 ints per item (about
 * one per WIDE_PAIRS (row, head) pairs: linear in the rows, not the keys). TK 64: the tile
 * (147 KB of fp32 keys) stays in L2 while each pass over it serves HS heads. */
#define TK 64
#define WIDE_PAIRS 128
#define HS 6 /* heads a kernel pass serves (12 accumulators of 16 registers) */

static int wide_mode = 0; /* bit 0: every width takes this path; bit 1: the generic C kernels
                             * (and cache writes), where AVX2 would run */

static int64_t wide_calls = 0; /* calls of attend_wide so far (tests: the path ran) */

int64_t attention_rows_wide_calls(void) { return __atomic_load_n(&wide_calls, __ATOMIC_RELAXED); }

int attention_rows_wide_mode(int mode) { /* the switch (tests); returns the previous value */
    const int before = wide_mode;
    if (mode >= 0) wide_mode = mode;
    return before;
}

/* the generic C kernels: asked for (wide_mode bit 1), or a CPU without AVX2 + FMA + F16C */
static int wide_generic(void) {
    __builtin_cpu_init();
    return (wide_mode & 2) || !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
           !__builtin_cpu_supports("f16c");
}

typedef struct { /* rows t0..t1-1 of piece `piece`, heads h0..h1-1 (all of KV head h0 / rep) */
    int piece, t0, t1, h0, h1;
} witem_t;

typedef struct { /* the kernels a path supplies: bit-identical between paths */
    void (*widen)(const uint8_t *cache, int64_t row_bytes, int64_t off, int n,
                  const int64_t *pages, int page_size, int lo, int hi, float *dst, int kv);
    /* s[r * TK + j] = scale * q[r] . k[j], r < nh (<= HS), j = j0..j1-1 (j1 - j0 even) */
    void (*dots)(const float *const *q, int nh, const float *k, int D, int j0, int j1,
                 float scale, float *s);
    /* p[j] = e^(s[j] - m), j = j0..j1-1 */
    void (*expw)(const float *s, float m, float *p, int j0, int j1);
    /* o[r] = (first ? 0 : a[r] o[r]) + sum_{j0 <= j < j1} p[r * TK + j] v[j], r < nh <= HS */
    void (*pv)(float *const *o, const float *a, int nh, int first, const float *p, int j0,
               int j1, const float *v, int64_t vs, int Dv);
} wops_t;

/* ---- scalar kernels ---- */
static float exp_neg_s(float x) { /* exp_neg's lanes, one at a time: the same bits */
    x = x > -87.f ? x : -87.f;
    const float n = __builtin_rintf(x * 1.44269504f);
    float r = fmaf(-n, 0.693145752f, x);
    r = fmaf(-n, 1.42860677e-6f, r);
    float p = 1.f / 720;
    p = fmaf(p, r, 1.f / 120);
    p = fmaf(p, r, 1.f / 24);
    p = fmaf(p, r, 1.f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    const uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float two;
    __builtin_memcpy(&two, &e, 4);
    return p * two;
}

static float half_s(uint16_t h) { /* fp16 bits -> fp32, exact */
    const uint32_t s = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t u;
    if (ex == 0x1F) u = s | 0x7F800000u | (m << 13);
    else if (ex) u = s | ((ex + 112) << 23) | (m << 13);
    else if (!m) u = s;
    else {
        float f = (float)m * (1.f / 16777216.f); /* m 2^-24: exact */
        __builtin_memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static float f8_s(uint8_t b) { /* float8_e4m3fn bits -> fp32, exact (load8_f8's lanes) */
    const uint32_t em = b & 0x7Fu;
    float f;
    if (em == 0x7F) f = NAN;
    else if (em < 8) f = (float)em * (1.f / 512);
    else {
        const uint32_t u = (em << 20) + (120u << 23);
        __builtin_memcpy(&f, &u, 4);
    }
    return b & 0x80 ? -f : f;
}

static void widen_s(const uint8_t *cache, int64_t row_bytes, int64_t off, int n,
                    const int64_t *pages, int page_size, int lo, int hi, float *dst, int kv) {
    for (int j = lo; j < hi; j++) {
        const uint8_t *src = cache + ((size_t)pages[j / page_size] * page_size + j % page_size) * row_bytes + off;
        float *d = dst + (size_t)(j - lo) * n;
        if (kv == KV_F32) { __builtin_memcpy(d, src, (size_t)n * 4); continue; }
        if (kv == KV_F8) {
            for (int x = 0; x < n; x++) d[x] = f8_s(src[x]);
            continue;
        }
        if (kv == KV_F8E5) {
            for (int x = 0; x < n; x++) d[x] = half_s((uint16_t)(src[x] << 8));
            continue;
        }
        const uint16_t *h = (const uint16_t *)src;
        for (int x = 0; x < n; x++) {
            if (kv == KV_BF16) {
                const uint32_t u = (uint32_t)h[x] << 16;
                __builtin_memcpy(d + x, &u, 4);
            } else {
                d[x] = half_s(h[x]);
            }
        }
    }
}

static float dot_s(const float *q, const float *k, int D) { /* dot8's lanes and hsum8's tree */
    float a[8] = {0};
    for (int d = 0; d < D; d += 8)
        for (int u = 0; u < 8; u++) a[u] = fmaf(q[d + u], k[d + u], a[u]);
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static void dots_s(const float *const *q, int nh, const float *k, int D, int j0, int j1,
                   float scale, float *s) {
    for (int r = 0; r < nh; r++)
        for (int j = j0; j < j1; j++) s[r * TK + j] = dot_s(q[r], k + (size_t)j * D, D) * scale;
}

static void expw_s(const float *s, float m, float *p, int j0, int j1) {
    for (int j = j0; j < j1; j++) p[j] = exp_neg_s(s[j] - m);
}

static void pv_s(float *const *o, const float *a, int nh, int first, const float *p, int j0,
                 int j1, const float *v, int64_t vs, int Dv) {
    for (int r = 0; r < nh; r++)
        for (int x = 0; x < Dv; x++) {
            float acc = first ? 0.f : a[r] * o[r][x];
            for (int j = j0; j < j1; j++) acc = fmaf(p[r * TK + j], v[(size_t)j * vs + x], acc);
            o[r][x] = acc;
        }
}

/* ---- AVX2 kernels ---- */
AVX2 static void widen_v(const uint8_t *cache, int64_t row_bytes, int64_t off, int n,
                         const int64_t *pages, int page_size, int lo, int hi, float *dst, int kv) {
    widen(cache, row_bytes, off, n, pages, page_size, lo, hi, dst, kv);
}

/* NR heads x 2 keys a pass: 2 NR accumulators; each key vector, streamed from L2 (a tile is
 * larger than L1), serves NR heads */
AVX2 static inline __attribute__((always_inline)) void dots_nr(
    const float *const *q, const float *k, int D, int j0, int j1, float scale, float *s,
    const int NR) {
    for (int j = j0; j < j1; j += 2) {
        __m256 a[HS][2];
        for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float *k0 = k + (size_t)j * D;
        for (int d = 0; d < D; d += 8) {
            const __m256 kv0 = _mm256_loadu_ps(k0 + d), kv1 = _mm256_loadu_ps(k0 + D + d);
            for (int r = 0; r < NR; r++) {
                const __m256 qv = _mm256_loadu_ps(q[r] + d);
                a[r][0] = _mm256_fmadd_ps(qv, kv0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(qv, kv1, a[r][1]);
            }
        }
        for (int r = 0; r < NR; r++) {
            s[r * TK + j] = hsum8(a[r][0]) * scale;
            s[r * TK + j + 1] = hsum8(a[r][1]) * scale;
        }
    }
}

AVX2 static void dots_v(const float *const *q, int nh, const float *k, int D, int j0, int j1,
                        float scale, float *s) {
    switch (nh) {
    case 1: dots_nr(q, k, D, j0, j1, scale, s, 1); break;
    case 2: dots_nr(q, k, D, j0, j1, scale, s, 2); break;
    case 3: dots_nr(q, k, D, j0, j1, scale, s, 3); break;
    case 4: dots_nr(q, k, D, j0, j1, scale, s, 4); break;
    case 5: dots_nr(q, k, D, j0, j1, scale, s, 5); break;
    default: dots_nr(q, k, D, j0, j1, scale, s, 6); break;
    }
}

AVX2 static void expw_v(const float *s, float m, float *p, int j0, int j1) {
    const __m256 mv = _mm256_set1_ps(m);
    int j = j0;
    for (; j + 8 <= j1; j += 8)
        _mm256_storeu_ps(p + j, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)));
    for (; j < j1; j++) p[j] = exp_neg_s(s[j] - m);
}

/* NR heads x 2 vectors of dims a pass: each value vector loaded once for the NR heads */
AVX2 static inline __attribute__((always_inline)) void pv_nr(
    float *const *o, const float *a, int first, const float *p, int j0, int j1,
    const float *v, int64_t vs, int x, const int NR, const int NV) {
    __m256 acc[HS][2];
    for (int r = 0; r < NR; r++) {
        const __m256 av = _mm256_set1_ps(a[r]);
        for (int u = 0; u < NV; u++)
            acc[r][u] = first ? _mm256_setzero_ps()
                              : _mm256_mul_ps(av, _mm256_loadu_ps(o[r] + x + 8 * u));
    }
    for (int j = j0; j < j1; j++) {
        const float *vr = v + (size_t)j * vs + x;
        __m256 vv[2];
        for (int u = 0; u < NV; u++) vv[u] = _mm256_loadu_ps(vr + 8 * u);
        for (int r = 0; r < NR; r++) {
            const __m256 w = _mm256_set1_ps(p[r * TK + j]);
            for (int u = 0; u < NV; u++) acc[r][u] = _mm256_fmadd_ps(w, vv[u], acc[r][u]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int u = 0; u < NV; u++) _mm256_storeu_ps(o[r] + x + 8 * u, acc[r][u]);
}

#define PV_CASES(NV)                                                    \
    switch (nh) {                                                       \
    case 1: pv_nr(o, a, first, p, j0, j1, v, vs, x, 1, NV); break;      \
    case 2: pv_nr(o, a, first, p, j0, j1, v, vs, x, 2, NV); break;      \
    case 3: pv_nr(o, a, first, p, j0, j1, v, vs, x, 3, NV); break;      \
    case 4: pv_nr(o, a, first, p, j0, j1, v, vs, x, 4, NV); break;      \
    case 5: pv_nr(o, a, first, p, j0, j1, v, vs, x, 5, NV); break;      \
    default: pv_nr(o, a, first, p, j0, j1, v, vs, x, 6, NV); break;     \
    }

AVX2 static void pv_v(float *const *o, const float *a, int nh, int first, const float *p, int j0,
                      int j1, const float *v, int64_t vs, int Dv) {
    int x = 0;
    for (; x + 16 <= Dv; x += 16) PV_CASES(2)
    for (; x < Dv; x += 8) PV_CASES(1)
}

static const wops_t wide_scalar = {widen_s, dots_s, expw_s, pv_s};
static const wops_t wide_avx2 = {widen_v, dots_v, expw_v, pv_v};

/* whether the values are the keys' leading dims (one cache): read from the widened keys */
static int wide_shared(const attn_t *A) {
    return A->v_cache == A->k_cache && A->v_row == (int64_t)A->Hkv * A->D && A->v_head == A->D;
}

/* one work item. scratch: kt [TK, D], vt [TK, Dv], s and p [HS, TK] each, m l [WIDE_PAIRS] */
static void wide_item(const attn_t *A, const piece_t *pc, const witem_t *it, float *kt,
                      float *vt, float *s, float *p, float *m, float *l, const wops_t *op) {
    const int D = A->D, Dv = A->Dv, rep = A->Hq / A->Hkv, g = it->h0 / rep;
    const int nh = it->h1 - it->h0, es = kv_bytes(A->kv);
    const int pos_lo = pc->pos0 + (it->t0 - pc->t0), pos_hi = pc->pos0 + (it->t1 - 1 - pc->t0);
    const int shared = wide_shared(A);
    const float *v = shared ? kt : vt;
    const int64_t vs = shared ? D : Dv;
    for (int c = first_key(A, pos_lo) / TK; c <= pos_hi / TK; c++) {
        const int lo = c * TK, hi = pos_hi + 1 < lo + TK ? pos_hi + 1 : lo + TK;
        op->widen(A->k_cache, (int64_t)A->Hkv * D * es, (int64_t)g * D * es, D, pc->pages,
                  A->page_size, lo, hi, kt, A->kv);
        if (!shared)
            op->widen(A->v_cache, A->v_row * es, (int64_t)g * A->v_head * es, Dv, pc->pages,
                      A->page_size, lo, hi, vt, A->kv);
        for (int t = it->t0; t < it->t1; t++) {
            const int pos = pc->pos0 + (t - pc->t0), fk = first_key(A, pos);
            if (pos < lo || fk >= lo + TK) continue;
            const int n = pos + 1 - lo < TK ? pos + 1 - lo : TK;
            const int j0 = fk > lo ? fk - lo : 0, first = c == fk / TK;
            /* whole pairs of keys: one outside [j0, n) is computed and never used (its row
             * was widened, or holds an earlier tile's key) */
            const int d0 = j0 & ~1, d1 = (n + 1) & ~1;
            /* the item's heads in nb passes of near-equal size (8 heads: 4 + 4, not 6 + 2) */
            const int nb = (nh + HS - 1) / HS;
            for (int b = 0, h = it->h0; b < nb; b++) {
                const int nr = nh / nb + (b < nh % nb);
                const float *q[HS];
                float *o[HS], a[HS];
                for (int r = 0; r < nr; r++) {
                    q[r] = A->q + (size_t)t * A->q_row + (size_t)(h + r) * D;
                    o[r] = A->out + ((size_t)t * A->Hq + h + r) * Dv;
                }
                op->dots(q, nr, kt, D, d0, d1, A->scale, s);
                for (int r = 0; r < nr; r++) {
                    const int i = (t - it->t0) * nh + (h + r - it->h0);
                    const float *sr = s + r * TK;
                    float mt = first ? -INFINITY : m[i];
                    for (int j = j0; j < n; j++) mt = sr[j] > mt ? sr[j] : mt;
                    a[r] = first ? 0.f : exp_neg_s(m[i] - mt);
                    op->expw(sr, mt, p + r * TK, j0, n);
                    float sum = 0.f;
                    for (int j = j0; j < n; j++) sum += p[r * TK + j];
                    l[i] = first ? sum : a[r] * l[i] + sum;
                    m[i] = mt;
                }
                op->pv(o, a, nr, first, p, j0, n, v, vs, Dv);
                h += nr;
            }
        }
    }
    for (int t = it->t0; t < it->t1; t++)
        for (int h = it->h0; h < it->h1; h++) {
            const int i = (t - it->t0) * nh + (h - it->h0);
            float scale = 1.f / l[i];
            if (A->sinks) { /* the sink's term joins the denominator: rescale to max(m, sink) */
                const float sk = A->sinks[h], M = sk > m[i] ? sk : m[i];
                const float a = exp_neg_s(m[i] - M);
                scale = a * (1.f / (a * l[i] + exp_neg_s(sk - M)));
            }
            float *o = A->out + ((size_t)t * A->Hq + h) * Dv;
            for (int x = 0; x < Dv; x++) o[x] *= scale;
        }
}

static int attend_wide(const attn_t *A, const piece_t *segs, int S, int T, int nthreads) {
    __atomic_add_fetch(&wide_calls, 1, __ATOMIC_RELAXED);
    const wops_t *op = wide_generic() ? &wide_scalar : &wide_avx2;
    const int rep = A->Hq / A->Hkv, th = nthreads > 0 ? nthreads : 1;
    /* heads per item: up to 64 (the item's o rows stay in L2), fewer until every thread has
     * one; then rows to fill WIDE_PAIRS */
    int hb = rep < 64 ? rep : 64;
    while (hb > 1 && (int64_t)T * A->Hkv * ((rep + hb - 1) / hb) < th) hb = (hb + 1) / 2;
    const int rb = WIDE_PAIRS / hb > 0 ? WIDE_PAIRS / hb : 1;
    int64_t count = 0;
    for (int i = 0; i < S; i++)
        count += (int64_t)((segs[i].t1 - segs[i].t0 + rb - 1) / rb) * A->Hkv * ((rep + hb - 1) / hb);
    witem_t *items = (witem_t *)malloc(sizeof(witem_t) * (size_t)(count > 0 ? count : 1));
    if (!items) return -1;
    int64_t k = 0;
    for (int i = 0; i < S; i++)
        for (int t = segs[i].t0; t < segs[i].t1; t += rb)
            for (int g = 0; g < A->Hkv; g++)
                for (int h = 0; h < rep; h += hb)
                    items[k++] = (witem_t){i, t, t + rb < segs[i].t1 ? t + rb : segs[i].t1,
                                           g * rep + h, g * rep + (h + hb < rep ? h + hb : rep)};
    int failed = 0;
    const int vdims = wide_shared(A) ? 0 : A->Dv; /* values read from the widened keys */
    const size_t floats = (size_t)TK * (A->D + vdims) + 2 * HS * TK + 2 * WIDE_PAIRS;
#pragma omp parallel num_threads(th) reduction(| : failed)
    {
        float *kt = (float *)calloc(floats, sizeof(float));
        failed |= !kt;
        /* NOTE: every thread reaches the worksharing loop, even one without scratch */
#pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < count; x++) {
            if (!kt) continue;
            float *vt = kt + (size_t)TK * A->D, *s = vt + (size_t)TK * vdims;
            wide_item(A, &segs[items[x].piece], &items[x], kt, vt, s, s + HS * TK,
                      s + 2 * HS * TK, s + 2 * HS * TK + WIDE_PAIRS, op);
        }
        free(kt);
    }
    free(items);
    return failed ? -1 : 0;
}
