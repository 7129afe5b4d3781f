/* y[R, N] = x[R, K] @ W^T over GGUF weights (Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, IQ4_NL, MXFP4; the
 * K-quants and IQ4_XS in ggml_tiled_kquant.c, #included) repacked in tiles of 16 outputs,
 * x quantized per row to 8-bit blocks of 32 as in ggml_kernels_int.c (d = max|x| / 127 fp32,
 * q = rint(x * 127 / max|x|), Q4_1's offset m meets the fp32 block sum of x, added in a fixed
 * 8-lane order: `quantize_rows`).
 *
 * Why tiles: ggml_kernels_int.c keeps one output per accumulator, so every (output, block, row)
 * pays for its own reduction and scale; R rows cost nearly R times one row. Here one vector
 * holds 16 outputs' sums: per block the 8 groups of 4 weight bytes of all 16 outputs are
 * unpacked once and each row broadcasts its 4 activation bytes of a group to all lanes, so a
 * dot product step serves 16 outputs and the unpacked weights serve a group of rows.
 *
 * Layout, per tile of 16 outputs and block b (the bytes of 16 GGUF blocks): 16 fp16 d (as
 * stored) | Q4_1: 16 fp16 m | per group g of 4 inputs (values 4g..4g+3), 16 outputs x 4 bytes.
 * Q8_0 stores the 8 groups as signed bytes; 4-bit kinds store groups g (low nibbles) and g + 4
 * (high) in one 64-byte vector, per output GGUF's own qs[4g .. 4g + 3] (low nibble of qs[i] =
 * value i, high = value i + 16): unpacking is one `and` and one `srli_epi16 + and`.
 * IQ3_XXS / IQ3_S (and, on request, IQ2_XXS / IQ1_S / TQ1_0 / TQ2_0) arrive transcoded to
 * IQ4_XS's bytes (each value a nibble into a table of the kind's values: `xs_table`) and run as
 * IQ4_XS (ggml_tiled_kquant.c).
 * IQ4_NL keeps Q4_0's layout; its nibbles index KVALUES (signed, |w| <= 127), taken as |w| times x
 * with w's sign, each maddubs result (pairs <= 2 * 127 * 127) into int32 at once.
 * MXFP4 (ggml type 39, gpt-oss's experts: per 32 values an E8M0 byte e, then Q4_0's nibbles,
 * each an index into the doubled E2M1 table below) keeps its 17 bytes a block: 16 e bytes in
 * place of the fp16 d, then the nibbles as Q4_0's. Its d_w = 2^(e - 128) (ggml's e8m0-half,
 * subnormal for e < 2) is made exactly in-kernel, so its products meet the same fp32 steps.
 *
 * Per (output, row, block) the integer dot product p is exact; then, per output lane, in block
 * order: scale = d_w * d_x (one rounding), acc = fma(float(p), scale, acc), for Q4_1 also
 * macc = fma(m, s_x, macc); y = acc + macc (Q4_1) or acc. The scalar C, AVX2, AVX-512 and AMX
 * paths perform exactly those fp32 operations (per lane), so they are bit-identical, and an output
 * never depends on R or the thread count (batch invariance). No -m flags: the SIMD functions
 * carry target attributes. Must be compiled with -ffp-contract=off. Built by ggml_tiled.py.
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

enum { Q4_1 = 0, Q8_0 = 1, Q4_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, MXFP4 = 6, Q5_0 = 7,
       Q5_1 = 8, IQ4_NL = 9, IQ4_XS = 10, Q3_K = 11, Q2_K = 12, IQ2_XXS = 13, IQ3_XXS = 16,
       IQ3_S = 17, IQ1_S = 18, TQ1_0 = 22, TQ2_0 = 23 }; /* (ggml_linear.py's KINDS) */
/* kvalues_iq4nl: IQ4_NL's and IQ4_XS's values of a nibble (IQ4_NL keeps Q4_0's tiled layout) */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
/* The lattice kinds whose value is f * s * w with one integer scale s per 32 values and at most
 * 16 distinct w (ggml_iq.c): IQ3_XXS / IQ3_S, and IQ2_XXS / IQ1_S / TQ1_0 / TQ2_0, come
 * transcoded to IQ4_XS's bytes (ggml_kernels_int.c's ggml_iq_as_xs: the same values, each w a
 * nibble into its kind's table below, s as IQ4_XS's 6-bit ls - 32; f = d times the power of two
 * `xs_d_mul`, exact in fp32) and run as IQ4_XS with that table */
#define IS_XS(kind) ((kind) == IQ4_XS || (kind) == IQ3_XXS || (kind) == IQ3_S || \
                     (kind) == IQ2_XXS || (kind) == IQ1_S || (kind) == TQ1_0 || (kind) == TQ2_0)
static const int8_t XS_IQ3_XXS[16] = {-62, -52, -44, -36, -28, -20, -12, -4,
                                      4,   12,  20,  28,  36,  44,  52,  62};
static const int8_t XS_IQ3_S[16] = {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15};
/* (the unused nibbles: 0, never written) */
static const int8_t XS_IQ2_XXS[16] = {-43, -25, -8, 8, 25, 43};
static const int8_t XS_IQ1_S[16] = {-9, -7, -1, 1, 7, 9};
static const int8_t XS_TERNARY[16] = {-1, 0, 1, 2}; /* (TQ2_0's q = 3 -> 2: ggml's value too) */
static inline const int8_t *xs_table(int kind) {
    return kind == IQ3_XXS ? XS_IQ3_XXS : kind == IQ3_S ? XS_IQ3_S : kind == IQ2_XXS ? XS_IQ2_XXS
           : kind == IQ1_S ? XS_IQ1_S : kind == TQ1_0 || kind == TQ2_0 ? XS_TERNARY : KVALUES;
}
/* d's factor: IQ3_XXS's 1/4, IQ2_XXS's and IQ1_S's 1/8 (powers of two: exact in fp32) */
static inline float xs_d_mul(int kind) {
    return kind == IQ3_XXS ? 0.25f : kind == IQ2_XXS || kind == IQ1_S ? 0.125f : 1.f;
}
#define IS_Q5(kind) ((kind) == Q5_0 || (kind) == Q5_1)
#define HAS_M(kind) ((kind) == Q4_1 || (kind) == Q5_1)
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 }; /* ggml_int.py's ISAS */
#define TILE 16
/* rows sharing one unpacking of a tile's block: what the accumulators leave of 16 ymm / 32 zmm
 * (AVX2: 2 per row; Q8_0's sign and |w| take one more, and 5 rows spilled there) */
#define AVX2_ROWS 5
#define AVX2_ROWS_Q8 4
#define AVX2_ROWS_MX 4 /* MXFP4: an int32 sum per row besides the int16 one (half_avx2) */
#define AVX512_ROWS 8
#define ROW_GROUP 8 /* the most of either */

