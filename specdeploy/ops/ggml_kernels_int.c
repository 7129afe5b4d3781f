/* y[R, N] = x[R, K] @ W^T with W in GGUF blocks (Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL; the K-quants
 * and IQ4_XS below) and x quantized per row to 8-bit blocks of 32 as llama.cpp does for its
 * integer dot products (Q8_0 / Q8_1 activations):
 * per block d = max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|), and (for Q4_1's
 * offset m) the block's exact fp32 sum of x. Unlike llama.cpp the activation scale stays fp32
 * (not fp16) and Q4_1's m term uses the exact sum, not d * sum(q): both cost nothing and drop
 * two roundings. Per weight block the dot product is exact in integers, then
 *     y += (d_w * d_x) * p_j   for its 8 partial sums p_j (4 consecutive values each),
 * accumulated in 8 fp32 lanes over the blocks and summed in one fixed order at the end.
 *
 * Every ISA path (portable scalar C, AVX2, AVX-512 VNNI) computes exactly those integers and
 * those fp32 operations in that order, so all three give bit-identical outputs, and an output
 * (r, n) never depends on R or the thread count (batch invariance: a 1-row decode and a K + 1-row
 * verify give the same rows). The file is compiled without -m flags; the SIMD functions carry
 * their own target attributes and run only where the CPU reports those features at run time.
 * Built at run time by specdeploy/ops/ggml_linear.py. Must be compiled with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#define SD_X86 1
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

enum { Q4_1 = 0, Q8_0 = 1, Q4_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, Q5_0 = 7, Q5_1 = 8,
       IQ4_NL = 9, IQ4_XS = 10, Q3_K = 11, Q2_K = 12 };
/* (ggml_linear.py's KINDS; 6 is MXFP4, which this file does not read; 13-19 the IQ1 / IQ2 / IQ3
 * kinds of ggml_iq.c) */
#define IS_KQ(kind) ((kind) >= Q4_K && (kind) <= Q6_K)
/* 256-value super-blocks of 8 groups, each with its own scale(s): the K-quants, IQ4_XS */
#define IS_SUPER(kind) (IS_KQ(kind) || (kind) == IQ4_XS || (kind) == Q3_K || (kind) == Q2_K)
#define KQ_HAS_MIN(kind) ((kind) == Q4_K || (kind) == Q5_K) /* - m1 * sum(x) per group */
#define KQ_SIGNED(kind) ((kind) == Q6_K || (kind) == IQ4_XS || (kind) == Q3_K)
/* the wide paths' signed kinds taken as |w| times x with w's sign (Q6_K: shifted by 32) */
#define WIDE_SIGNED(kind) ((kind) == IQ4_XS || (kind) == Q3_K)
/* kvalues_iq4nl: IQ4_NL's and IQ4_XS's values of a nibble (|w| <= 127: the signed products) */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
#define IS_Q5(kind) ((kind) == Q5_0 || (kind) == Q5_1)
/* the kinds with an offset m per block (w = d * q + m): unsigned values, m * sum(x) apart */
#define HAS_M(kind) ((kind) == Q4_1 || (kind) == Q5_1)
#include "ggml_iq.c"
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 }; /* ggml_linear.py's ISAS */
#define ROW_GROUP 4 /* input rows sharing one expansion of a weight block */
#define OUT_TILE 32 /* output rows per tile: their weights stay in cache across row groups */

typedef struct {
    const int8_t *q; /* [R, K] the quantized rows */
    const float *d;  /* [R, nb] block scales */
    const float *s;  /* [R, nb] exact block sums of x (Q4_1) */
} act_t;

static int block_bytes(int kind) {
    return kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == Q4_0 ? 18 : kind == Q4_K ? 144
           : kind == Q5_K ? 176 : kind == Q5_0 ? 22 : kind == Q5_1 ? 24 : kind == IQ4_NL ? 18
           : kind == IQ4_XS ? 136 : kind == Q3_K ? 110 : kind == Q2_K ? 84 : 210;
}

/* Q5_0 (22 bytes: d, qh[4], qs[16]) and Q5_1 (24: d, m, qh[4], qs[16]): value i's low 4 bits
 * as Q4_0 / Q4_1's (nibble of qs[i % 16]), its bit 4 bit i of the little-endian qh;
 * w = d * (q - 16) / d * q + m (gguf-py's dequantization) */
static int q5_qh(int kind) { return kind == Q5_0 ? 2 : 4; }
static int q5_qs(int kind) { return kind == Q5_0 ? 6 : 8; }

/* always inlined: a call from the AVX2 code into SSE-encoded code would pay the AVX-SSE
 * transition (measured: Q4_K's AVX2 path 10x slower than its scalar one) */
static inline __attribute__((always_inline)) float half_to_float(uint16_t h) { /* exact */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0x1F) bits = sign | 0x7F800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) bits = sign;
    else { /* subnormal half: normalize */
        int shift = 0;
        uint32_t mm = m;
        while (!(mm & 0x400)) { mm <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mm & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __attribute__((always_inline)) float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* K-quants (256-value super-blocks; layouts in ggml_kernels.c): each 32-value group g of a
 * super-block is one activation block. Its weights as integers: Q4_K / Q5_K q in 0..31 with
 * w = d1 * q - m1 (d1 = d * sc_g, m1 = dmin * m_g, both exact in fp32), Q6_K q - 32 in -32..31
 * with w = (d * sc) * (q - 32), one scale per 16 values (lanes 0-3 of the 8 partial sums, then
 * 4-7). So per group: y += (scale_lane * d_x) * p_lane, and for Q4_K / Q5_K - m1 * sum(x), as
 * Q4_1's offset. */
/* IQ4_XS (136 bytes: d, scales_h (u16), scales_l[4], qs[128]): group g's 6-bit scale ls, its
 * values KVALUES of the nibbles of qs[16 g + i] (low: value i, high: i + 16); w = (d * (ls - 32))
 * * KVALUES[q], one scale a group as Q4_K, no minimum */
static inline __attribute__((always_inline)) int iq4_xs_ls(const uint8_t *b, int g) {
    const int sh = b[2] | b[3] << 8;
    return ((b[4 + (g >> 1)] >> 4 * (g & 1)) & 0xF) | ((sh >> 2 * g) & 3) << 4;
}

/* Q3_K (110 bytes: hmask[32], qs[64], scales[12], d): group g's values: bits 2 (g & 3) of
 * qs[32 (g >> 2) + i], minus 4 where bit g of hmask[i] is clear (-4..3); its scales 2g (values
 * 0-15) and 2g + 1 (16-31): scale s's low 4 bits nibble (s >> 3) of scales[s & 7], its high 2
 * bits 2 (s >> 2) of scales[8 + (s & 3)], minus 32; w = (d * sc) * q, as Q6_K */
static inline __attribute__((always_inline)) int q3_k_scale(const uint8_t *b, int s) {
    const int lo = (b[96 + (s & 7)] >> 4 * (s >> 3)) & 0xF;
    const int hi = (b[104 + (s & 3)] >> 2 * (s >> 2)) & 3;
    return (lo | hi << 4) - 32;
}

/* Q2_K (84 bytes: scales[16], qs[64], d, dmin): group g's values bits 2 (g & 3) of
 * qs[32 (g >> 2) + i] (0..3); per 16 values (g's 2g, 2g + 1) a byte: low nibble sc, high m;
 * w = (d * sc) * q - dmin * m. Its minimum meets the 4-value integer sums of x's quantized
 * values, lane by lane as the products (llama.cpp's bsums, in 4s):
 *     acc_j += (d * sc * d_x) * p_j,   acc2_j += (dmin * m * d_x) * xs_j,
 * y = sum8(acc) - sum8(acc2). kq_scales gives d * sc lo / hi; q2_k_mins dmin * m lo / hi. */
static inline __attribute__((always_inline)) void q2_k_mins(const uint8_t *b, int g, float *lo,
                                                           float *hi) {
    const float dmin = half_at(b + 82);
    *lo = dmin * (float)(b[2 * g] >> 4);
    *hi = dmin * (float)(b[2 * g + 1] >> 4);
}

static inline __attribute__((always_inline)) void kq_scales(int kind, const uint8_t *b, int g,
                                                           float *s_lo, float *s_hi, float *m) {
    if (kind == Q2_K) {
        const float d = half_at(b + 80);
        *s_lo = d * (float)(b[2 * g] & 0xF);
        *s_hi = d * (float)(b[2 * g + 1] & 0xF);
        *m = 0.f;
        return;
    }
    if (kind == Q3_K) {
        const float d = half_at(b + 108);
        *s_lo = d * (float)q3_k_scale(b, 2 * g);
        *s_hi = d * (float)q3_k_scale(b, 2 * g + 1);
        *m = 0.f;
        return;
    }
    if (kind == IQ4_XS) {
        *s_lo = *s_hi = half_at(b) * (float)(iq4_xs_ls(b, g) - 32);
        *m = 0.f;
        return;
    }
    if (kind == Q6_K) {
        const float d = half_at(b + 208);
        *s_lo = d * (float)(int8_t)b[192 + 2 * g];
        *s_hi = d * (float)(int8_t)b[193 + 2 * g];
        *m = 0.f;
        return;
    }
    const uint8_t *s = b + 4;
    const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 0xF) | ((s[g - 4] >> 2) & 0x30);
    const int mm = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30);
    *s_lo = *s_hi = half_at(b) * (float)sc;
    *m = -(half_at(b + 2) * (float)mm);
}

