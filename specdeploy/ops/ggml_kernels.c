/* y[R, N] = x[R, K] @ W^T for W stored as llama.cpp (GGUF) blocks: Q4_1, Q8_0, Q4_0, Q5_0, Q5_1,
 * IQ4_NL and MXFP4, and IQ4_XS and
 * the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value super-blocks; see kquant_values), and
 * the IQ1 / IQ2 / IQ3 kinds (ggml_iq.c); F16 / BF16 matrices too (half8).
 *
 * Weights stay in their 4.5 / 8.5 bits per value and are expanded in registers; x and y are
 * fp32 and every weight is exactly the fp32 value gguf's dequantization gives (d * q + m), so
 * only the order of the fp32 sums differs from a matmul over the dequantized matrix. Batch
 * invariant: an output (r, n) is computed by the same instruction sequence for every R, so a
 * 1-row decode and a K + 1-row verify give bit-identical rows.
 *
 * Built at run time by specdeploy/ops/ggml_linear.py (gcc -O3 -mavx2 -mfma -mf16c). Threads:
 * OpenMP over output rows; torch's CPU build loads libgomp.so.1 first, so this shares its pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_GROUP 4   /* input rows sharing one expansion of a weight block */
#define OUT_TILE 32   /* output rows per tile: the tile's weights stay in cache across groups */

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* sum over one 32-value block of x times the block's 4 x 8 integer values */
static inline __m256 block_dot(const float *xb, __m256 q0, __m256 q1, __m256 q2, __m256 q3) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xb), q0);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), q1, s);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), q2, s);
    return _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), q3, s);
}

/* The kernel kinds (ggml_linear.py's KINDS) and their 32-value blocks:
 *   Q4_1 (20 bytes): d (f16), m (f16), qs[16]; w = d * q + m
 *   Q8_0 (34 bytes): d (f16), qs[32] int8;    w = d * q
 *   Q4_0 (18 bytes): d (f16), qs[16];         w = d * (q - 8)
 *   Q5_0 (22 bytes): d (f16), qh[4], qs[16];  w = d * (q - 16)
 *   Q5_1 (24 bytes): d, m (f16), qh[4], qs[16]; w = d * q + m
 *   IQ4_NL (18 bytes): d (f16), qs[16];       w = d * KVALUES[q] (ggml's non-linear int8 table)
 *   MXFP4 (17 bytes): e (E8M0), qs[16];       w = 2^(e - 128) * E2M1X2[q] (ggml's e8m0-half
 *                     times its doubled E2M1 table: integers times a power of two, exact)
 * In the 4-bit kinds value i is the low nibble of qs[i] and value i + 16 the high one; the 5-bit
 * kinds add bit i of the little-endian 32-bit qh as bit 4 of value i. For Q4_1 and Q5_1,
 * y = sum_b d_b * dot(x_b, q_b) + m_b * sum(x_b), the block sums of x precomputed (xsum).
 * MXFP4's d and integers are those of its Q8_0 rewrite (d = 2^(e - 128) in fp16, q the table's
 * integer), so both give the same fp32 values and the same bits here. */
enum { Q4_1 = 0, Q8_0 = 1, Q4_0 = 2, MXFP4 = 6, Q5_0 = 7, Q5_1 = 8, IQ4_NL = 9, IQ4_XS = 10,
       Q3_K = 11, Q2_K = 12 };
/* kvalues_iq4nl: IQ4_NL's and IQ4_XS's values of a nibble */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
#define HAS_M(kind) ((kind) == Q4_1 || (kind) == Q5_1)
#define IS_Q5(kind) ((kind) == Q5_0 || (kind) == Q5_1)

static const int8_t E2M1X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: 2^(e - 128) from its bits (e < 2: fp32 subnormals) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline int block_bytes(int kind) {
    return kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == MXFP4 ? 17 : kind == Q5_0 ? 22
           : kind == Q5_1 ? 24 : 18; /* Q4_0, IQ4_NL */
}

/* a 5-bit block's bit 4 of each value: bytes 0..31 of `out`, 16 where bit i of qh is set */
static inline __m256i q5_high(const uint8_t *qhp) {
    uint32_t qh;
    memcpy(&qh, qhp, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
        3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                            _mm256_set1_epi8(16));
}