typedef struct {
    const int8_t *q;  /* [R, K] the quantized rows */
    const float *d;   /* [R, nb] block scales */
    const float *s;   /* [R, nb] exact block sums of x (Q4_1) */
    const int32_t *S; /* [R, nb] integer block sums of q (the shift of signed kinds) */
    /* [R, nb] the sums of q's halves (values 0..15, 16..31) as two int16s, low half first:
     * the 16-value shifts and minimums of Q3_K / Q2_K (ggml_tiled_kquant.c) */
    const int32_t *S16;
} act_t;

static int block_bytes(int kind) {
    return kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : kind == MXFP4 ? 17 : kind == Q5_0 ? 22
           : kind == Q5_1 ? 24 : kind == Q4_K ? 144 : kind == Q5_K ? 176 : kind == Q6_K ? 210
           : kind == Q3_K ? 110 : kind == Q2_K ? 84 : IS_XS(kind) ? 136 : 18;
}
/* a block's bytes in the tiled copy: GGUF's, but Q3_K's, whose 6-bit scales are unpacked to
 * a byte each there (ggml_tiled_kquant.c) */
static int packed_bytes(int kind) { return kind == Q3_K ? 114 : block_bytes(kind); }
/* values per block: the K-quants' super-blocks of 256 (ggml_tiled_kquant.c), else 32 */
static int block_values(int kind) {
    return (kind >= Q4_K && kind <= Q6_K) || kind >= IQ4_XS ? 256 : 32;
}
static int quant_off(int kind) { return HAS_M(kind) ? 64 : kind == MXFP4 ? 16 : 32; }
/* Q5_0 / Q5_1 (GGUF: d, (m), qh[4], qs[16]; value i's bit 4 bit i of qh) keep Q4_0 / Q4_1's
 * layout and add a 64-byte vector after the 4 nibble vectors: per output 4 bytes, byte i's bit
 * 2j the bit 4 of value 4j + i (low nibble of vector j), bit 2j + 1 that of value 16 + 4j + i
 * (its high nibble). Their values 0..31 (Q5_0: minus 16, taken off as 16 * S). */
static int q5_src(int kind) { return kind == Q5_0 ? 6 : 8; } /* GGUF qs; qh 4 bytes before */

/* MXFP4's nibble -> ggml's doubled E2M1 value (kvalues_mxfp4); the kernels look up these + 12
 * (0..24, unsigned for maddubs) and take 12 * S off the integer sum, as Q4_0 takes 8 * S */
static const int8_t E2M1X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
#define MX_SHIFT 12

/* ggml_e8m0_to_fp32_half: 2^(e - 128) from its bits (exact; e < 2 gives fp32 subnormals) */
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float half_to_float(uint16_t h) { /* exact; portable (no F16C) */
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

static float half_at(const uint8_t *p) {
    uint16_t h;
    return memcpy(&h, p, 2), half_to_float(h);
}

/* x's rows to 8-bit blocks: q = rint(x * 127 / max|x|) (round half to even, as lrintf and
 * cvtps do), d = max|x| / 127, s = the fp32 block sum of x, S = the integer block sum of q.
 * ggml_kernels_int.c quantizes the same q and d; its s adds the 32 values in order, this s
 * adds them in 8 lanes (lane l: x[l] + x[l+8] + x[l+16] + x[l+24], in that order), then the
 * lanes as (l0+l4 + l2+l6) + (l1+l5 + l3+l7): the order of the AVX2 reduction below, which
 * this scalar code repeats, so every ISA path has the same s bits. */
static float block_sum8(const float *xb) {
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = ((xb[i] + xb[i + 8]) + xb[i + 16]) + xb[i + 24];
    const float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    return (a0 + a2) + (a1 + a3);
}

/* two int16 lanes in an int32: lo, then hi (|each| <= 16 * 128) */
static int32_t pair16(int32_t lo, int32_t hi) {
    return (int32_t)(((uint32_t)lo & 0xFFFFu) | (uint32_t)hi << 16);
}

static void quantize_rows(const float *x, int R, int K, int8_t *q, float *d, float *s,
                          int32_t *S, int32_t *S16) {
    const int nb = K / 32;
    for (int r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(xb[i]);
                amax = a > amax ? a : amax;
            }
            const float sum = block_sum8(xb);
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *qb = q + (size_t)r * K + b * 32;
            int32_t isum = 0, lo = 0;
            for (int i = 0; i < 32; i++) {
                /* a non-finite x * id gives -128, as cvtps + saturating packs do on the SIMD
                 * path (d is NaN then, below: the row's outputs are NaN either way) */
                qb[i] = isfinite(xb[i] * id) ? (int8_t)lrintf(xb[i] * id) : -128;
                isum += qb[i];
                if (i == 15) lo = isum;
            }
            S16[(size_t)r * nb + b] = pair16(lo, isum - lo);
            /* NOTE: a NaN / inf in x must not vanish into q = 0: it poisons the block's scale */
            d[(size_t)r * nb + b] = isfinite(sum) ? amax / 127.f : NAN;
            s[(size_t)r * nb + b] = sum;
            S[(size_t)r * nb + b] = isum;
        }
}

/* ---- repacking and dequantized rows (portable C) ---- */
/* the K-quants' (ggml_tiled_kquant.c, #included below) */
static void kq_repack_block(int kind, const uint8_t *b, uint8_t *t, int o);
static void kq_values(int kind, const uint8_t *t, int o, float *y);

/* GGUF rows src[rows, K / 32 blocks] -> outputs row0 .. row0 + rows - 1 of the tiled copy dst
 * (callers stack fused weights by calling this per member, no stacked GGUF copy in between) */
void ggml_tiled_repack(int kind, const uint8_t *src, int rows, int K, uint8_t *dst, int row0,
                       int nthreads) {
    const int nb = K / 32, bytes = block_bytes(kind), tb = TILE * packed_bytes(kind);
    const int qo = quant_off(kind);
    const int qsrc = kind == Q4_1 ? 4 : kind == MXFP4 ? 1 : IS_Q5(kind) ? q5_src(kind) : 2;
    const int vecs = kind == Q8_0 ? 8 : 4;
    if (block_values(kind) == 256) { /* K-quants: super-blocks of 256 values */
        const int nk = K / 256;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int i = 0; i < rows; i++) {
            const int n = row0 + i;
            for (int k = 0; k < nk; k++)
                kq_repack_block(kind, src + ((size_t)i * nk + k) * bytes,
                                dst + ((size_t)(n / TILE) * nk + k) * tb, n % TILE);
        }
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int i = 0; i < rows; i++) {
        const int n = row0 + i, o = n % TILE;
        const uint8_t *row = src + (size_t)i * nb * bytes;
        uint8_t *tile = dst + (size_t)(n / TILE) * nb * tb;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            uint8_t *t = tile + (size_t)b * tb;
            if (kind == MXFP4) t[o] = blk[0];
            else memcpy(t + 2 * o, blk, 2);
            if (HAS_M(kind)) memcpy(t + 32 + 2 * o, blk + 2, 2);
            for (int j = 0; j < vecs; j++) memcpy(t + qo + 64 * j + 4 * o, blk + qsrc + 4 * j, 4);
            if (IS_Q5(kind)) {
                uint32_t qh;
                memcpy(&qh, blk + qsrc - 4, 4);
                for (int i = 0; i < 4; i++) {
                    uint8_t hb = 0;
                    for (int j = 0; j < 4; j++)
                        hb |= (uint8_t)(((qh >> (4 * j + i)) & 1) << (2 * j) |
                                        ((qh >> (16 + 4 * j + i)) & 1) << (2 * j + 1));
                    t[qo + 256 + 4 * o + i] = hb;
                }
            }
        }
    }
}