static void kq_ints(int kind, const uint8_t *b, int g, int *wv) {
    if (kind == Q2_K) {
        for (int i = 0; i < 32; i++) wv[i] = (b[16 + 32 * (g >> 2) + i] >> 2 * (g & 3)) & 3;
        return;
    }
    if (kind == Q3_K) {
        for (int i = 0; i < 32; i++)
            wv[i] = ((b[32 + 32 * (g >> 2) + i] >> 2 * (g & 3)) & 3) - ((b[i] >> g & 1) ? 0 : 4);
        return;
    }
    if (kind == IQ4_XS) {
        for (int i = 0; i < 16; i++) {
            wv[i] = KVALUES[b[8 + 16 * g + i] & 0xF];
            wv[i + 16] = KVALUES[b[8 + 16 * g + i] >> 4];
        }
        return;
    }
    if (kind == Q6_K) {
        const uint8_t *l = b + 64 * (g >> 2) + 32 * (g & 1), *h = b + 128 + 32 * (g >> 2);
        for (int i = 0; i < 32; i++)
            wv[i] = (((l[i] >> (4 * ((g >> 1) & 1))) & 0xF) | (((h[i] >> (2 * (g & 3))) & 3) << 4))
                    - 32;
        return;
    }
    const uint8_t *q = b + (kind == Q5_K ? 48 : 16) + 32 * (g >> 1);
    for (int i = 0; i < 32; i++) {
        wv[i] = (q[i] >> (4 * (g & 1))) & 0xF;
        if (kind == Q5_K) wv[i] |= ((b[16 + i] >> g) & 1) << 4;
    }
}

/* x [R, K] -> act (portable C; R * K work, small beside the R * K * N of the dot products) */
static void quantize_rows(const float *x, int R, int K, int8_t *q, float *d, float *s) {
    const int nb = K / 32;
    for (int r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + b * 32;
            float amax = 0.f, sum = 0.f;
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
                sum += xb[i];
            }
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *qb = q + (size_t)r * K + b * 32;
            for (int i = 0; i < 32; i++) qb[i] = (int8_t)lrintf(xb[i] * id);
            /* NOTE: a NaN / inf in x must not vanish into q = 0: it poisons the block's scale */
            d[(size_t)r * nb + b] = isfinite(sum) ? amax / 127.f : NAN;
            s[(size_t)r * nb + b] = sum;
        }
}

/* the 8-lane sum in the order AVX2's hsum8 takes: (j, j + 4), then (0, 2), (1, 3), then both */
static float sum8(const float *a) {
    const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
    return (t0 + t2) + (t1 + t3);
}

/* ---- portable scalar path ---- */
static void tile_scalar_k(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0,
                          int n1, int N, float *y) {
    const int nk = K / 256, nb = K / 32, bytes = block_bytes(kind);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        for (int r = 0; r < R; r++) {
            float acc[8] = {0}, acc2[8] = {0}, macc = 0.f;
            for (int k = 0; k < nk; k++) {
                const uint8_t *b = row + (size_t)k * bytes;
                for (int g = 0; g < 8; g++) {
                    const size_t rb = (size_t)r * nb + 8 * k + g;
                    const int8_t *qx = a->q + rb * 32;
                    int wv[32];
                    float s_lo, s_hi, m, m_lo = 0.f, m_hi = 0.f;
                    kq_ints(kind, b, g, wv);
                    kq_scales(kind, b, g, &s_lo, &s_hi, &m);
                    if (kind == Q2_K) q2_k_mins(b, g, &m_lo, &m_hi);
                    for (int j = 0; j < 8; j++) {
                        int p = 0, xs = 0;
                        for (int i = 4 * j; i < 4 * j + 4; i++) p += wv[i] * qx[i], xs += qx[i];
                        acc[j] = fmaf((j < 4 ? s_lo : s_hi) * a->d[rb], (float)p, acc[j]);
                        if (kind == Q2_K)
                            acc2[j] = fmaf((j < 4 ? m_lo : m_hi) * a->d[rb], (float)xs, acc2[j]);
                    }
                    if (KQ_HAS_MIN(kind)) macc = fmaf(m, a->s[rb], macc);
                }
            }
            y[(size_t)r * N + n] = KQ_HAS_MIN(kind) ? sum8(acc) + macc
                                   : kind == Q2_K ? sum8(acc) - sum8(acc2) : sum8(acc);
        }
    }
}

static void tile_scalar(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0, int n1,
                        int N, float *y) {
    const int nb = K / 32, bytes = block_bytes(kind);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nb * bytes;
        for (int r = 0; r < R; r++) {
            float acc[8] = {0}, macc = 0.f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * bytes;
                const int8_t *qx = a->q + (size_t)r * K + b * 32;
                int wv[32];
                if (kind == Q8_0) {
                    for (int i = 0; i < 32; i++) wv[i] = (int8_t)blk[2 + i];
                } else if (kind == IQ4_NL) {
                    for (int i = 0; i < 16; i++) {
                        wv[i] = KVALUES[blk[2 + i] & 0x0F];
                        wv[i + 16] = KVALUES[blk[2 + i] >> 4];
                    }
                } else if (IS_Q5(kind)) {
                    const uint8_t *qs = blk + q5_qs(kind);
                    uint32_t qh;
                    memcpy(&qh, blk + q5_qh(kind), 4);
                    const int off = kind == Q5_0 ? 16 : 0;
                    for (int i = 0; i < 16; i++) {
                        wv[i] = ((qs[i] & 0x0F) | (int)((qh >> i & 1) << 4)) - off;
                        wv[i + 16] = ((qs[i] >> 4) | (int)((qh >> (i + 16) & 1) << 4)) - off;
                    }
                } else {
                    const uint8_t *qs = blk + (kind == Q4_1 ? 4 : 2);
                    const int off = kind == Q4_0 ? 8 : 0;
                    for (int i = 0; i < 16; i++) {
                        wv[i] = (qs[i] & 0x0F) - off;
                        wv[i + 16] = (qs[i] >> 4) - off;
                    }
                }
                const float scale = half_at(blk) * a->d[(size_t)r * nb + b];
                for (int j = 0; j < 8; j++) {
                    int p = 0;
                    for (int i = 4 * j; i < 4 * j + 4; i++) p += wv[i] * qx[i];
                    acc[j] = fmaf(scale, (float)p, acc[j]);
                }
                if (HAS_M(kind))
                    macc = fmaf(half_at(blk + 2), a->s[(size_t)r * nb + b], macc);
            }
            y[(size_t)r * N + n] = HAS_M(kind) ? sum8(acc) + macc : sum8(acc);
        }
    }
}