/* One group of rg (<= ROW_GROUP) input rows over output rows t0..t1. `rg` and `kind` are
 * constants at each call (BLOCK_TILE below): the accumulators stay in registers and each kind
 * compiles to its own loop; every rg runs the same arithmetic per row (batch invariance). */
static inline __attribute__((always_inline)) void block_group(
    const float *x, const float *xsum, int K, const uint8_t *w, int t0, int t1, int N, float *y,
    int r0, const int rg, const int kind) {
    const int nb = K / 32, bytes = block_bytes(kind);
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i table = _mm_loadu_si128((const __m128i *)(kind == IQ4_NL ? KVALUES : E2M1X2));
    for (int n = t0; n < t1; n++) {
        const uint8_t *row = w + (size_t)n * nb * bytes;
        __m256 acc[ROW_GROUP];
        float macc[ROW_GROUP];
        for (int r = 0; r < rg; r++) {
            acc[r] = _mm256_setzero_ps();
            macc[r] = 0.f;
        }
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            const __m256 d = _mm256_set1_ps(kind == MXFP4 ? e8m0_half(blk[0]) : half_at(blk));
            __m128i l, h;  /* the block's 32 values as int8, 0..15 / 16..31 */
            if (kind == Q8_0) {
                const __m256i qa = _mm256_loadu_si256((const __m256i *)(blk + 2));
                l = _mm256_castsi256_si128(qa);
                h = _mm256_extracti128_si256(qa, 1);
            } else {
                const __m128i q = _mm_loadu_si128((const __m128i *)(
                    blk + (kind == Q4_1 ? 4 : kind == MXFP4 ? 1 : kind == Q5_0 ? 6
                           : kind == Q5_1 ? 8 : 2)));
                l = _mm_and_si128(q, mask);
                h = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                if (IS_Q5(kind)) {
                    const __m256i hi = q5_high(blk + (kind == Q5_0 ? 2 : 4));
                    l = _mm_or_si128(l, _mm256_castsi256_si128(hi));
                    h = _mm_or_si128(h, _mm256_extracti128_si256(hi, 1));
                    if (kind == Q5_0) {
                        l = _mm_sub_epi8(l, _mm_set1_epi8(16));
                        h = _mm_sub_epi8(h, _mm_set1_epi8(16));
                    }
                } else if (kind == MXFP4 || kind == IQ4_NL) {
                    l = _mm_shuffle_epi8(table, l);
                    h = _mm_shuffle_epi8(table, h);
                } else if (kind == Q4_0) {
                    l = _mm_sub_epi8(l, eight);
                    h = _mm_sub_epi8(h, eight);
                }
            }
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8)));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h, 8)));
            const float m = HAS_M(kind) ? half_at(blk + 2) : 0.f;
            for (int r = 0; r < rg; r++) {
                const float *xb = x + (size_t)(r0 + r) * K + b * 32;
                acc[r] = _mm256_fmadd_ps(d, block_dot(xb, q0, q1, q2, q3), acc[r]);
                if (HAS_M(kind))
                    macc[r] = __builtin_fmaf(m, xsum[(size_t)(r0 + r) * nb + b], macc[r]);
            }
        }
        for (int r = 0; r < rg; r++)
            y[(size_t)(r0 + r) * N + n] = HAS_M(kind) ? hsum8(acc[r]) + macc[r] : hsum8(acc[r]);
    }
}