/* rows `ids` of the tiled weight, dequantized as gguf does (d * q + m: a product, then a sum) */
void ggml_tiled_rows(int kind, const uint8_t *w, int K, const int64_t *ids, int R, float *out,
                     int nthreads) {
    const int nb = K / 32, tb = TILE * packed_bytes(kind), qo = quant_off(kind);
    if (block_values(kind) == 256) {
        const int nk = K / 256;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int r = 0; r < R; r++)
            for (int k = 0; k < nk; k++)
                kq_values(kind, w + ((size_t)(ids[r] / TILE) * nk + k) * tb, (int)(ids[r] % TILE),
                          out + (size_t)r * K + 256 * k);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < R; r++) {
        const int64_t n = ids[r];
        const int o = (int)(n % TILE);
        const uint8_t *tile = w + (size_t)(n / TILE) * nb * tb;
        float *y = out + (size_t)r * K;
        for (int b = 0; b < nb; b++) {
            const uint8_t *t = tile + (size_t)b * tb, *qs = t + qo + 4 * o;
            const float d = kind == MXFP4 ? e8m0_half(t[o]) : half_at(t + 2 * o);
            const float m = HAS_M(kind) ? half_at(t + 32 + 2 * o) : 0.f;
            float *yb = y + b * 32;
            for (int g = 0; g < 8; g++)
                for (int i = 0; i < 4; i++) {
                    float v;
                    if (kind == Q8_0) v = d * (float)(int8_t)qs[64 * g + i];
                    else {
                        const uint8_t byte = qs[64 * (g & 3) + i];
                        int q = g < 4 ? byte & 0x0F : byte >> 4;
                        if (IS_Q5(kind)) q |= ((qs[256 + i] >> (2 * (g & 3) + (g >> 2))) & 1) << 4;
                        v = HAS_M(kind) ? d * (float)q + m
                            : d * (float)(kind == MXFP4 ? E2M1X2[q] : kind == IQ4_NL ? KVALUES[q]
                                          : kind == Q5_0 ? q - 16 : q - 8);
                    }
                    yb[4 * g + i] = v;
                }
        }
    }
}

/* ---- portable scalar path ---- */
static void tiles_scalar(int kind, const act_t *a, int R, int K, const uint8_t *w, int t0, int t1,
                         int N, float *y) {
    const int nb = K / 32, tb = TILE * block_bytes(kind), qo = quant_off(kind);
    for (int t = t0; t < t1; t++)
        for (int o = 0; o < TILE; o++)
            for (int r = 0; r < R; r++) {
                float acc = 0.f, macc = 0.f;
                for (int b = 0; b < nb; b++) {
                    const uint8_t *blk = w + ((size_t)t * nb + b) * tb, *qs = blk + qo + 4 * o;
                    const int8_t *qx = a->q + (size_t)r * K + b * 32;
                    const size_t rb = (size_t)r * nb + b;
                    int32_t p = 0;
                    for (int g = 0; g < 8; g++)
                        for (int i = 0; i < 4; i++) {
                            int wv;
                            if (kind == Q8_0) wv = (int8_t)qs[64 * g + i];
                            else {
                                const uint8_t byte = qs[64 * (g & 3) + i];
                                wv = (g < 4 ? byte & 0x0F : byte >> 4) - (kind == Q4_0 ? 8 : 0);
                                if (kind == MXFP4) wv = E2M1X2[wv] + MX_SHIFT;
                                if (kind == IQ4_NL) wv = KVALUES[wv];
                                if (IS_Q5(kind))
                                    wv |= ((qs[256 + i] >> (2 * (g & 3) + (g >> 2))) & 1) << 4;
                            }
                            p += wv * qx[4 * g + i];
                        }
                    if (kind == MXFP4) p -= MX_SHIFT * a->S[rb];
                    if (kind == Q5_0) p -= 16 * a->S[rb];
                    const float dw = kind == MXFP4 ? e8m0_half(blk[o]) : half_at(blk + 2 * o);
                    const float scale = dw * a->d[rb];
                    acc = fmaf((float)p, scale, acc);
                    if (HAS_M(kind)) macc = fmaf(half_at(blk + 32 + 2 * o), a->s[rb], macc);
                }
                y[(size_t)r * N + (size_t)t * TILE + o] = HAS_M(kind) ? acc + macc : acc;
            }
}

#ifdef SD_X86
#define AVX2_ATTR __attribute__((target("avx2,fma,f16c")))
#define AVX512_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define INLINE static inline __attribute__((always_inline))

/* NOTE: pins a row's partial sum at this point: without it gcc reassociates the row's 8 integer
 * adds into one sum and computes all rows x 8 products first (~32 ymm live: stack spills) */
#define KEEP(v) __asm__("" : "+x"(v))
#define MACC_PASS(rg) ((rg) > 2) /* Q4_1's macc in a pass of its own (below 3 rows: room) */
/* The first half's pass reads the tile's blocks from memory (the second finds them in L1): it
 * asks for the block PF_BLOCKS ahead (past a tile's end: the next tile's, stored after it).
 * With the arithmetic of several rows, or of 4-bit unpacking, between the loads the hardware
 * prefetcher alone fell behind (2-core AMD EPYC, AVX2, 30 layers of SmolLM2's linears, one
 * process alternating builds: Q4_1 0.93x the time at 1 row, 0.86x at 4; Q8_0 0.84x at 4 rows).
 * A 1-row Q8_0 pass is a plain stream the hardware keeps up with: there the requests cost
 * ~5%, so it makes none. Only the order of loads changes: the same bits. */
#define PF_BLOCKS 8
#define PREFETCHES(h, kind, rg) ((h) == 0 && ((kind) != Q8_0 || (rg) > 1))

static inline int32_t group_at(const int8_t *q) { /* 4 activation bytes as one int32 */
    int32_t v;
    return memcpy(&v, q, 4), v;
}

/* AVX2: half a tile (8 outputs) per ymm; no dpbusd, so maddubs (u8 x s8 -> saturating int16
 * pairs) and madd with ones. 4-bit weights are 0..15: a pair is <= 2 * 15 * 127 and the 8
 * groups' pairs add up in int16 without saturating (<= 30480) before one madd. Q8_0 goes in as
 * |w| times sign(q, w) (a pair <= 2 * 128 * 127 < 32767; w + 128 would saturate).
 * MXFP4 goes in as table + 12 (pshufb of the nibbles, 0..24): a pair is <= 2 * 24 * 128 = 6144
 * (|q| <= 128: -128 only in a non-finite row), so 5 maddubs results would still fit int16
 * (30720) but 6 would not (36864); a row adds the 4 of two groups g (low and high nibbles of
 * j = 2 jp, 2 jp + 1: <= 24576), then madds them into int32; 12 * S comes off there, exactly.
 * 16 ymm: a block's 8 unpacked weight vectors (+ 8 |w|) held for all rows spilled, so one
 * lives only while the rows use it (a load: groups j and j + 4, or a Q8_0 group and |w|), a
 * row holds its block's integer sum and acc, and Q4_1's macc = sum_b m_b * s_b runs in a pass
 * of its own (per lane the same fmas in block order: the same bits). */