#ifdef SD_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c"))) static inline
#define AVX512_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

AVX2_FN float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

AVX2_FN float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* a block's 32 weight values as bytes in value order (4-bit kinds: 0..15 unsigned for Q4_1,
 * q - 8 for Q4_0; Q8_0 as stored) */
AVX2_FN __m256i weight_bytes(const uint8_t *blk, const int kind) {
    if (kind == Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    if (kind == IQ4_NL) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i mask = _mm_set1_epi8(0x0F), t = _mm_loadu_si128((const __m128i *)KVALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), mask)),
                                _mm_shuffle_epi8(t, _mm_and_si128(q, mask)));
    }
    if (IS_Q5(kind)) { /* bit i of qh to byte i (16 where set), or'ed into the nibbles */
        uint32_t qh;
        memcpy(&qh, blk + q5_qh(kind), 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
            3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
        const __m256i hi = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + q5_qs(kind)));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m256i v = _mm256_or_si256(hi, _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask)));
        return kind == Q5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (kind == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
    return kind == Q4_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(8)) : v;
}

/* the 8 exact partial sums p_j = sum of 4 consecutive w_i * q_i. maddubs multiplies unsigned
 * by signed bytes: Q4_1's weights are unsigned already; signed ones go in as |w| times q with
 * w's sign (|w| <= 128, q <= 127: no int16 pair sum saturates) */
AVX2_FN __m256i block_products(__m256i wv, __m256i wabs, __m256i qx, const int kind) {
    const __m256i pairs = HAS_M(kind) ? _mm256_maddubs_epi16(wv, qx)
                                       : _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(qx, wv));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* outputs n .. n + no - 1 (no <= 2) for rg (<= ROW_GROUP) rows; rg, no and kind are constants
 * at each call (the accumulators stay in registers). Two outputs at a time give the core two
 * independent fma chains and share each row's activation load; the operations on each
 * accumulator are the same either way (the pairing changes the schedule, not the sums). */
AVX2_FN __attribute__((always_inline)) void outputs_avx2(const act_t *a, int K, const uint8_t *w,
                                                        int n, int N, float *y, int r0,
                                                        const int rg, const int no,
                                                        const int kind) {
    const int nb = K / 32, bytes = block_bytes(kind);
    const uint8_t *row0 = w + (size_t)n * nb * bytes;
    __m256 acc[2][ROW_GROUP];
    float macc[2][ROW_GROUP];
    for (int o = 0; o < no; o++)
        for (int r = 0; r < rg; r++) {
            acc[o][r] = _mm256_setzero_ps();
            macc[o][r] = 0.f;
        }
    for (int b = 0; b < nb; b++) {
        __m256i wv[2], wabs[2];
        float dw[2], m[2];
        for (int o = 0; o < no; o++) {
            const uint8_t *blk = row0 + ((size_t)o * nb + b) * bytes;
            wv[o] = weight_bytes(blk, kind);
            wabs[o] = HAS_M(kind) ? wv[o] : _mm256_abs_epi8(wv[o]);
            dw[o] = f16_at(blk);
            m[o] = HAS_M(kind) ? f16_at(blk + 2) : 0.f;
        }
        for (int r = 0; r < rg; r++) {
            const size_t rb = (size_t)(r0 + r) * nb + b;
            const __m256i qx = _mm256_loadu_si256((const __m256i *)(a->q + rb * 32));
            const float dx = a->d[rb];
            for (int o = 0; o < no; o++) {
                const __m256 p = _mm256_cvtepi32_ps(block_products(wv[o], wabs[o], qx, kind));
                acc[o][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[o] * dx), p, acc[o][r]);
                if (HAS_M(kind)) macc[o][r] = fmaf(m[o], a->s[rb], macc[o][r]);
            }
        }
    }
    for (int o = 0; o < no; o++)
        for (int r = 0; r < rg; r++)
            y[(size_t)(r0 + r) * N + n + o] =
                HAS_M(kind) ? hsum8(acc[o][r]) + macc[o][r] : hsum8(acc[o][r]);
}

/* one group of rg rows over outputs t0..t1 */
AVX2_FN __attribute__((always_inline)) void group_avx2(const act_t *a, int K, const uint8_t *w,
                                                      int t0, int t1, int N, float *y, int r0,
                                                      const int rg, const int kind) {
    int n = t0;
    /* NOTE: Q8_0's 32-byte blocks in pairs run out of registers (measured slower) */
    if (kind != Q8_0)
        for (; n + 2 <= t1; n += 2) outputs_avx2(a, K, w, n, N, y, r0, rg, 2, kind);
    for (; n < t1; n++) outputs_avx2(a, K, w, n, N, y, r0, rg, 1, kind);
}

#define TILE_FN(NAME, GROUP, KIND, ATTR)                                                       \
    ATTR static void NAME(const act_t *a, int R, int K, const uint8_t *w, int n0, int n1, int N, \
                          float *y) {                                                          \
        for (int t0 = n0; t0 < n1; t0 += OUT_TILE) {                                           \
            const int t1 = t0 + OUT_TILE < n1 ? t0 + OUT_TILE : n1;                            \
            for (int r0 = 0; r0 < R; r0 += ROW_GROUP) {                                        \
                switch (R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP) {                             \
                case 1: GROUP(a, K, w, t0, t1, N, y, r0, 1, KIND); break;                      \
                case 2: GROUP(a, K, w, t0, t1, N, y, r0, 2, KIND); break;                      \
                case 3: GROUP(a, K, w, t0, t1, N, y, r0, 3, KIND); break;                      \
                default: GROUP(a, K, w, t0, t1, N, y, r0, 4, KIND); break;                     \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
#define AVX2_ATTR __attribute__((target("avx2,fma,f16c")))
TILE_FN(q4_1_avx2, group_avx2, Q4_1, AVX2_ATTR)
TILE_FN(q5_0_avx2, group_avx2, Q5_0, AVX2_ATTR)
TILE_FN(q5_1_avx2, group_avx2, Q5_1, AVX2_ATTR)
TILE_FN(iq4_nl_avx2, group_avx2, IQ4_NL, AVX2_ATTR)
TILE_FN(q8_0_avx2, group_avx2, Q8_0, AVX2_ATTR)
TILE_FN(q4_0_avx2, group_avx2, Q4_0, AVX2_ATTR)

/* K-quants, AVX2 (the AVX-512 path below repeats its operations: the same bits) */
AVX2_FN __m256i kq_bytes(const uint8_t *b, int g, const int kind) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (kind == Q2_K) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g >> 2)));
        return _mm256_and_si256(_mm256_srli_epi16(l, 2 * (g & 3)), _mm256_set1_epi8(3));
    }
    if (kind == Q3_K) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (g >> 2)));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l, 2 * (g & 3)),
                                            _mm256_set1_epi8(3));
        const __m256i off = _mm256_andnot_si256( /* 4 where bit g of hmask is clear */
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, g), _mm256_set1_epi8(1)), 2),
            _mm256_set1_epi8(4));
        return _mm256_sub_epi8(lo, off);
    }
    if (kind == IQ4_XS) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * g));
        const __m128i mask = _mm_set1_epi8(0x0F), t = _mm_loadu_si128((const __m128i *)KVALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(q, 4), mask)),
                                _mm_shuffle_epi8(t, _mm_and_si128(q, mask)));
    }
    if (kind == Q6_K) {
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * (g >> 2) + 32 * (g & 1)));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * (g >> 2)));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l, 4 * ((g >> 1) & 1)), low4);
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * (g & 3)),
                                            _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hb, 4)),
                               _mm256_set1_epi8(32));
    }
    const __m256i raw = _mm256_loadu_si256(
        (const __m256i *)(b + (kind == Q5_K ? 48 : 16) + 32 * (g >> 1)));
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (g & 1)), low4);
    if (kind == Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        q = _mm256_or_si256(q, _mm256_slli_epi16(
                                   _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1)),
                                   4));
    }
    return q;
}