#define BLOCK_TILE(NAME, KIND)                                                                 \
    static void NAME(const float *x, const float *xsum, int R, int K, const uint8_t *w, int n0, \
                     int n1, int N, float *y) {                                                \
        for (int t0 = n0; t0 < n1; t0 += OUT_TILE) {                                           \
            const int t1 = t0 + OUT_TILE < n1 ? t0 + OUT_TILE : n1;                            \
            for (int r0 = 0; r0 < R; r0 += ROW_GROUP) {                                        \
                switch (R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP) {                             \
                case 1: block_group(x, xsum, K, w, t0, t1, N, y, r0, 1, KIND); break;          \
                case 2: block_group(x, xsum, K, w, t0, t1, N, y, r0, 2, KIND); break;          \
                case 3: block_group(x, xsum, K, w, t0, t1, N, y, r0, 3, KIND); break;          \
                default: block_group(x, xsum, K, w, t0, t1, N, y, r0, 4, KIND); break;         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
BLOCK_TILE(q4_1_tile, Q4_1)
BLOCK_TILE(q8_0_tile, Q8_0)
BLOCK_TILE(q4_0_tile, Q4_0)
BLOCK_TILE(mxfp4_tile, MXFP4)
BLOCK_TILE(q5_0_tile, Q5_0)
BLOCK_TILE(q5_1_tile, Q5_1)
BLOCK_TILE(iq4_nl_tile, IQ4_NL)

/* K-quants: 256-value super-blocks (llama.cpp's QK_K), as gguf-py lays them out:
 *   Q4_K (144 bytes): d, dmin (f16), 12 bytes of 6-bit scales / mins for 8 sub-blocks of 32,
 *                     qs[128]: sub-block j = nibble (j & 1) of qs[32 * (j >> 1) + i];
 *                     w = (d * sc_j) * q - dmin * m_j
 *   Q5_K (176 bytes): as Q4_K with qh[32] after the scales: bit j of qh[i] is bit 4 of q
 *   Q6_K (210 bytes): ql[128], qh[64], int8 scales[16] (one per 16 values), d (f16) last;
 *                     group g of 32: low 4 bits = nibble ((g >> 1) & 1) of ql[64 * (g >> 2) +
 *                     32 * (g & 1) + i], high 2 = bits 2 * (g & 3) of qh[32 * (g >> 2) + i];
 *                     w = (d * sc_(v / 16)) * (q - 32)
 *   Q2_K (84 bytes): scales[16] (per 16 values: low nibble sc, high nibble m), qs[64], d, dmin
 *                     (f16): group g's values bits 2 (g & 3) of qs[32 (g >> 2) + i] (0..3);
 *                     w = (d * sc) * q - dmin * m
 *   Q3_K (110 bytes): hmask[32], qs[64], 12 bytes of 6-bit scales (one per 16 values), d (f16):
 *                     group g of 32: low 2 bits = bits 2 (g & 3) of qs[32 (g >> 2) + i], minus 4
 *                     where bit g of hmask[i] is clear; scale s (values 16 s ..): low 4 bits
 *                     nibble (s >> 3) of byte s & 7, high 2 bits 2 (s >> 2) of byte 8 + (s & 3),
 *                     minus 32; w = (d * sc) * q
 *   IQ4_XS (136 bytes): d (f16), scales_h (u16), scales_l[4], qs[128]: group g's 6-bit scale
 *                     ls = nibble (g & 1) of scales_l[g >> 1] | bits 2g, 2g + 1 of scales_h << 4,
 *                     its values nibbles of qs[16 g + i] (low: i, high: i + 16);
 *                     w = (d * (ls - 32)) * KVALUES[q] (both products exact in fp32)
 * Each value is rounded as gguf-py's numpy dequantization rounds it (products, then the
 * difference: -ffp-contract=off). The kernel expands each 8 values in registers and multiplies
 * them into up to ROW_GROUP input rows' accumulators. */
enum { Q4_K = 3, Q5_K = 4, Q6_K = 5 };

static inline int kquant_bytes(int kind) {
    return kind == Q4_K ? 144 : kind == Q5_K ? 176 : kind == IQ4_XS ? 136 : kind == Q3_K ? 110
           : kind == Q2_K ? 84 : 210;
}

/* Q3_K's 6-bit scale s (0..15), minus 32 */
static inline int q3_k_scale(const uint8_t *b, int s) {
    const int lo = (b[96 + (s & 7)] >> 4 * (s >> 3)) & 0xF;
    const int hi = (b[104 + (s & 3)] >> 2 * (s >> 2)) & 3;
    return (lo | hi << 4) - 32;
}

/* The 32 values of one sub-block group as fp32 (scale * q, minus the offset where `with_off`: a
 * product, then a difference, as numpy rounds), 8 at a time: into `w` (`w` non-NULL), else
 * multiplied into the accumulators of the `rg` rows at x[r] (the same FMA order for every rg).
 * Scales and offsets per 16 values: s_lo / off_lo for values 0-15, s_hi / off_hi for 16-31. */
static inline __attribute__((always_inline)) void use32_off2(
    __m256i q, __m256 s_lo, __m256 s_hi, __m256 off_lo, __m256 off_hi, const int with_off,
    float *w, const float *const *x, __m256 *acc, const int rg) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; k++) {
        __m256 v = _mm256_mul_ps(k < 2 ? s_lo : s_hi,
                                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[k])));
        if (with_off) v = _mm256_sub_ps(v, k < 2 ? off_lo : off_hi);
        if (w) _mm256_storeu_ps(w + 8 * k, v);
        for (int r = 0; r < rg; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + 8 * k), v, acc[r]);
    }
}