AVX2_ATTR INLINE void half_avx2(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                int r0, const int rg, const int kind, const int h) {
    const int nb = K / 32, tb = TILE * block_bytes(kind), qo = quant_off(kind);
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)); /* E2M1X2 + MX_SHIFT */
    const __m256i nl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    __m256 acc[ROW_GROUP], macc[ROW_GROUP];
    for (int r = 0; r < rg; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        /* half h: scales 16 h bytes on (MXFP4's e: 8 h), quants 32 h on in every 64-byte vector */
        const uint8_t *base = tile + (size_t)b * tb, *qs = base + qo + 32 * h;
        const int8_t *qx = a->q + (size_t)r0 * K + 32 * b; /* row r0 + r: qx + r * K */
        if (PREFETCHES(h, kind, rg))
            for (int l = 0; l < tb; l += 64)
                _mm_prefetch((const char *)base + PF_BLOCKS * tb + l, _MM_HINT_T0);
        __m256i p[ROW_GROUP], p16[ROW_GROUP]; /* int32 (Q8_0, MXFP4) / int16 sums, exact */
        for (int r = 0; r < rg; r++) p[r] = p16[r] = _mm256_setzero_si256();
        const __m256i hv = IS_Q5(kind) ? _mm256_loadu_si256((const __m256i *)(qs + 256))
                                       : _mm256_setzero_si256(); /* the 5-bit kinds' bit 4 */
        for (int j = 0; j < (kind == Q8_0 ? 8 : 4); j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * j));
            __m256i w0 = kind == Q8_0 ? _mm256_abs_epi8(v) : _mm256_and_si256(v, mask);
            __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            if (kind == MXFP4) w0 = _mm256_shuffle_epi8(lut, w0), w1 = _mm256_shuffle_epi8(lut, w1);
            __m256i a0 = w0, a1 = w1; /* IQ4_NL: the table's signed values, their |w| */
            if (kind == IQ4_NL) {
                w0 = _mm256_shuffle_epi8(nl, w0), w1 = _mm256_shuffle_epi8(nl, w1);
                a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            }
            if (IS_Q5(kind)) {
                const __m256i one8 = _mm256_set1_epi8(1);
                w0 = _mm256_or_si256(w0, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hv, 2 * j), one8), 4));
                w1 = _mm256_or_si256(w1, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hv, 2 * j + 1), one8), 4));
            }
            for (int r = 0; r < rg; r++) {
                const int8_t *qr = qx + (size_t)r * K + 4 * j;
                const __m256i x = _mm256_set1_epi32(group_at(qr));
                if (kind == Q8_0) {
                    p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(w0, _mm256_sign_epi8(x, v)), ones));
                    KEEP(p[r]);
                    continue;
                }
                if (kind == IQ4_NL) { /* a pair <= 2 * 127 * 127: each result into int32 */
                    const __m256i x1 = _mm256_set1_epi32(group_at(qr + 16));
                    p[r] = _mm256_add_epi32(p[r], _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x1, w1)),
                                          ones)));
                    KEEP(p[r]);
                    continue;
                }
                p16[r] = _mm256_add_epi16(p16[r], _mm256_add_epi16(_mm256_maddubs_epi16(w0, x),
                    _mm256_maddubs_epi16(w1, _mm256_set1_epi32(group_at(qr + 16)))));
                /* MXFP4, 5-bit kinds: 4 results in int16 (<= 4 * 31 * 2 * 128 = 31744 for the
                 * 5-bit values): into int32 now */
                if ((kind == MXFP4 || IS_Q5(kind)) && (j & 1)) {
                    p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(p16[r], ones));
                    p16[r] = _mm256_setzero_si256();
                    KEEP(p[r]);
                }
                KEEP(p16[r]);
            }
        }
        __m256 dw;
        if (kind == MXFP4) { /* e8m0_half per lane: (e - 1) << 23, or 0x00200000 << e for e < 2 */
            const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(base + 8 * h)));
            const __m256i one = _mm256_set1_epi32(1);
            dw = _mm256_castsi256_ps(_mm256_blendv_epi8(
                _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e),
                _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23), _mm256_cmpgt_epi32(e, one)));
        } else {
            dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 16 * h)));
        }
        const __m256 m = HAS_M(kind) && !MACC_PASS(rg)
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(base + 16 * h + 32)))
            : _mm256_setzero_ps();
        for (int r = 0; r < rg; r++) {
            const size_t rb = (size_t)(r0 + r) * nb + b;
            if (kind == Q4_1 || kind == Q4_0) p[r] = _mm256_madd_epi16(p16[r], ones);
            if (kind == Q4_0) p[r] = _mm256_sub_epi32(p[r], _mm256_set1_epi32(8 * a->S[rb]));
            if (kind == MXFP4)
                p[r] = _mm256_sub_epi32(p[r], _mm256_set1_epi32(MX_SHIFT * a->S[rb]));
            if (kind == Q5_0) p[r] = _mm256_sub_epi32(p[r], _mm256_set1_epi32(16 * a->S[rb]));
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a->d[rb]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[r]), scale, acc[r]);
            if (HAS_M(kind) && !MACC_PASS(rg))
                macc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s[rb]), macc[r]);
        }
    }
    for (int b = 0; HAS_M(kind) && MACC_PASS(rg) && b < nb; b++) {
        const __m256 m = _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(tile + (size_t)b * tb + 16 * h + 32)));
        for (int r = 0; r < rg; r++)
            macc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s[(size_t)(r0 + r) * nb + b]), macc[r]);
    }
    for (int r = 0; r < rg; r++)
        _mm256_storeu_ps(y + (size_t)(r0 + r) * N + 8 * h,
                         HAS_M(kind) ? _mm256_add_ps(acc[r], macc[r]) : acc[r]);
}

/* AVX-512 VNNI: a whole tile per zmm, dpbusd (u8 x s8, 4 products per int32 lane, no
 * saturation). Signed kinds go in unsigned (Q4_0: the nibble, w + 8; Q8_0: w + 128 by flipping
 * the sign bit) and shift * S comes off in int32, exactly. */