/* a super-block's scales as kq_scales gives them, all 8 groups at once (F16C's conversion is
 * half_to_float's, exact): per group the lanes' scales lo (values 0-15) / hi (16-31), and the
 * minimum's -m1 (Q4_K / Q5_K). Once per (output, super-block), not per group and row group. */
AVX2_FN __attribute__((always_inline)) void kq_block_scales(const uint8_t *b, const int kind,
                                                           float *sc, float *mn) {
    if (kind == Q2_K) { /* sc / mn [2g], [2g + 1]: group g's lo, hi */
        const float d = f16_at(b + 80), dmin = f16_at(b + 82);
        for (int s = 0; s < 16; s++) {
            sc[s] = d * (float)(b[s] & 0xF);
            mn[s] = dmin * (float)(b[s] >> 4);
        }
        return;
    }
    if (kind == Q3_K) { /* sc[2g], sc[2g + 1]: group g's lo, hi (as Q6_K) */
        const float d = f16_at(b + 108);
        for (int s = 0; s < 16; s++) sc[s] = d * (float)q3_k_scale(b, s);
        return;
    }
    if (kind == IQ4_XS) {
        const float d = f16_at(b);
        for (int g = 0; g < 8; g++) sc[g] = d * (float)(iq4_xs_ls(b, g) - 32);
        return;
    }
    if (kind == Q6_K) { /* sc[2g], sc[2g + 1]: group g's lo, hi */
        const __m256 d = _mm256_set1_ps(f16_at(b + 208));
        const __m128i s8 = _mm_loadu_si128((const __m128i *)(b + 192));
        _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
        const __m128i s8hi = _mm_srli_si128(s8, 8);
        _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8hi))));
        return;
    }
    /* the 12 bytes of 6-bit scales and minimums: sc_g, m_g for g < 4 are the low 6 bits of
     * bytes g, g + 4; for g >= 4 the nibbles of byte g + 4 with the top 2 bits of bytes g - 4,
     * g: four 32-bit words of masks and shifts give the 8 + 8 bytes */
    uint32_t u[3], v[4];
    memcpy(u, b + 4, 12);
    v[0] = u[0] & 0x3f3f3f3fu;
    v[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    v[2] = u[1] & 0x3f3f3f3fu;
    v[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)v);
    _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(f16_at(b)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))));
    /* -(dmin * m): the product, then the sign (as kq_scales) */
    _mm256_storeu_ps(mn, _mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(
        _mm256_set1_ps(f16_at(b + 2)),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))))));
}

#ifndef KQ_PF_BYTES
#define KQ_PF_BYTES 2048
#endif
#ifndef KQ_PAIR_ROWS
#define KQ_PAIR_ROWS 2
#endif
/* outputs n .. n + no - 1 (no <= 2: two independent fma chains, each row's activation block
 * loaded once for both) for rg rows; per output and row the same operations in the same order
 * as the scalar path (tile_scalar_k): the same bits */
AVX2_FN __attribute__((always_inline)) void outputs_k_avx2(const act_t *a, int K,
                                                          const uint8_t *w, int n, int N,
                                                          float *y, int r0, const int rg,
                                                          const int no, const int kind) {
    const int nk = K / 256, nb = K / 32, bytes = block_bytes(kind);
    __m256 acc[2][ROW_GROUP], acc2[2][ROW_GROUP]; /* acc2: Q2_K's minimum terms */
    float macc[2][ROW_GROUP];
    for (int o = 0; o < no; o++)
        for (int r = 0; r < rg; r++) {
            acc[o][r] = acc2[o][r] = _mm256_setzero_ps();
            macc[o][r] = 0.f;
        }
    for (int k = 0; k < nk; k++) {
        const uint8_t *b[2];
        float sc[2][16], mn[2][16];
        for (int o = 0; o < no; o++) {
            b[o] = w + ((size_t)(n + o) * nk + k) * bytes;
            for (int l = 0; l < bytes; l += 64)
                _mm_prefetch((const char *)b[o] + KQ_PF_BYTES + l, _MM_HINT_T0);
            kq_block_scales(b[o], kind, sc[o], mn[o]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256i wv[2], wabs[2];
            __m256 sv[2], mv[2];
            for (int o = 0; o < no; o++) {
                wv[o] = kq_bytes(b[o], g, kind);
                wabs[o] = KQ_SIGNED(kind) ? _mm256_abs_epi8(wv[o]) : wv[o];
                sv[o] = kind == Q6_K || kind == Q3_K || kind == Q2_K
                            ? _mm256_setr_m128(_mm_broadcast_ss(&sc[o][2 * g]),
                                               _mm_broadcast_ss(&sc[o][2 * g + 1]))
                            : _mm256_broadcast_ss(&sc[o][g]);
                if (kind == Q2_K)
                    mv[o] = _mm256_setr_m128(_mm_broadcast_ss(&mn[o][2 * g]),
                                             _mm_broadcast_ss(&mn[o][2 * g + 1]));
            }
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + 8 * k + g;
                const __m256i qx = _mm256_loadu_si256((const __m256i *)(a->q + rb * 32));
                const __m256 dx = _mm256_set1_ps(a->d[rb]);
                __m256 xs = _mm256_setzero_ps(); /* Q2_K: x's 4-value integer sums */
                if (kind == Q2_K)
                    xs = _mm256_cvtepi32_ps(_mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_set1_epi8(1), qx), _mm256_set1_epi16(1)));
                for (int o = 0; o < no; o++) {
                    const __m256 p = _mm256_cvtepi32_ps(
                        block_products(wv[o], wabs[o], qx, KQ_SIGNED(kind) ? Q8_0 : Q4_1));
                    acc[o][r] = _mm256_fmadd_ps(_mm256_mul_ps(sv[o], dx), p, acc[o][r]);
                    if (KQ_HAS_MIN(kind)) macc[o][r] = fmaf(mn[o][g], a->s[rb], macc[o][r]);
                    if (kind == Q2_K)
                        acc2[o][r] = _mm256_fmadd_ps(_mm256_mul_ps(mv[o], dx), xs, acc2[o][r]);
                }
            }
        }
    }
    for (int o = 0; o < no; o++)
        for (int r = 0; r < rg; r++)
            y[(size_t)(r0 + r) * N + n + o] =
                KQ_HAS_MIN(kind) ? hsum8(acc[o][r]) + macc[o][r]
                : kind == Q2_K   ? hsum8(acc[o][r]) - hsum8(acc2[o][r])
                                 : hsum8(acc[o][r]);
}

AVX2_FN __attribute__((always_inline)) void group_k_avx2(const act_t *a, int K, const uint8_t *w,
                                                        int t0, int t1, int N, float *y, int r0,
                                                        const int rg, const int kind) {
    int n = t0;
    if (rg <= KQ_PAIR_ROWS)
        for (; n + 2 <= t1; n += 2) outputs_k_avx2(a, K, w, n, N, y, r0, rg, 2, kind);
    for (; n < t1; n++) outputs_k_avx2(a, K, w, n, N, y, r0, rg, 1, kind);
}