static inline __attribute__((always_inline)) void use32(
    __m256i q, __m256 s_lo, __m256 s_hi, __m256 off, const int with_off, float *w,
    const float *const *x, __m256 *acc, const int rg) {
    use32_off2(q, s_lo, s_hi, off, off, with_off, w, x, acc, rg);
}

/* One super-block: its values into `w`, or (w NULL) its dot with the rg rows x[r] (each x[r]
 * at the super-block's first value) added to acc[r]. */
static inline __attribute__((always_inline)) void kquant_block(
    const int kind, const uint8_t *b, float *w, const float *const *x, __m256 *acc,
    const int rg) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const float *xs[ROW_GROUP];
    if (kind == Q2_K) {
        const float d = half_at(b + 80), dmin = half_at(b + 82);
        for (int g = 0; g < 8; g++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g >> 2)));
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(l, 2 * (g & 3)),
                                               _mm256_set1_epi8(3));
            const uint8_t s0 = b[2 * g], s1 = b[2 * g + 1];
            for (int r = 0; r < rg; r++) xs[r] = x[r] + 32 * g;
            const __m256 sl = _mm256_set1_ps(d * (float)(s0 & 0xF));
            const __m256 sh = _mm256_set1_ps(d * (float)(s1 & 0xF));
            const __m256 ml = _mm256_set1_ps(dmin * (float)(s0 >> 4));
            const __m256 mh = _mm256_set1_ps(dmin * (float)(s1 >> 4));
            use32_off2(q, sl, sh, ml, mh, 1, w ? w + 32 * g : NULL, xs, acc, rg);
        }
        return;
    }
    if (kind == Q3_K) {
        const float d = half_at(b + 108);
        const __m256i three = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b), one = _mm256_set1_epi8(1);
        for (int g = 0; g < 8; g++) {
            const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (g >> 2)));
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l, 2 * (g & 3)), three);
            /* 4 where bit g of hmask is clear */
            const __m256i off = _mm256_andnot_si256(
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, g), one), 2), four);
            const __m256i q = _mm256_sub_epi8(lo, off);
            const float s0 = d * (float)q3_k_scale(b, 2 * g);
            const float s1 = d * (float)q3_k_scale(b, 2 * g + 1);
            for (int r = 0; r < rg; r++) xs[r] = x[r] + 32 * g;
            use32(q, _mm256_set1_ps(s0), _mm256_set1_ps(s1), _mm256_setzero_ps(), 0,
                  w ? w + 32 * g : NULL, xs, acc, rg);
        }
        return;
    }
    if (kind == IQ4_XS) {
        const float d = half_at(b);
        const uint16_t sh = (uint16_t)(b[2] | b[3] << 8);
        const __m128i table = _mm_loadu_si128((const __m128i *)KVALUES), m4 = _mm_set1_epi8(0x0F);
        for (int g = 0; g < 8; g++) {
            const int ls = ((b[4 + (g >> 1)] >> 4 * (g & 1)) & 0xF) | ((sh >> 2 * g) & 3) << 4;
            const float dl = d * (float)(ls - 32);
            const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * g));
            const __m256i q = _mm256_set_m128i(
                _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4)),
                _mm_shuffle_epi8(table, _mm_and_si128(raw, m4)));
            const __m256 dv = _mm256_set1_ps(dl);
            for (int r = 0; r < rg; r++) xs[r] = x[r] + 32 * g;
            use32(q, dv, dv, _mm256_setzero_ps(), 0, w ? w + 32 * g : NULL, xs, acc, rg);
        }
        return;
    }
    if (kind == Q6_K) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        const __m256i three = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
        for (int g = 0; g < 8; g++) {
            const __m256i l = _mm256_loadu_si256(
                (const __m256i *)(b + 64 * (g >> 2) + 32 * (g & 1)));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (g >> 2)));
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l, 4 * ((g >> 1) & 1)), low4);
            const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * (g & 3)), three);
            const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)), k32);
            const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
            for (int r = 0; r < rg; r++) xs[r] = x[r] + 32 * g;
            use32(q, _mm256_set1_ps(s0), _mm256_set1_ps(s1), _mm256_setzero_ps(), 0,
                  w ? w + 32 * g : NULL, xs, acc, rg);
        }
        return;
    }
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *s = b + 4, *qs = b + (kind == Q5_K ? 48 : 16);
    const __m256i qh = kind == Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16))
                                    : _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 2) & 0x30);
        const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j >> 1)));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j & 1)), low4);
        if (kind == Q5_K)
            q = _mm256_or_si256(q, _mm256_slli_epi16(
                                       _mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
        const __m256 dv = _mm256_set1_ps(d1);
        for (int r = 0; r < rg; r++) xs[r] = x[r] + 32 * j;
        use32(q, dv, dv, _mm256_set1_ps(m1), 1, w ? w + 32 * j : NULL, xs, acc, rg);
    }
}