AVX512_ATTR INLINE void tile_avx512(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                    int r0, const int rg, const int kind) {
    const int nb = K / 32, tb = TILE * block_bytes(kind), qo = quant_off(kind);
    const int shift = kind == Q8_0 ? 128 : 8;
    const __m512i mask = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[ROW_GROUP], macc[ROW_GROUP];
    for (int r = 0; r < rg; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = tile + (size_t)b * tb, *qs = blk + qo;
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 m = kind == Q4_1
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
        __m512i wv[8];
        if (kind == Q8_0)
            for (int g = 0; g < 8; g++)
                wv[g] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qs + 64 * g)), flip);
        else
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(qs + 64 * j));
                wv[j] = _mm512_and_si512(v, mask);
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            }
        for (int r = 0; r < rg; r++) {
            const size_t rb = (size_t)(r0 + r) * nb + b;
            const int8_t *qx = a->q + rb * 32;
            __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
            for (int g = 0; g < 8; g += 2) { /* two chains: dpbusd's latency */
                p0 = _mm512_dpbusd_epi32(p0, wv[g], _mm512_set1_epi32(group_at(qx + 4 * g)));
                p1 = _mm512_dpbusd_epi32(p1, wv[g + 1],
                                         _mm512_set1_epi32(group_at(qx + 4 * g + 4)));
            }
            __m512i p = _mm512_add_epi32(p0, p1);
            if (kind != Q4_1) p = _mm512_sub_epi32(p, _mm512_set1_epi32(shift * a->S[rb]));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[rb]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r]);
            if (kind == Q4_1) macc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s[rb]), macc[r]);
        }
    }
    for (int r = 0; r < rg; r++)
        _mm512_storeu_ps(y + (size_t)(r0 + r) * N,
                         kind == Q4_1 ? _mm512_add_ps(acc[r], macc[r]) : acc[r]);
}

/* quantize_rows in 8 lanes (AVX2, for both SIMD ISAs): the same q, d, s, S bits. Serial on the
 * calling thread before the tiles' parallel region: a decode step quantizes ~100k values, ~0.1
 * ms in scalar code (2026-12-05; a row of the down projection, K = 1536, 1.6 -> ~0.15 us). */
AVX2_ATTR static void quantize_rows_avx2(const float *x, int R, int K, int8_t *q, float *d,
                                         float *s, int32_t *S, int32_t *S16) {
    const int nb = K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int r = 0; r < R; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + b * 32;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            /* max_ps(a, m) keeps m where a is NaN, as `a > m ? a : m` does */
            __m256 mx = _mm256_max_ps(_mm256_and_ps(x0, absmask), _mm256_setzero_ps());
            mx = _mm256_max_ps(_mm256_and_ps(x1, absmask), mx);
            mx = _mm256_max_ps(_mm256_and_ps(x2, absmask), mx);
            mx = _mm256_max_ps(_mm256_and_ps(x3, absmask), mx);
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const __m256 l = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(x0, x1), x2), x3);
            __m128 a = _mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1));
            a = _mm_add_ps(a, _mm_movehl_ps(a, a)); /* (a0 + a2), (a1 + a3) */
            a = _mm_add_ss(a, _mm_movehdup_ps(a));
            const float sum = _mm_cvtss_f32(a);
            const float id = amax > 0.f ? 127.f / amax : 0.f;
            const __m256 iv = _mm256_set1_ps(id);
            const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, iv));
            const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, iv));
            const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, iv));
            const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, iv));
            /* packs interleave 128-bit lanes: the permute puts the 32 bytes back in order */
            const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1),
                                                   _mm256_packs_epi32(q2, q3));
            const __m256i p8 = _mm256_permutevar8x32_epi32(
                p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + (size_t)r * K + b * 32), p8);
            /* the integer sum of the stored bytes (-128 where x * id was not finite) */
            const __m256i isum = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_set1_epi8(1), p8), _mm256_set1_epi16(1));
            /* the halves' sums (values 0..15: the low 128 bits' 4 lanes), then the block's */
            __m128i t = _mm_hadd_epi32(_mm256_castsi256_si128(isum),
                                       _mm256_extracti128_si256(isum, 1));
            t = _mm_hadd_epi32(t, t); /* lanes: lo, hi, lo, hi */
            S16[(size_t)r * nb + b] = pair16(_mm_cvtsi128_si32(t), _mm_extract_epi32(t, 1));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
            d[(size_t)r * nb + b] = isfinite(sum) ? amax / 127.f : NAN;
            s[(size_t)r * nb + b] = sum;
            S[(size_t)r * nb + b] = _mm_cvtsi128_si32(t);
        }
}

/* AVX2 runs a tile as two halves of 8 outputs */
AVX2_ATTR INLINE void tile_avx2(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                int r0, const int rg, const int kind) {
    half_avx2(a, K, tile, N, y, r0, rg, kind, 0);
    half_avx2(a, K, tile, N, y, r0, rg, kind, 1);
}

/* tiles t0..t1, every group of up to G rows; rg and kind constant in each inlined call */
#define ROWS_CASE(OP, KIND, RG) case RG: OP(a, K, tile, N, yt, r0, RG, KIND); break;
#define TILES_FN(NAME, TILE_OP, KIND, G, ATTR)                                                  \
    ATTR static void NAME(const act_t *a, int R, int K, const uint8_t *w, int t0, int t1, int N,  \
                          float *y) {                                                           \
        const size_t tile_bytes = (size_t)(K / block_values(KIND)) * TILE * packed_bytes(KIND); \
        for (int t = t0; t < t1; t++) {                                                         \
            const uint8_t *tile = w + (size_t)t * tile_bytes;                                   \
            float *yt = y + (size_t)t * TILE;                                                   \
            for (int r0 = 0; r0 < R; r0 += G) {                                                 \
                switch (R - r0 < G ? R - r0 : G) {                                              \
                ROWS_CASE(TILE_OP, KIND, 1) ROWS_CASE(TILE_OP, KIND, 2)                         \
                ROWS_CASE(TILE_OP, KIND, 3) ROWS_CASE(TILE_OP, KIND, 4)                         \
                ROWS_CASE(TILE_OP, KIND, 5) ROWS_CASE(TILE_OP, KIND, 6)                         \
                ROWS_CASE(TILE_OP, KIND, 7) ROWS_CASE(TILE_OP, KIND, 8)                         \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }
TILES_FN(q4_1_avx2, tile_avx2, Q4_1, AVX2_ROWS, AVX2_ATTR)
TILES_FN(q8_0_avx2, tile_avx2, Q8_0, AVX2_ROWS_Q8, AVX2_ATTR)
TILES_FN(q4_0_avx2, tile_avx2, Q4_0, AVX2_ROWS, AVX2_ATTR)
TILES_FN(mxfp4_avx2, tile_avx2, MXFP4, AVX2_ROWS_MX, AVX2_ATTR)
TILES_FN(q5_0_avx2, tile_avx2, Q5_0, AVX2_ROWS_MX, AVX2_ATTR)
TILES_FN(q5_1_avx2, tile_avx2, Q5_1, AVX2_ROWS_MX, AVX2_ATTR)
TILES_FN(iq4_nl_avx2, tile_avx2, IQ4_NL, AVX2_ROWS_Q8, AVX2_ATTR)
TILES_FN(q4_1_avx512, tile_avx512, Q4_1, AVX512_ROWS, AVX512_ATTR)
TILES_FN(q8_0_avx512, tile_avx512, Q8_0, AVX512_ROWS, AVX512_ATTR)
TILES_FN(q4_0_avx512, tile_avx512, Q4_0, AVX512_ROWS, AVX512_ATTR)
/* AMX (Intel's tile matrix unit, AMX-INT8): one TDPBSSD / TDPBSUD multiplies 16 rows of a
 * block's 32 activation bytes by the block's 16 outputs x 32 weights into 16 x 16 exact int32
 * sums, the work of 128 dpbusd. The tiled layout's 8 groups of 16 outputs x 4 bytes are AMX's B
 * operand as they stand (Q8_0 loads straight from the weights; 4-bit kinds are unpacked into
 * 8 x 64 bytes first, once per block for up to 16 rows). Per block the sums leave the tile unit
 * (tilestored) and meet fp32 in exactly the AVX-512 path's operations per lane: p (Q4_0: - 8 S,
 * Q8_0 signed x signed needs no shift), scale = d_w * d_x, acc = fma(float(p), scale, acc),
 * Q4_1 macc = fma(m, s_x, macc); so AMX, AVX-512, AVX2 and scalar are bit-identical.
 * Tiles: tmm0/1 C (16 x 16 int32), tmm2/3 A (16 rows x 32 bytes: the rows' block, stride K),
 * tmm4/5 B (8 x 64 bytes); two blocks in flight. A always reads 16 rows, so the quantized rows
 * are padded to a multiple of 16 with zeros (ggml_tiled_linear). Linux hands out the tile
 * state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per process: amx_usable). */
#define AMX_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni," \
                                       "amx-tile,amx-int8")))