TILE_FN(q4_k_avx2, group_k_avx2, Q4_K, AVX2_ATTR)
TILE_FN(q5_k_avx2, group_k_avx2, Q5_K, AVX2_ATTR)
TILE_FN(q6_k_avx2, group_k_avx2, Q6_K, AVX2_ATTR)
TILE_FN(iq4_xs_avx2, group_k_avx2, IQ4_XS, AVX2_ATTR)
TILE_FN(q3_k_avx2, group_k_avx2, Q3_K, AVX2_ATTR)
TILE_FN(q2_k_avx2, group_k_avx2, Q2_K, AVX2_ATTR)

/* K-quants for calls of many rows on AVX2: kq_wide's scheme (below) on 8 outputs a vector.
 * Lane o of acc[j] is output o's lane j of the per-output path above; the 4-value products come
 * from maddubs (u8 weights x s8 activations, pairs summed to int16: at most 2 * 63 * 127, no
 * saturation) and madd by ones, the same int32 sums; the fp32 operations are the per-output
 * path's on each lane, so the same bits. What it saves: each group's weight bytes and scales
 * are expanded once per call (not once per 4 rows) and the scalar scale unpacking with them. */
/* Q6_K's wide paths take its values shifted by 32 (unsigned, as the u8 x s8 products need) and
 * 32 times each 4-value sum of the row's activations off again, exactly: those sums, per call
 * (malloc'd; NULL without memory) */
static int32_t *q6_corrections(const act_t *a, int R, int nb) {
    int32_t *corr = (int32_t *)malloc(((size_t)R * nb * 8 + 1) * sizeof(int32_t));
    if (corr)
        for (size_t i = 0; i < (size_t)R * nb * 8; i++)
            corr[i] = 32 * (a->q[4 * i] + a->q[4 * i + 1] + a->q[4 * i + 2] + a->q[4 * i + 3]);
    return corr;
}

#define KQ_WIDE8_MIN_ROWS 9 /* at 8 rows either path (bench/kquant_rows.py --isa avx2) */
AVX2_ATTR static void kq_wide8_expand(int kind, const uint8_t *w, int n0, int no, int K,
                                      uint8_t *wb, uint8_t *ws, float *sc) {
    const int nk = K / 256, nb = K / 32, bytes = block_bytes(kind);
    memset(wb, 0, (size_t)nb * 256);
    if (ws) memset(ws, 0, (size_t)nb * 256);
    memset(sc, 0, (size_t)nb * 24 * sizeof(float));
    const __m256i off = _mm256_set1_epi8(32);
    for (int o = 0; o < no; o++) {
        const uint8_t *row = w + (size_t)(n0 + o) * nk * bytes;
        for (int k = 0; k < nk; k++) {
            const uint8_t *b = row + (size_t)k * bytes;
            for (int g = 0; g < 8; g++) {
                const int gb = 8 * k + g;
                __m256i v = kq_bytes(b, g, kind);
                if (kind == Q6_K) v = _mm256_add_epi8(v, off); /* 0 .. 63: unsigned for maddubs */
                uint32_t quads[8], signs[8];
                /* IQ4_XS, Q3_K: |w| here, w itself in ws (the rows take x with w's sign) */
                _mm256_storeu_si256((__m256i *)quads, WIDE_SIGNED(kind) ? _mm256_abs_epi8(v) : v);
                _mm256_storeu_si256((__m256i *)signs, v);
                for (int j = 0; j < 8; j++) {
                    memcpy(wb + (((size_t)gb * 8 + j) * 8 + o) * 4, &quads[j], 4);
                    if (ws) memcpy(ws + (((size_t)gb * 8 + j) * 8 + o) * 4, &signs[j], 4);
                }
                float s_lo, s_hi, m;
                kq_scales(kind, b, g, &s_lo, &s_hi, &m);
                sc[(size_t)gb * 24 + o] = s_lo;
                sc[(size_t)gb * 24 + 8 + o] = s_hi;
                sc[(size_t)gb * 24 + 16 + o] = m;
            }
        }
    }
}

AVX2_ATTR static inline __attribute__((always_inline)) void kq_wide8_rows(
    const act_t *a, int R, int K, const uint8_t *wb, const uint8_t *ws, const float *sc,
    const int32_t *corr, int n0, int no, int N, float *y, const int kind) {
    const int nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        __m256 acc[8], macc = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int gb = 0; gb < nb; gb++) {
            const size_t rb = (size_t)r * nb + gb;
            const int8_t *xq = a->q + rb * 32;
            const __m256 dx = _mm256_set1_ps(a->d[rb]);
            const __m256 slo = _mm256_mul_ps(_mm256_loadu_ps(sc + (size_t)gb * 24), dx);
            const __m256 shi = _mm256_mul_ps(_mm256_loadu_ps(sc + (size_t)gb * 24 + 8), dx);
            const uint8_t *wg = wb + (size_t)gb * 256;
            for (int j = 0; j < 8; j++) {
                int32_t quad;
                memcpy(&quad, xq + 4 * j, 4);
                __m256i xq = _mm256_set1_epi32(quad);
                if (WIDE_SIGNED(kind)) /* |w| * (x with w's sign): pairs <= 2 * 127 * 128 */
                    xq = _mm256_sign_epi8(
                        xq, _mm256_loadu_si256((const __m256i *)(ws + (size_t)gb * 256 + 32 * j)));
                __m256i p = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * j)), xq),
                    ones);
                if (kind == Q6_K) p = _mm256_sub_epi32(p, _mm256_set1_epi32(corr[rb * 8 + j]));
                acc[j] = _mm256_fmadd_ps(j < 4 ? slo : shi, _mm256_cvtepi32_ps(p), acc[j]);
            }
            if (KQ_HAS_MIN(kind))
                macc = _mm256_fmadd_ps(_mm256_loadu_ps(sc + (size_t)gb * 24 + 16),
                                       _mm256_set1_ps(a->s[rb]), macc);
        }
        __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]),
                                               _mm256_add_ps(acc[2], acc[6])),
                                 _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]),
                                               _mm256_add_ps(acc[3], acc[7])));
        if (KQ_HAS_MIN(kind)) t = _mm256_add_ps(t, macc);
        float out[8];
        _mm256_storeu_ps(out, t);
        memcpy(y + (size_t)r * N + n0, out, (size_t)no * sizeof(float));
    }
}

/* outputs n0 .. n1 in tiles of 8; 0, or -1 when the tile buffers could not be had */
AVX2_ATTR static int kq_wide8(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0,
                              int n1, int N, float *y) {
    const int nb = K / 32;
    uint8_t *wb = (uint8_t *)aligned_alloc(64, (size_t)nb * 256);
    uint8_t *ws = WIDE_SIGNED(kind) ? (uint8_t *)aligned_alloc(64, (size_t)nb * 256) : 0;
    float *sc = (float *)aligned_alloc(64, ((size_t)nb * 24 * sizeof(float) + 63) / 64 * 64);
    /* Q6_K: the values go in shifted by 32; 32 times each row's 4-value sums, taken once */
    int32_t *corr = kind == Q6_K ? q6_corrections(a, R, nb) : 0;
    if (!wb || !sc || (kind == Q6_K && !corr) || (WIDE_SIGNED(kind) && !ws)) {
        free(wb);
        free(ws);
        free(sc);
        free(corr);
        return -1;
    }
    for (int t0 = n0; t0 < n1; t0 += 8) {
        const int no = n1 - t0 < 8 ? n1 - t0 : 8;
        kq_wide8_expand(kind, w, t0, no, K, wb, ws, sc);
        switch (kind) { /* the kind as a constant in each copy */
        case Q4_K: kq_wide8_rows(a, R, K, wb, ws, sc, corr, t0, no, N, y, Q4_K); break;
        case Q5_K: kq_wide8_rows(a, R, K, wb, ws, sc, corr, t0, no, N, y, Q5_K); break;
        case IQ4_XS: kq_wide8_rows(a, R, K, wb, ws, sc, corr, t0, no, N, y, IQ4_XS); break;
        case Q3_K: kq_wide8_rows(a, R, K, wb, ws, sc, corr, t0, no, N, y, Q3_K); break;
        default: kq_wide8_rows(a, R, K, wb, ws, sc, corr, t0, no, N, y, Q6_K); break;
        }
    }
    free(wb);
    free(ws);
    free(sc);
    free(corr);
    return 0;
}