static void kquant_values(int kind, const uint8_t *b, float *w) {
    if (kind == Q4_K) kquant_block(Q4_K, b, w, NULL, NULL, 0);
    else if (kind == Q5_K) kquant_block(Q5_K, b, w, NULL, NULL, 0);
    else if (kind == IQ4_XS) kquant_block(IQ4_XS, b, w, NULL, NULL, 0);
    else if (kind == Q3_K) kquant_block(Q3_K, b, w, NULL, NULL, 0);
    else if (kind == Q2_K) kquant_block(Q2_K, b, w, NULL, NULL, 0);
    else kquant_block(Q6_K, b, w, NULL, NULL, 0);
}

static inline __attribute__((always_inline)) void kquant_group(
    const int kind, const float *x, int K, const uint8_t *w, int n0, int n1, int N, float *y,
    int r0, const int rg) {
    const int nb = K / 256, bytes = kquant_bytes(kind);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nb * bytes;
        __m256 acc[ROW_GROUP];
        const float *xr[ROW_GROUP];
        for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            for (int r = 0; r < rg; r++) xr[r] = x + (size_t)(r0 + r) * K + b * 256;
            kquant_block(kind, row + (size_t)b * bytes, NULL, xr, acc, rg);
        }
        for (int r = 0; r < rg; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]);
    }
}

/* NAME(x, R, K, w, n0, n1, N, y): outputs n0..n1 in tiles of OUT_TILE, rows in groups of
 * ROW_GROUP, each group by GROUP(KIND, x, K, w, t0, t1, N, y, r0, rg) with rg a constant */