#define AMX_ROWS 16
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* rows: the A and C tiles' rows (a step's last group of rows may be short) */
AMX_ATTR static void amx_config(int rows) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = rows, c.colsb[i] = 64;         /* C: rows x 16 int32 */
        c.rows[2 + i] = rows, c.colsb[2 + i] = 32; /* A: rows x one block of 32 bytes */
        c.rows[4 + i] = 8, c.colsb[4 + i] = 64;    /* B: 8 groups x 16 outputs x 4 bytes */
    }
    _tile_loadconfig(&c);
}

/* a tile's 4-bit blocks unpacked to AMX's B layout, all of them before the first is read (a
 * tile load of bytes just stored waits for the stores: the unpacking runs ahead) */
AMX_ATTR INLINE void amx_unpack(const uint8_t *tile, int nb, int tb, int qo, uint8_t *wb) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++)
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512((const void *)(tile + (size_t)b * tb + qo + 64 * j));
            uint8_t *o = wb + (size_t)b * 512;
            _mm512_store_si512((void *)(o + 64 * j), _mm512_and_si512(v, mask));
            _mm512_store_si512((void *)(o + 64 * (j + 4)),
                               _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
        }
}

/* one block's sums into cout: C = A (signed activations) x B (signed Q8_0 / unsigned nibbles) */
#define AMX_BLOCK(TC, TA, TB, b, cout)                                                    \
    do {                                                                                  \
        if (kind == Q8_0) _tile_loadd(TB, tile + (size_t)(b) * tb + qo, 64);               \
        else _tile_loadd(TB, wb + (size_t)(b) * 512, 64);                                  \
        _tile_loadd(TA, qa + 32 * (b), K);                                                \
        _tile_zero(TC);                                                                   \
        if (kind == Q8_0) _tile_dpbssd(TC, TA, TB);                                        \
        else _tile_dpbsud(TC, TA, TB);                                                     \
        _tile_stored(TC, (cout), 64);                                                     \
    } while (0)

/* block b's sums (c) into the rows' accumulators: the AVX-512 path's operations */
#define AMX_EPI(b, c)                                                                     \
    do {                                                                                  \
        const __m512 dw = _mm512_cvtph_ps(                                                \
            _mm256_loadu_si256((const __m256i *)(tile + (size_t)(b) * tb)));               \
        for (int r = 0; r < rg; r++) {                                                    \
            const size_t rb = (size_t)(r0 + r) * nb + (b);                                \
            __m512i p = _mm512_load_si512((const void *)((c) + 16 * r));                  \
            if (kind == Q4_0) p = _mm512_sub_epi32(p, _mm512_set1_epi32(8 * a->S[rb]));   \
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a->d[rb]));             \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[r]);               \
        }                                                                                 \
    } while (0)

/* rows r0 .. r0 + rg - 1 of one tile (rg constant in each inlined call: acc in registers).
 * Pipelined: blocks b, b + 1 go to a ring of 4 sum buffers while the epilogue reads those of
 * b - 2, b - 1 (stored one pair earlier: reading a tile store at once stalls). Q4_1's macc
 * runs in a pass of its own (per lane the same fmas in block order: the same bits). */
AMX_ATTR INLINE void group_amx(const act_t *a, int K, const uint8_t *tile, const uint8_t *wb,
                               int N, float *yt, int r0, const int rg, const int kind) {
    const int nb = K / 32, tb = TILE * block_bytes(kind), qo = quant_off(kind);
    _Alignas(64) int32_t c[4][AMX_ROWS * 16];
    const int8_t *qa = a->q + (size_t)r0 * K;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < rg; r++) acc[r] = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        AMX_BLOCK(0, 2, 4, b, c[b & 3]);
        AMX_BLOCK(1, 3, 5, b + 1, c[(b + 1) & 3]);
        if (b >= 2) {
            AMX_EPI(b - 2, c[(b - 2) & 3]);
            AMX_EPI(b - 1, c[(b - 1) & 3]);
        }
    }
    if (b < nb) AMX_BLOCK(0, 2, 4, b, c[b & 3]); /* odd nb: the last block */
    for (int e = nb - (nb & 1) - 2 < 0 ? 0 : nb - (nb & 1) - 2; e < nb; e++) AMX_EPI(e, c[e & 3]);
    if (kind == Q4_1) {
        __m512 macc[AMX_ROWS];
        for (int r = 0; r < rg; r++) macc[r] = _mm512_setzero_ps();
        for (int e = 0; e < nb; e++) {
            const __m512 m = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(tile + (size_t)e * tb + 32)));
            for (int r = 0; r < rg; r++)
                macc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s[(size_t)(r0 + r) * nb + e]),
                                          macc[r]);
        }
        for (int r = 0; r < rg; r++) acc[r] = _mm512_add_ps(acc[r], macc[r]);
    }
    for (int r = 0; r < rg; r++) _mm512_storeu_ps(yt + (size_t)(r0 + r) * N, acc[r]);
}