/* K-quants, AVX-512 VNNI: the AVX2 path's operations on each accumulator (so its bits), with
 * each 32-value product by one 256-bit dpbusd (u8 weights x s8 activations, the same int32
 * lane sums as maddubs + madd; Q6_K's signed values go in shifted by 32, 32 times the 4-value
 * activation sums come off again, exactly) and 8 rows sharing one expansion of a weight group
 * instead of 4: prefill-sized calls, which stay on this kernel (ggml_calls.py), ~1.3x. */
#define ROW_GROUP_K512 8
AVX512_FN static inline __attribute__((always_inline)) void group_k_avx512(const act_t *a, int K,
                                                            const uint8_t *w, int t0, int t1,
                                                            int N, float *y, int r0,
                                                            const int rg, const int kind) {
    const int nk = K / 256, nb = K / 32, bytes = block_bytes(kind);
    const __m256i off = _mm256_set1_epi8(32);
    for (int n = t0; n < t1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        __m256 acc[ROW_GROUP_K512];
        float macc[ROW_GROUP_K512];
        for (int r = 0; r < rg; r++) {
            acc[r] = _mm256_setzero_ps();
            macc[r] = 0.f;
        }
        for (int k = 0; k < nk; k++) {
            const uint8_t *b = row + (size_t)k * bytes;
            for (int g = 0; g < 8; g++) {
                const __m256i wv = kq_bytes(b, g, kind);
                const __m256i wu = kind == Q6_K ? _mm256_add_epi8(wv, off) : wv;
                float s_lo, s_hi, m;
                kq_scales(kind, b, g, &s_lo, &s_hi, &m);
                const __m256 sv = _mm256_setr_ps(s_lo, s_lo, s_lo, s_lo, s_hi, s_hi, s_hi, s_hi);
                for (int r = 0; r < rg; r++) {
                    const size_t rb = (size_t)(r0 + r) * nb + 8 * k + g;
                    const __m256i qx = _mm256_loadu_si256((const __m256i *)(a->q + rb * 32));
                    __m256i pi = _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu, qx);
                    if (kind == Q6_K)
                        pi = _mm256_sub_epi32(pi, _mm256_dpbusd_epi32(_mm256_setzero_si256(), off, qx));
                    const __m256 p = _mm256_cvtepi32_ps(pi);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(sv, _mm256_set1_ps(a->d[rb])), p,
                                             acc[r]);
                    if (kind != Q6_K) macc[r] = fmaf(m, a->s[rb], macc[r]);
                }
            }
        }
        for (int r = 0; r < rg; r++)
            y[(size_t)(r0 + r) * N + n] = kind != Q6_K ? hsum8(acc[r]) + macc[r] : hsum8(acc[r]);
    }
}

#define TILE_FN_K512(NAME, KIND)                                                               \
    AVX512_FN static void NAME(const act_t *a, int R, int K, const uint8_t *w, int n0, int n1,  \
                               int N, float *y) {                                              \
        for (int t0 = n0; t0 < n1; t0 += OUT_TILE) {                                           \
            const int t1 = t0 + OUT_TILE < n1 ? t0 + OUT_TILE : n1;                            \
            for (int r0 = 0; r0 < R; r0 += ROW_GROUP_K512) {                                   \
                switch (R - r0 < ROW_GROUP_K512 ? R - r0 : ROW_GROUP_K512) {                   \
                case 1: group_k_avx512(a, K, w, t0, t1, N, y, r0, 1, KIND); break;             \
                case 2: group_k_avx512(a, K, w, t0, t1, N, y, r0, 2, KIND); break;             \
                case 3: group_k_avx512(a, K, w, t0, t1, N, y, r0, 3, KIND); break;             \
                case 4: group_k_avx512(a, K, w, t0, t1, N, y, r0, 4, KIND); break;             \
                case 5: group_k_avx512(a, K, w, t0, t1, N, y, r0, 5, KIND); break;             \
                case 6: group_k_avx512(a, K, w, t0, t1, N, y, r0, 6, KIND); break;             \
                case 7: group_k_avx512(a, K, w, t0, t1, N, y, r0, 7, KIND); break;             \
                default: group_k_avx512(a, K, w, t0, t1, N, y, r0, 8, KIND); break;            \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
TILE_FN_K512(q4_k_avx512, Q4_K)
TILE_FN_K512(q5_k_avx512, Q5_K)
TILE_FN_K512(q6_k_avx512, Q6_K)

/* K-quants for calls of many rows (AVX-512 VNNI): 16 outputs per vector, with the same fp32
 * operations on each output as the paths above, so the same bits. Above, one output's 8-lane
 * accumulator takes lane j's partial sum p_j of each group (values 4j .. 4j + 3); here lane j
 * of the 16 outputs lives in acc[j], one vector (lane o = output o), and every operation runs
 * on the 16 at once: acc[j] = fma(s_j * d_x, p_j, acc[j]), m * s_x into macc, then
 * ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) + macc as hsum8 adds. A tile of 16 outputs
 * is expanded once per call into bytes laid out for dpbusd (16 outputs x 4 values a vector,
 * Q6_K shifted by 32 to unsigned, its 32 * sum(x) taken off again exactly) and fp32 scales;
 * every row then runs over it, so a row costs ~1/3 of the per-output path. */
#define KQ_WIDE_MIN_ROWS 9 /* up to 8 rows: one group of the per-output path, as fast */
AVX512_FN static void kq_wide_expand(int kind, const uint8_t *w, int n0, int no, int K,
                                     uint8_t *wb, float *sc) {
    const int nk = K / 256, nb = K / 32, bytes = block_bytes(kind);
    memset(wb, 0, (size_t)nb * 512);
    memset(sc, 0, (size_t)nb * 48 * sizeof(float));
    const __m256i off = _mm256_set1_epi8(32);
    for (int o = 0; o < no; o++) {
        const uint8_t *row = w + (size_t)(n0 + o) * nk * bytes;
        for (int k = 0; k < nk; k++) {
            const uint8_t *b = row + (size_t)k * bytes;
            for (int g = 0; g < 8; g++) {
                const int gb = 8 * k + g;
                __m256i v = kq_bytes(b, g, kind);
                if (kind == Q6_K) v = _mm256_add_epi8(v, off);
                uint32_t quads[8];
                _mm256_storeu_si256((__m256i *)quads, v);
                for (int j = 0; j < 8; j++)
                    memcpy(wb + (((size_t)gb * 8 + j) * 16 + o) * 4, &quads[j], 4);
                float s_lo, s_hi, m;
                kq_scales(kind, b, g, &s_lo, &s_hi, &m);
                sc[(size_t)gb * 48 + o] = s_lo;
                sc[(size_t)gb * 48 + 16 + o] = s_hi;
                sc[(size_t)gb * 48 + 32 + o] = m;
            }
        }
    }
}

AVX512_FN static void kq_wide_rows(const act_t *a, int R, int K, const uint8_t *wb,
                                   const float *sc, const int32_t *corr, int n0, int no, int N,
                                   float *y, const int kind) {
    const int nb = K / 32;
    const __mmask16 keep = (__mmask16)((1u << no) - 1);
    for (int r = 0; r < R; r++) {
        __m512 acc[8], macc = _mm512_setzero_ps();
        for (int j = 0; j < 8; j++) acc[j] = _mm512_setzero_ps();
        for (int gb = 0; gb < nb; gb++) {
            const size_t rb = (size_t)r * nb + gb;
            const int8_t *xq = a->q + rb * 32;
            const __m512 dx = _mm512_set1_ps(a->d[rb]);
            const __m512 slo = _mm512_mul_ps(_mm512_loadu_ps(sc + (size_t)gb * 48), dx);
            const __m512 shi = _mm512_mul_ps(_mm512_loadu_ps(sc + (size_t)gb * 48 + 16), dx);
            const uint8_t *wg = wb + (size_t)gb * 512;
            for (int j = 0; j < 8; j++) {
                int32_t quad;
                memcpy(&quad, xq + 4 * j, 4);
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                _mm512_loadu_si512((const void *)(wg + 64 * j)),
                                                _mm512_set1_epi32(quad));
                if (kind == Q6_K) p = _mm512_sub_epi32(p, _mm512_set1_epi32(corr[rb * 8 + j]));
                acc[j] = _mm512_fmadd_ps(j < 4 ? slo : shi, _mm512_cvtepi32_ps(p), acc[j]);
            }
            if (kind != Q6_K)
                macc = _mm512_fmadd_ps(_mm512_loadu_ps(sc + (size_t)gb * 48 + 32),
                                       _mm512_set1_ps(a->s[rb]), macc);
        }
        __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[4]),
                                               _mm512_add_ps(acc[2], acc[6])),
                                 _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]),
                                               _mm512_add_ps(acc[3], acc[7])));
        if (kind != Q6_K) t = _mm512_add_ps(t, macc);
        _mm512_mask_storeu_ps(y + (size_t)r * N + n0, keep, t);
    }
}