#define ROW_GROUPS_TILE(NAME, GROUP, KIND)                                                     \
    static void NAME(const float *x, int R, int K, const uint8_t *w, int n0, int n1, int N,    \
                     float *y) {                                                               \
        for (int t0 = n0; t0 < n1; t0 += OUT_TILE) {                                           \
            const int t1 = t0 + OUT_TILE < n1 ? t0 + OUT_TILE : n1;                            \
            for (int r0 = 0; r0 < R; r0 += ROW_GROUP) {                                        \
                switch (R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP) {                             \
                case 1: GROUP(KIND, x, K, w, t0, t1, N, y, r0, 1); break;                      \
                case 2: GROUP(KIND, x, K, w, t0, t1, N, y, r0, 2); break;                      \
                case 3: GROUP(KIND, x, K, w, t0, t1, N, y, r0, 3); break;                      \
                default: GROUP(KIND, x, K, w, t0, t1, N, y, r0, 4); break;                     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
#define KQUANT_TILE(NAME, KIND) ROW_GROUPS_TILE(NAME, kquant_group, KIND)
KQUANT_TILE(q4_k_tile, Q4_K)
KQUANT_TILE(q5_k_tile, Q5_K)
KQUANT_TILE(q6_k_tile, Q6_K)
KQUANT_TILE(iq4_xs_tile, IQ4_XS)
KQUANT_TILE(q3_k_tile, Q3_K)
KQUANT_TILE(q2_k_tile, Q2_K)

#include "ggml_iq.c"

/* F16 / BF16 weights (a GGUF's full-precision matrices) as rows of 32-value "blocks" of 64
 * bytes: each 8 values widened to fp32 exactly (F16C; BF16 by a 16-bit shift), then the same
 * 8-lane fmas per row as the other kinds. Half the bytes of fp32 weights, the fp32 model. */
enum { F16 = 20, BF16 = 21 };
#define IS_HALF(kind) ((kind) == F16 || (kind) == BF16)

static inline __attribute__((always_inline)) __m256 half8(const uint8_t *p, const int kind) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return kind == F16 ? _mm256_cvtph_ps(h)
                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __attribute__((always_inline)) void half_group(
    const int kind, const float *x, int K, const uint8_t *w, int t0, int t1, int N, float *y,
    int r0, const int rg) {
    for (int n = t0; n < t1; n++) {
        const uint8_t *row = w + (size_t)n * K * 2;
        __m256 acc[ROW_GROUP];
        for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
        for (int j = 0; j < K; j += 8) {
            const __m256 wv = half8(row + 2 * (size_t)j, kind);
            for (int r = 0; r < rg; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)(r0 + r) * K + j), wv, acc[r]);
        }
        for (int r = 0; r < rg; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]);
    }
}

/* Calls of > ROW_GROUP rows (prefill): outputs in pairs, 2 x rg accumulators, each x load
 * feeding two fmas (one output at a time, rg fmas wait on rg + 1 loads; the tile's weights are
 * re-read from cache by every row group). Every (row, output) sums in the same order: the same
 * bits as half_group. At <= 4 rows (one row group, the weights streamed from memory once) the
 * single-output loop is faster (pairs took 1.2x / 1.5x its time at 1 / 4 rows); above, pairs
 * take 0.88x / 0.72x at 64 / 256 rows (ad hoc A/B of the two builds alternating, 30 layers of
 * SmolLM2's matrices as BF16, 2 threads, 2-core AVX2 EPYC, 2026-12-07). */
static inline __attribute__((always_inline)) void half_pair_group(
    const int kind, const float *x, int K, const uint8_t *w, int t0, int t1, int N, float *y,
    int r0, const int rg) {
    int n = t0;
    for (; n + 2 <= t1; n += 2) {
        const uint8_t *row0 = w + (size_t)n * K * 2, *row1 = row0 + (size_t)K * 2;
        __m256 acc0[ROW_GROUP], acc1[ROW_GROUP];
        for (int r = 0; r < rg; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
        for (int j = 0; j < K; j += 8) {
            const __m256 w0 = half8(row0 + 2 * (size_t)j, kind);
            const __m256 w1 = half8(row1 + 2 * (size_t)j, kind);
            for (int r = 0; r < rg; r++) {
                const __m256 xv = _mm256_loadu_ps(x + (size_t)(r0 + r) * K + j);
                acc0[r] = _mm256_fmadd_ps(xv, w0, acc0[r]);
                acc1[r] = _mm256_fmadd_ps(xv, w1, acc1[r]);
            }
        }
        for (int r = 0; r < rg; r++) {
            y[(size_t)(r0 + r) * N + n] = hsum8(acc0[r]);
            y[(size_t)(r0 + r) * N + n + 1] = hsum8(acc1[r]);
        }
    }
    if (n < t1) half_group(kind, x, K, w, n, t1, N, y, r0, rg);
}

ROW_GROUPS_TILE(f16_tile, half_group, F16)
ROW_GROUPS_TILE(bf16_tile, half_group, BF16)
ROW_GROUPS_TILE(f16_pair_tile, half_pair_group, F16)
ROW_GROUPS_TILE(bf16_pair_tile, half_pair_group, BF16)

/* an IQ block's 256 fp32 values, exactly gguf's (f * s * w: every product exact, ggml_iq.c) */
static void iq_values(int kind, const uint8_t *b, float *v) {
    int8_t w[256];
    int s[16];
    const float f = _cvtsh_ss(iq_decode(kind, b, w, s)) * iq_f_mul(kind);
    for (int i = 0; i < 256; i++) v[i] = f * (float)s[i >> 4] * (float)w[i];
}

/* the IQ kinds: each super-block expanded once per group of rows, then 8-lane fp32 fmas */
static void iq_exact_tile(int kind, const float *x, int R, int K, const uint8_t *w, int n0,
                          int n1, int N, float *y) {
    const int nk = K / 256, bytes = iq_bytes(kind);
    float v[256] __attribute__((aligned(32)));
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        for (int r0 = 0; r0 < R; r0 += ROW_GROUP) {
            const int rg = R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP;
            __m256 acc[ROW_GROUP];
            for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
            for (int k = 0; k < nk; k++) {
                iq_values(kind, row + (size_t)k * bytes, v);
                for (int r = 0; r < rg; r++) {
                    const float *xr = x + (size_t)(r0 + r) * K + (size_t)k * 256;
                    for (int j = 0; j < 32; j++)
                        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * j),
                                                 _mm256_load_ps(v + 8 * j), acc[r]);
                }
            }
            for (int r = 0; r < rg; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]);
        }
    }
}