#define AMX_CASE(KIND, RG) case RG: group_amx(a, K, tile, wb, N, yt, r0, RG, KIND); break;
AMX_ATTR INLINE void tiles_amx(const act_t *a, int R, int K, const uint8_t *w, int t0, int t1,
                               int N, float *y, const int kind, uint8_t *wb) {
    const int nb = K / 32, tb = TILE * block_bytes(kind), qo = quant_off(kind);
    int rows = 0; /* the configured A / C rows */
    for (int t = t0; t < t1; t++) {
        const uint8_t *tile = w + (size_t)t * nb * tb;
        float *yt = y + (size_t)t * TILE;
        if (kind != Q8_0) amx_unpack(tile, nb, tb, qo, wb);
        for (int r0 = 0; r0 < R; r0 += AMX_ROWS) {
            const int rg = R - r0 < AMX_ROWS ? R - r0 : AMX_ROWS;
            if (rg != rows) amx_config(rows = rg);
            switch (rg) {
            AMX_CASE(kind, 1) AMX_CASE(kind, 2) AMX_CASE(kind, 3) AMX_CASE(kind, 4)
            AMX_CASE(kind, 5) AMX_CASE(kind, 6) AMX_CASE(kind, 7) AMX_CASE(kind, 8)
            AMX_CASE(kind, 9) AMX_CASE(kind, 10) AMX_CASE(kind, 11) AMX_CASE(kind, 12)
            AMX_CASE(kind, 13) AMX_CASE(kind, 14) AMX_CASE(kind, 15) AMX_CASE(kind, 16)
            }
        }
    }
    if (rows) _tile_release(); /* NOTE: a thread holding tile state makes context switches
                                  save 8 KB more */
}

/* the per-kind entry points; 4-bit kinds unpack a tile into wb (K / 32 * 512 bytes) */
#define AMX_FN(NAME, KIND)                                                                 \
    AMX_ATTR static void NAME(const act_t *a, int R, int K, const uint8_t *w, int t0, int t1, \
                              int N, float *y, uint8_t *wb) {                              \
        tiles_amx(a, R, K, w, t0, t1, N, y, KIND, wb);                                     \
    }
AMX_FN(q4_1_amx, Q4_1)
AMX_FN(q8_0_amx, Q8_0)
AMX_FN(q4_0_amx, Q4_0)

#include <sys/syscall.h>
#include <unistd.h>
#define SD_ARCH_REQ_XCOMP_PERM 0x1023
#define SD_XFEATURE_XTILEDATA 18

/* 1 when this CPU has AMX-INT8 and the kernel lets this process use it (asked once) */
static int amx_usable(void) {
    static int state = -1;
    if (state < 0) {
        __builtin_cpu_init();
        state = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                syscall(SYS_arch_prctl, SD_ARCH_REQ_XCOMP_PERM, SD_XFEATURE_XTILEDATA) == 0;
    }
    return state;
}
#else
static int amx_usable(void) { return 0; }
#endif /* SD_X86 */

/* The AVX-512 path hands steps of at least this many rows of each kind to AMX where
 * amx_usable (0: never). Off until ggml_tiled.py sets them. */
static int amx_min_rows[3] = {0, 0, 0};

/* kind's AMX threshold; 0 (never) for MXFP4, which has no AMX / AVX-512 code (below) */
static int amx_rows(int kind) { return kind >= 0 && kind <= 2 ? amx_min_rows[kind] : 0; }

int ggml_tiled_amx_usable(void) { return amx_usable(); }

/* sets kind's row threshold (rows < 0: only reads it; 0 turns AMX off; a threshold stays 0
 * where AMX is unusable) and returns the one before; -1 for an unknown kind */
int ggml_tiled_amx_min_rows(int kind, int rows) {
    if (kind < 0 || kind > 2) return -1;
    const int before = amx_min_rows[kind];
    if (rows >= 0) amx_min_rows[kind] = amx_usable() ? rows : 0;
    return before;
}

/* the 16 values a nibble of a transcoded lattice kind stands for (IS_XS; IQ4_XS: KVALUES) into
 * out; 0, or -1 for another kind. ggml_kernels_int.c's transcoder codes w by this table. */
int ggml_tiled_xs_table(int kind, int8_t *out) {
    if (!IS_XS(kind)) return -1;
    memcpy(out, xs_table(kind), 16);
    return 0;
}

/* the bytes of a tiled copy's block of `kind` (16 outputs hold 16 of them) */
int ggml_tiled_packed_bytes(int kind) { return packed_bytes(kind); }