/* outputs n0 .. n1 in tiles of 16; 0, or -1 when the tile buffers could not be had */
AVX512_FN static int kq_wide(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0,
                             int n1, int N, float *y) {
    const int nb = K / 32;
    uint8_t *wb = (uint8_t *)aligned_alloc(64, (size_t)nb * 512);
    float *sc = (float *)aligned_alloc(64, (size_t)nb * 48 * sizeof(float));
    int32_t *corr = kind == Q6_K ? q6_corrections(a, R, nb) : 0;
    if (!wb || !sc || (kind == Q6_K && !corr)) {
        free(wb);
        free(sc);
        free(corr);
        return -1;
    }
    for (int t0 = n0; t0 < n1; t0 += 16) {
        const int no = n1 - t0 < 16 ? n1 - t0 : 16;
        kq_wide_expand(kind, w, t0, no, K, wb, sc);
        switch (kind) { /* the kind as a constant in each copy */
        case Q4_K: kq_wide_rows(a, R, K, wb, sc, corr, t0, no, N, y, Q4_K); break;
        case Q5_K: kq_wide_rows(a, R, K, wb, sc, corr, t0, no, N, y, Q5_K); break;
        default: kq_wide_rows(a, R, K, wb, sc, corr, t0, no, N, y, Q6_K); break;
        }
    }
    free(wb);
    free(sc);
    free(corr);
    return 0;
}

/* AVX-512 VNNI: two blocks per dpbusd (u8 x s8, 4 products per int32 lane: the same p_j as
 * above). Signed weights go in shifted to unsigned (Q4_0: q as stored, w + 8; Q8_0: w + 128 by
 * flipping the sign bit) and the shift times the 4-value sums of q comes off again, exactly in
 * int32. The fp32 part then takes the two blocks one after the other in 256-bit halves, the
 * order of the AVX2 path, so the outputs are bit-identical to it. */
AVX512_FN static inline __m256i nibbles(const uint8_t *blk, int off) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(blk + off));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

AVX512_FN static inline __m512i weight_pair_u8(const uint8_t *b0, const uint8_t *b1,
                                                const int kind) {
    if (kind == Q8_0) {
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
            _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    const int off = kind == Q4_1 ? 4 : 2;
    return _mm512_inserti64x4(_mm512_castsi256_si512(nibbles(b0, off)), nibbles(b1, off), 1);
}

AVX512_FN static inline __attribute__((always_inline)) void group_avx512(
    const act_t *a, int K, const uint8_t *w, int t0, int t1, int N, float *y, int r0,
    const int rg, const int kind) {
    const int nb = K / 32, bytes = block_bytes(kind);
    const __m512i shift = _mm512_set1_epi8((char)(kind == Q8_0 ? 0x80 : 8));
    for (int n = t0; n < t1; n++) {
        const uint8_t *row = w + (size_t)n * nb * bytes;
        __m256 acc[ROW_GROUP];
        float macc[ROW_GROUP];
        for (int r = 0; r < rg; r++) {
            acc[r] = _mm256_setzero_ps();
            macc[r] = 0.f;
        }
        int b = 0;
        for (; b + 2 <= nb; b += 2) {
            const uint8_t *blk = row + b * bytes;
            const __m512i wv = weight_pair_u8(blk, blk + bytes, kind);
            const float d0 = f16_at(blk), d1 = f16_at(blk + bytes);
            const float m0 = kind == Q4_1 ? f16_at(blk + 2) : 0.f;
            const float m1 = kind == Q4_1 ? f16_at(blk + bytes + 2) : 0.f;
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + b;
                const __m512i qx = _mm512_loadu_si512((const void *)(a->q + rb * 32));
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, qx);
                if (kind != Q4_1)
                    p = _mm512_sub_epi32(p, _mm512_dpbusd_epi32(_mm512_setzero_si512(), shift, qx));
                const __m512 pf = _mm512_cvtepi32_ps(p);
                const __m256 lo = _mm512_castps512_ps256(pf);
                const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pf), 1));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a->d[rb]), lo, acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * a->d[rb + 1]), hi, acc[r]);
                if (kind == Q4_1) {
                    macc[r] = fmaf(m0, a->s[rb], macc[r]);
                    macc[r] = fmaf(m1, a->s[rb + 1], macc[r]);
                }
            }
        }
        if (b < nb) { /* an odd block count: the last block as in the AVX2 path */
            const uint8_t *blk = row + b * bytes;
            const __m256i wv = weight_bytes(blk, kind);
            const __m256i wabs = kind == Q4_1 ? wv : _mm256_abs_epi8(wv);
            const float dw = f16_at(blk), m = kind == Q4_1 ? f16_at(blk + 2) : 0.f;
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + b;
                const __m256i qx = _mm256_loadu_si256((const __m256i *)(a->q + rb * 32));
                const __m256 p = _mm256_cvtepi32_ps(block_products(wv, wabs, qx, kind));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a->d[rb]), p, acc[r]);
                if (kind == Q4_1) macc[r] = fmaf(m, a->s[rb], macc[r]);
            }
        }
        for (int r = 0; r < rg; r++)
            y[(size_t)(r0 + r) * N + n] = kind == Q4_1 ? hsum8(acc[r]) + macc[r] : hsum8(acc[r]);
    }
}

TILE_FN(q4_1_avx512, group_avx512, Q4_1, AVX512_FN)
TILE_FN(q8_0_avx512, group_avx512, Q8_0, AVX512_FN)
TILE_FN(q4_0_avx512, group_avx512, Q4_0, AVX512_FN)
#endif /* SD_X86 */