#ifdef _OPENMP
#include <omp.h>
#endif

/* kind: Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS or
 * an IQ kind of ggml_iq.c. x [R, K] and y [R, N] row-major fp32; w: N rows of blocks. Returns
 * 0, -1 when scratch memory could not be had, -3 for an IQ kind before ggml_iq_init (y
 * untouched). */
int ggml_linear(int kind, const float *x, int R, int K, const uint8_t *w, int N, float *y,
                int nthreads) {
    if (IS_IQ(kind) && !iq_ready) return -3;
    const int nb = K / 32;
    float *xsum = NULL;
    if (HAS_M(kind)) {
        xsum = (float *)malloc(sizeof(float) * (size_t)R * nb + 1);
        if (!xsum) return -1;
        for (int r = 0; r < R; r++)
            for (int b = 0; b < nb; b++) {
                const float *xb = x + (size_t)r * K + b * 32;
                __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
                xsum[(size_t)r * nb + b] = hsum8(s);
            }
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        /* one contiguous slice of output rows per thread */
        const int per = ((N + nt - 1) / nt + 7) / 8 * 8;
        const int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) {
            if (kind == Q4_K) q4_k_tile(x, R, K, w, n0, n1, N, y);
            else if (kind == Q5_K) q5_k_tile(x, R, K, w, n0, n1, N, y);
            else if (kind == Q6_K) q6_k_tile(x, R, K, w, n0, n1, N, y);
            else if (kind == Q4_1) q4_1_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == Q8_0) q8_0_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == MXFP4) mxfp4_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == Q5_0) q5_0_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == Q5_1) q5_1_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == IQ4_NL) iq4_nl_tile(x, xsum, R, K, w, n0, n1, N, y);
            else if (kind == IQ4_XS) iq4_xs_tile(x, R, K, w, n0, n1, N, y);
            else if (kind == Q3_K) q3_k_tile(x, R, K, w, n0, n1, N, y);
            else if (kind == Q2_K) q2_k_tile(x, R, K, w, n0, n1, N, y);
            else if (IS_IQ(kind)) iq_exact_tile(kind, x, R, K, w, n0, n1, N, y);
            else if (kind == F16)
                (R > ROW_GROUP ? f16_pair_tile : f16_tile)(x, R, K, w, n0, n1, N, y);
            else if (kind == BF16)
                (R > ROW_GROUP ? bf16_pair_tile : bf16_tile)(x, R, K, w, n0, n1, N, y);
            else q4_0_tile(x, xsum, R, K, w, n0, n1, N, y);
        }
    }
    free(xsum);
    return 0;
}