/* 1 when this build and this CPU can run `isa` */
int ggml_tiled_isa_supported(int isa) {
    if (isa == ISA_SCALAR) return 1;
#ifdef SD_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
    if (isa == ISA_AVX512)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

#include "ggml_tiled_kquant.c"
#ifdef SD_X86
TILES_FN(q4_k_avx2, kq_tile_avx2, Q4_K, KQ_ROWS_Q4, AVX2_ATTR)
TILES_FN(q5_k_avx2, kq_tile_avx2, Q5_K, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(q6_k_avx2, kq_tile_avx2, Q6_K, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(q3_k_avx2, kq_tile_avx2, Q3_K, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(q2_k_avx2, kq_tile_avx2, Q2_K, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(iq4_xs_avx2, kq_tile_avx2, IQ4_XS, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(iq3_s_avx2, kq_tile_avx2, IQ3_S, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(iq3_xxs_avx2, kq_tile_avx2, IQ3_XXS, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(iq2_xxs_avx2, kq_tile_avx2, IQ2_XXS, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(iq1_s_avx2, kq_tile_avx2, IQ1_S, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(tq1_0_avx2, kq_tile_avx2, TQ1_0, KQ_ROWS_Q56, AVX2_ATTR)
TILES_FN(tq2_0_avx2, kq_tile_avx2, TQ2_0, KQ_ROWS_Q56, AVX2_ATTR)
#endif

/* amx: the AMX path (wb: this thread's unpacking buffer) instead of `isa`'s */
static void run_tiles(int kind, int isa, int amx, uint8_t *wb, const act_t *a, int R, int K,
                      const uint8_t *w, int t0, int t1, int N, float *y) {
#ifdef SD_X86
    typedef void (*tiles_fn)(const act_t *, int, int, const uint8_t *, int, int, int, float *);
    typedef void (*amx_fn)(const act_t *, int, int, const uint8_t *, int, int, int, float *,
                           uint8_t *);
    static const tiles_fn simd[2][3] = {{q4_1_avx2, q8_0_avx2, q4_0_avx2},      /* by kind */
                                        {q4_1_avx512, q8_0_avx512, q4_0_avx512}};
    static const amx_fn amx_fns[3] = {q4_1_amx, q8_0_amx, q4_0_amx};
    /* NOTE: MXFP4 ships scalar and AVX2 only (the machines it was tested on have no AVX-512 /
     * AMX); the avx512_vnni ISA runs its AVX2 path, which every AVX-512 CPU has, and the same
     * bits as everywhere */
    if (IS_KQ(kind) && isa != ISA_SCALAR) /* (as MXFP4: AVX2 on AVX-512 CPUs too) */
        (kind == Q4_K ? q4_k_avx2 : kind == Q5_K ? q5_k_avx2 : kind == Q6_K ? q6_k_avx2
         : kind == Q3_K ? q3_k_avx2 : kind == Q2_K ? q2_k_avx2 : kind == IQ3_S ? iq3_s_avx2
         : kind == IQ3_XXS ? iq3_xxs_avx2 : kind == IQ2_XXS ? iq2_xxs_avx2
         : kind == IQ1_S ? iq1_s_avx2 : kind == TQ1_0 ? tq1_0_avx2 : kind == TQ2_0 ? tq2_0_avx2
         : iq4_xs_avx2)(a, R, K, w, t0, t1, N, y);
    else if (kind == MXFP4 && isa != ISA_SCALAR) mxfp4_avx2(a, R, K, w, t0, t1, N, y);
    else if (kind == IQ4_NL && isa != ISA_SCALAR) iq4_nl_avx2(a, R, K, w, t0, t1, N, y);
    else if (IS_Q5(kind) && isa != ISA_SCALAR) /* (as MXFP4: AVX2 on AVX-512 CPUs too) */
        (kind == Q5_0 ? q5_0_avx2 : q5_1_avx2)(a, R, K, w, t0, t1, N, y);
    else if (IS_KQ(kind)) kq_tiles_scalar(kind, a, R, K, w, t0, t1, N, y);
    else if (kind == MXFP4 || kind == IQ4_NL || IS_Q5(kind))
        tiles_scalar(kind, a, R, K, w, t0, t1, N, y);
    else if (amx) amx_fns[kind](a, R, K, w, t0, t1, N, y, wb);
    else if (isa == ISA_AVX2 || isa == ISA_AVX512) simd[isa - 1][kind](a, R, K, w, t0, t1, N, y);
    else
#endif
        if (IS_KQ(kind)) kq_tiles_scalar(kind, a, R, K, w, t0, t1, N, y);
        else tiles_scalar(kind, a, R, K, w, t0, t1, N, y);
    (void)isa, (void)amx, (void)wb;
}

/* kind: Q4_1, Q8_0, Q4_0, Q5_0, Q5_1 or MXFP4; x [R, K] and y [R, N] row-major fp32,
 * N % 16 == 0, K % 32 == 0; w: the tiled copy. Returns 0, -1 when scratch memory could not be had, -2 for an ISA this
 * build / CPU cannot run, -3 for N % 16 != 0 (y untouched then). */
int ggml_tiled_linear(int kind, int isa, const float *x, int R, int K, const uint8_t *w, int N,
                      float *y, int nthreads) {
    if (!ggml_tiled_isa_supported(isa)) return -2;
    if (N % TILE) return -3;
    const int nb = K / 32, tiles = N / TILE;
    /* one allocation: q (R * K bytes), then d, s, S, S16 (R * nb 4-byte values each), then AMX's
     * unpacking buffers (4-bit kinds: nb * 512 bytes a thread), 64-aligned */
    const int amx = isa == ISA_AVX512 && amx_rows(kind) && R >= amx_rows(kind);
    const size_t qbytes = ((size_t)R * K + 63) / 64 * 64;
    const size_t fbytes = (16 * (size_t)R * nb + 63) / 64 * 64;
    const size_t wbytes = amx && kind != Q8_0 ? (size_t)nb * 512 : 0;
    const int nt_max = nthreads > 0 ? nthreads : 1;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, qbytes + fbytes + wbytes * nt_max + 64);
    if (!scratch) return -1;
    float *d = (float *)(scratch + qbytes), *s = d + (size_t)R * nb;
    int32_t *S = (int32_t *)(s + (size_t)R * nb), *S16 = S + (size_t)R * nb;
#ifdef SD_X86
    if (isa == ISA_AVX2 || isa == ISA_AVX512)
        quantize_rows_avx2(x, R, K, (int8_t *)scratch, d, s, S, S16);
    else
#endif
        quantize_rows(x, R, K, (int8_t *)scratch, d, s, S, S16);
    const act_t a = {(const int8_t *)scratch, d, s, S, S16};
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int per = (tiles + nt - 1) / nt; /* a contiguous range of tiles per thread */
        const int t0 = t * per, t1 = t0 + per < tiles ? t0 + per : tiles;
        uint8_t *wb = scratch + qbytes + fbytes + wbytes * (size_t)(t < nt_max ? t : 0);
        if (t0 < t1) run_tiles(kind, isa, amx, wb, &a, R, K, w, t0, t1, N, y);
    }
    free(scratch);
    return 0;
}

/* ggml_tiled_linear over E weights at once (a MoE layer's experts, ops/ggml_moe_int.c): x's
 * rows grouped by weight, rows start[e] .. start[e + 1] through weight e (at w + e * stride),
 * y [R, N]; the rows quantized once and every weight's tiles in one OpenMP region. Each row's
 * outputs are those of ggml_tiled_linear on that weight (the same operations per lane, AMX
 * where a weight's rows reach its threshold). Returns as ggml_tiled_linear. */
int ggml_tiled_grouped(int kind, int isa, const float *x, int R, int K, const int64_t *start,
                       int E, const uint8_t *w, int64_t stride, int N, float *y, int nthreads) {
    if (!ggml_tiled_isa_supported(isa)) return -2;
    if (N % TILE) return -3;
    const int nb = K / 32, tiles = N / TILE;
    int amx_any = 0;
    for (int e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        amx_any |= isa == ISA_AVX512 && amx_rows(kind) && n >= amx_rows(kind);
    }
    const size_t qbytes = ((size_t)R * K + 63) / 64 * 64;
    const size_t fbytes = (16 * (size_t)R * nb + 63) / 64 * 64;
    const size_t wbytes = amx_any && kind != Q8_0 ? (size_t)nb * 512 : 0;
    const int nt_max = nthreads > 0 ? nthreads : 1;
    uint8_t *scratch = (uint8_t *)aligned_alloc(64, qbytes + fbytes + wbytes * nt_max + 64);
    if (!scratch) return -1;
    float *d = (float *)(scratch + qbytes), *s = d + (size_t)R * nb;
    int32_t *S = (int32_t *)(s + (size_t)R * nb), *S16 = S + (size_t)R * nb;
#ifdef SD_X86
    if (isa == ISA_AVX2 || isa == ISA_AVX512)
        quantize_rows_avx2(x, R, K, (int8_t *)scratch, d, s, S, S16);
    else
#endif
        quantize_rows(x, R, K, (int8_t *)scratch, d, s, S, S16);
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int per = (tiles + nt - 1) / nt;
        const int t0 = t * per, t1 = t0 + per < tiles ? t0 + per : tiles;
        uint8_t *wb = scratch + qbytes + fbytes + wbytes * (size_t)(t < nt_max ? t : 0);
        for (int e = 0; e < E && t0 < t1; e++) {
            const int64_t s0 = start[e], n = start[e + 1] - s0;
            if (!n) continue;
            const int amx = isa == ISA_AVX512 && amx_rows(kind) && n >= amx_rows(kind);
            const act_t a = {(const int8_t *)scratch + s0 * K, d + s0 * nb, s + s0 * nb,
                             S + s0 * nb, S16 + s0 * nb};
            run_tiles(kind, isa, amx, wb, &a, (int)n, K, w + (size_t)e * stride, t0, t1, N,
                      y + (size_t)s0 * N);
        }
    }
    free(scratch);
    return 0;
}