#include "ggml_iq_int.c"

/* 1 when this build and this CPU can run `isa` */
int ggml_int_isa_supported(int isa) {
    if (isa == ISA_SCALAR) return 1;
#ifdef SD_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

static void run_tile(int kind, int isa, const act_t *a, int R, int K, const uint8_t *w, int n0,
                     int n1, int N, float *y) {
    if (IS_IQ(kind)) {
#ifdef SD_X86
        if (isa != ISA_SCALAR) { /* (AVX-512 CPUs too: the same bits) */
            iq_tile_avx2(kind, a, R, K, w, n0, n1, N, y);
            return;
        }
#endif
        iq_tile_scalar(kind, a, R, K, w, n0, n1, N, y);
        return;
    }
#ifdef SD_X86
    if ((IS_Q5(kind) || kind == IQ4_NL || WIDE_SIGNED(kind) || kind == Q2_K) &&
        isa != ISA_SCALAR) {
        /* NOTE: AVX2 on AVX-512 machines too (no AVX-512 path for them: the same bits) */
        if (WIDE_SIGNED(kind) && R >= KQ_WIDE8_MIN_ROWS &&
            kq_wide8(kind, a, R, K, w, n0, n1, N, y) == 0)
            return;
        if (kind == Q5_0) q5_0_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == Q5_1) q5_1_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == IQ4_NL) iq4_nl_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == Q3_K) q3_k_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == Q2_K) q2_k_avx2(a, R, K, w, n0, n1, N, y); /* (no wide path) */
        else iq4_xs_avx2(a, R, K, w, n0, n1, N, y);
        return;
    }
    if (IS_KQ(kind) && isa == ISA_AVX512) {
        /* NOTE: the same bits either way (kq_wide's header); on failure the per-output path */
        if (R >= KQ_WIDE_MIN_ROWS && kq_wide(kind, a, R, K, w, n0, n1, N, y) == 0) return;
        if (kind == Q4_K) q4_k_avx512(a, R, K, w, n0, n1, N, y);
        else if (kind == Q5_K) q5_k_avx512(a, R, K, w, n0, n1, N, y);
        else q6_k_avx512(a, R, K, w, n0, n1, N, y);
        return;
    }
    if (IS_KQ(kind) && isa != ISA_SCALAR) {
        if (R >= KQ_WIDE8_MIN_ROWS && kq_wide8(kind, a, R, K, w, n0, n1, N, y) == 0) return;
        if (kind == Q4_K) q4_k_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == Q5_K) q5_k_avx2(a, R, K, w, n0, n1, N, y);
        else q6_k_avx2(a, R, K, w, n0, n1, N, y);
        return;
    }
    if (isa == ISA_AVX512) {
        if (kind == Q4_1) q4_1_avx512(a, R, K, w, n0, n1, N, y);
        else if (kind == Q8_0) q8_0_avx512(a, R, K, w, n0, n1, N, y);
        else q4_0_avx512(a, R, K, w, n0, n1, N, y);
        return;
    }
    if (isa == ISA_AVX2) {
        if (kind == Q4_1) q4_1_avx2(a, R, K, w, n0, n1, N, y);
        else if (kind == Q8_0) q8_0_avx2(a, R, K, w, n0, n1, N, y);
        else q4_0_avx2(a, R, K, w, n0, n1, N, y);
        return;
    }
#endif
    (void)isa;
    if (IS_SUPER(kind)) tile_scalar_k(kind, a, R, K, w, n0, n1, N, y);
    else tile_scalar(kind, a, R, K, w, n0, n1, N, y);
}

/* kind: Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL, Q2_K ... Q6_K, IQ4_XS or an IQ kind of
 * ggml_iq.c; isa: one ggml_int_isa_supported() accepts (the caller checks). x [R, K] and y [R, N]
 * row-major fp32; w: N rows of blocks. Returns 0, -1 when scratch memory could not be had, -2 for
 * an ISA this build / CPU cannot run, -3 for an IQ kind before ggml_iq_init (y untouched). */
int ggml_linear_int(int kind, int isa, const float *x, int R, int K, const uint8_t *w, int N,
                    float *y, int nthreads) {
    if (!ggml_int_isa_supported(isa)) return -2;
    if (IS_IQ(kind) && !iq_ready) return -3;
    const int nb = K / 32;
    /* one allocation: q (R * K bytes), then d and s (R * nb floats each), 64-byte aligned */
    const size_t qbytes = ((size_t)R * K + 63) / 64 * 64;
    const size_t fbytes = (8 * (size_t)R * nb + 63) / 64 * 64;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, qbytes + fbytes + 64);
    if (!scratch) return -1;
    float *d = (float *)(scratch + qbytes), *s = d + (size_t)R * nb;
    quantize_rows(x, R, K, (int8_t *)scratch, d, s);
    const act_t a = {(const int8_t *)scratch, d, s};
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int per = ((N + nt - 1) / nt + 7) / 8 * 8; /* a contiguous slice per thread */
        const int n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) run_tile(kind, isa, &a, R, K, w, n0, n1, N, y);
    }
    free(scratch);
    return 0;
}

/* Lattice blocks whose value is f * s * w with one s per 32 values and at most 16 distinct w
 * (IQ3_XXS, IQ3_S, IQ2_XXS, IQ1_S, TQ1_0, TQ2_0: ggml_iq.c) in IQ4_XS's byte layout, each w a
 * nibble into `table` (ggml_tiled.c's for the kind: ggml_tiled_xs_table), for the tiled kernel,
 * which reads them as IQ4_XS with that table and d times the kind's power of two: as stored, a
 * lattice index (one per output) leaves nothing to share across 16 outputs. A block becomes
 * d's fp16 bits as stored | scales_h | scales_l, s + 32 per group as IQ4_XS's 6-bit ls (its
 * kernel multiplies by ls - 32) | qs: the same values exactly, 136 bytes instead of 110 / 98 /
 * 66 / 50 / 54 / 66. Returns 0; -3 before ggml_iq_init; -4 for another kind; -5 for a value
 * outside the table or two scales in one group (not such a block; dst is then not to be read). */
static int xs_code(const int8_t *table, int w) {
    for (int i = 0; i < 16; i++)
        if (table[i] == w) return i;
    return -1;
}

int ggml_iq_as_xs(int kind, const int8_t *table, const uint8_t *src, int64_t nblocks,
                  uint8_t *dst, int nthreads) {
    if (!iq_ready) return -3;
    if (kind != IQ3_S && kind != IQ3_XXS && kind != IQ2_XXS && kind != IQ1_S && !IS_TQ(kind))
        return -4;
    const int bytes = iq_bytes(kind);
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
    for (int64_t i = 0; i < nblocks; i++) {
        const uint8_t *b = src + i * bytes;
        uint8_t *o = dst + i * 136;
        int8_t w[256];
        int s[16];
        const uint16_t d = iq_decode(kind, b, w, s);
        memcpy(o, &d, 2);
        uint16_t sh = 0;
        memset(o + 4, 0, 4);
        for (int g = 0; g < 8; g++) {
            const int ls = s[2 * g] + 32;
            bad |= s[2 * g] != s[2 * g + 1] || ls > 63;
            o[4 + (g >> 1)] |= (uint8_t)((ls & 15) << 4 * (g & 1));
            sh |= (uint16_t)((ls >> 4) << 2 * g);
            for (int v = 0; v < 16; v++) {
                const int lo = xs_code(table, w[32 * g + v]);
                const int hi = xs_code(table, w[32 * g + 16 + v]);
                bad |= lo < 0 || hi < 0;
                o[8 + 16 * g + v] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            }
        }
        memcpy(o + 2, &sh, 2);
    }
    return bad ? -5 : 0;
}