/* out[i, :] = the fp32 values of weight row rows[i] (rows NULL: row i), i < R: exactly gguf's
 * dequantization, d * q (+ m) rounded as numpy does (a product, then a sum; -ffp-contract=off
 * keeps them two operations). The fp32 path of prefill chunks dequantizes one layer at a time
 * into a reused buffer with this, and embeddings gather their rows from the blocks. */
void ggml_dequant(int kind, const uint8_t *w, const int64_t *rows, int R, int K, float *out,
                  int nthreads) {
    if (IS_HALF(kind)) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < R; i++) {
            const uint8_t *row = w + (size_t)(rows ? rows[i] : i) * K * 2;
            for (int j = 0; j < K; j += 8)
                _mm256_storeu_ps(out + (size_t)i * K + j, half8(row + 2 * (size_t)j, kind == F16 ? F16 : BF16));
        }
        return;
    }
    if (IS_IQ(kind)) { /* (callers load the codebooks first: ggml_linear.py's _library) */
        const int nk = K / 256, kb = iq_bytes(kind);
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < R; i++) {
            const uint8_t *row = w + (size_t)(rows ? rows[i] : i) * nk * kb;
            for (int b = 0; b < nk; b++)
                iq_values(kind, row + (size_t)b * kb, out + (size_t)i * K + b * 256);
        }
        return;
    }
    if ((kind >= Q4_K && kind <= Q6_K) || kind == IQ4_XS || kind == Q3_K || kind == Q2_K) {
        const int nk = K / 256, kb = kquant_bytes(kind);
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < R; i++) {
            const uint8_t *row = w + (size_t)(rows ? rows[i] : i) * nk * kb;
            for (int b = 0; b < nk; b++)
                kquant_values(kind, row + (size_t)b * kb, out + (size_t)i * K + b * 256);
        }
        return;
    }
    const int nb = K / 32, bytes = block_bytes(kind);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int i = 0; i < R; i++) {
        const uint8_t *row = w + (size_t)(rows ? rows[i] : i) * nb * bytes;
        float *o = out + (size_t)i * K;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            const float d = kind == MXFP4 ? e8m0_half(blk[0]) : half_at(blk);
            float *ob = o + b * 32;
            if (kind == MXFP4) {
                for (int j = 0; j < 16; j++) {
                    ob[j] = d * (float)E2M1X2[blk[1 + j] & 0x0F];
                    ob[j + 16] = d * (float)E2M1X2[blk[1 + j] >> 4];
                }
            } else if (kind == IQ4_NL) {
                for (int j = 0; j < 16; j++) {
                    ob[j] = d * (float)KVALUES[blk[2 + j] & 0x0F];
                    ob[j + 16] = d * (float)KVALUES[blk[2 + j] >> 4];
                }
            } else if (kind == Q8_0) {
                for (int j = 0; j < 32; j++) ob[j] = d * (float)(int8_t)blk[2 + j];
            } else if (IS_Q5(kind)) {
                const uint8_t *qs = blk + (kind == Q5_0 ? 6 : 8);
                uint32_t qh;
                memcpy(&qh, blk + (kind == Q5_0 ? 2 : 4), 4);
                const float m = kind == Q5_1 ? half_at(blk + 2) : 0.f;
                const int off = kind == Q5_0 ? 16 : 0;
                for (int j = 0; j < 16; j++) {
                    const int lo = ((qs[j] & 0x0F) | (int)((qh >> j & 1) << 4)) - off;
                    const int hi = ((qs[j] >> 4) | (int)((qh >> (j + 16) & 1) << 4)) - off;
                    /* Q5_1: the product, then + m (two roundings, as numpy) */
                    ob[j] = kind == Q5_1 ? d * (float)lo + m : d * (float)lo;
                    ob[j + 16] = kind == Q5_1 ? d * (float)hi + m : d * (float)hi;
                }
            } else if (kind == Q4_1) {
                const float m = half_at(blk + 2);
                for (int j = 0; j < 16; j++) {
                    ob[j] = d * (float)(blk[4 + j] & 0x0F) + m;
                    ob[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
                }
            } else {
                for (int j = 0; j < 16; j++) {
                    ob[j] = d * (float)((blk[2 + j] & 0x0F) - 8);
                    ob[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
                }
            }
        }
    }
}
