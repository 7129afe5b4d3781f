/* GGUF's lattice-codebook kinds, read as stored: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S
 * and IQ1_M (what llama-quantize's IQ1 / IQ2 / IQ3 file types and the "dynamic" low-bit files
 * of large MoE models put on their experts). #included by the exact kernel (ggml_kernels.c) and
 * the integer-dot kernel (ggml_kernels_int.c); each library gets the codebooks once at load
 * (ggml_iq_init, from ops/ggml_iq.py, which reads them from gguf-py).
 *
 * Every kind is a 256-value super-block that decodes to
 *     value[i] = f * s[i / 16] * w[i]
 * with w an int8 (|w| <= 62), s a positive integer scale per 16 values (<= 31) and f the
 * block's fp16 d times a power of two. Each product is exact in fp32 (d has 11 significant bits,
 * s at most 5, w at most 6), so the values equal gguf-py's dequantization bit for bit:
 *   IQ2_XXS (66 bytes): d, then per 32 values 4 grid bytes (256-entry grid of 8 values in
 *            {8, 25, 43}) and a uint32 of four 7-bit sign indices and a 4-bit scale l:
 *            value = d (0.5 + l) / 4 * grid * sign  ->  f = d / 8, s = 2 l + 1, w = +-grid
 *   IQ2_XS (74): d, 32 uint16 (9-bit grid index into 512, 7-bit sign index), 8 bytes of
 *            4-bit scales (one per 16 values, low nibble first); the same f, s, w
 *   IQ2_S (82): d, 32 grid bytes, 32 sign bytes (bit j: value j of 8), 8 bytes of the index's
 *            2 high bits (1024 entries), 8 bytes of 4-bit scales; the same f, s, w
 *   IQ3_XXS (98): d, 64 grid bytes (256 entries of 4 values in {4, 12, ..., 62}), per 32
 *            values a uint32 as IQ2_XXS's: value = d (0.5 + l) / 2 * grid * sign -> f = d / 4
 *   IQ3_S (110): d, 64 grid bytes, 8 bytes of their 9th index bit (512 entries of 4 odd values
 *            1..15), 32 sign bytes, 4 bytes of 4-bit scales per 32: value = d (1 + 2 l) grid
 *            -> f = d, s = 2 l + 1
 *   IQ1_S (50): d, 32 grid bytes, per 32 values a uint16 (3 high index bits per 8 values, a
 *            3-bit scale l, the sign of delta): value = d (2 l + 1) (grid +- 1/8) with grid in
 *            {-1, 0, 1} (2048 entries of 8) -> f = d / 8, s = 2 l + 1, w = 8 grid +- 1
 *   IQ1_M (56): 32 grid bytes, 16 bytes of a nibble per 8 values (3 high index bits, the sign
 *            of delta), 4 uint16 whose low 12 bits are 3-bit scales per 16 values and whose top
 *            nibbles are d; the same f, s, w as IQ1_S
 * A sign index i (7 bits) means the 8 signs of i with bit 7 the parity of i (ggml's ksigns:
 * an even number of minus signs). */

enum { IQ2_XXS = 13, IQ2_XS = 14, IQ2_S = 15, IQ3_XXS = 16, IQ3_S = 17, IQ1_S = 18, IQ1_M = 19,
       TQ1_0 = 22, TQ2_0 = 23 };
/* the kinds read here: the lattice ones and the ternary TQ1_0 / TQ2_0 (s = 1, f = d, w in
 * -1..1: TQ2_0 (66 bytes) 2-bit q - 1, value v from bits 2 ((v >> 5) & 3) of byte
 * 32 (v >> 7) + (v & 31), d last; TQ1_0 (54 bytes) base-3 digits: byte b times 3^m (mod 256),
 * then (that * 3) >> 8 is the digit, minus 1; values 0-159 from bytes 0-31 (m = v / 32),
 * 160-239 from bytes 32-47 (m = (v - 160) / 16), 240-255 from bytes 48-51 (m = (v - 240) / 4),
 * d last) */
#define IS_TQ(kind) ((kind) == TQ1_0 || (kind) == TQ2_0)
#define IS_IQ(kind) (((kind) >= IQ2_XXS && (kind) <= IQ1_M) || IS_TQ(kind))

/* the codebooks, one after another in ggml_iq.py's GRIDS order, as bytes of their values
 * (IQ1's -1 / 0 / 1 as int8) */
#define IQ_G2XXS 0       /* 256 x 8 */
#define IQ_G2XS 2048     /* 512 x 8 */
#define IQ_G2S 6144      /* 1024 x 8 */
#define IQ_G3XXS 14336   /* 256 x 4 */
#define IQ_G3S 15360     /* 512 x 4 */
#define IQ_G1S 17408     /* 2048 x 8 */
#define IQ_GRID_BYTES 33792
static uint8_t IQ_GRIDS[IQ_GRID_BYTES];
static int iq_ready;

/* a 7-bit sign index's 8 signs (bit j set: value j negative) */
static inline uint32_t iq_ksign(uint32_t i) {
    i &= 127; /* (the parity by a 16-entry bit table: no popcnt call where it is no target) */
    return i | ((0x6996u >> ((i ^ (i >> 4)) & 15)) & 1) << 7;
}

/* the same 8 signs as bytes -1 / +1, by sign index (the SIMD paths gather them) */
static int64_t IQ_KSIGNS[128];
/* IQ1_M's deltas of 4 codebook entries as 32 bytes -1 / +1, by their 4 bits (bit j: entry j's
 * delta negative) */
static int8_t IQ_DELTA4[16][32];

/* the codebooks (IQ_GRID_BYTES bytes); before any IQ kind is read */
void ggml_iq_init(const uint8_t *grids) {
    memcpy(IQ_GRIDS, grids, IQ_GRID_BYTES);
    for (uint32_t i = 0; i < 128; i++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)(iq_ksign(i) >> j & 1 ? 0xFF : 0x01) << 8 * j;
        IQ_KSIGNS[i] = (int64_t)v;
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 32; j++) IQ_DELTA4[i][j] = (int8_t)(i >> (j / 8) & 1 ? -1 : 1);
    iq_ready = 1;
}

static inline int iq_bytes(int kind) {
    return kind == IQ2_XXS ? 66 : kind == IQ2_XS ? 74 : kind == IQ2_S ? 82 : kind == IQ3_XXS ? 98
           : kind == IQ3_S ? 110 : kind == IQ1_S ? 50 : kind == TQ1_0 ? 54 : kind == TQ2_0 ? 66
           : 56;
}

static inline uint16_t iq_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline uint32_t iq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* the block's fp16 d (IQ1_M: gathered from its scales' top nibbles) */
static inline uint16_t iq_d_bits(int kind, const uint8_t *b) {
    if (IS_TQ(kind)) return iq_u16(b + iq_bytes(kind) - 2);
    if (kind != IQ1_M) return iq_u16(b);
    return (uint16_t)((iq_u16(b + 48) >> 12) | ((iq_u16(b + 50) >> 8) & 0x00F0) |
                      ((iq_u16(b + 52) >> 4) & 0x0F00) | (iq_u16(b + 54) & 0xF000));
}

/* d's multiple: value = f * s * w with f = d * IQ_F(kind) (a power of two: exact) */
static inline float iq_f_mul(int kind) {
    return kind == IQ3_S || IS_TQ(kind) ? 1.f : kind == IQ3_XXS ? 0.25f : 0.125f;
}

/* the integer scale of values 16 h .. 16 h + 15 */
static inline int iq_scale(int kind, const uint8_t *b, int h) {
    switch (kind) {
    case TQ1_0:
    case TQ2_0: return 1;
    case IQ2_XXS: return 2 * (int)(iq_u32(b + 2 + 8 * (h >> 1) + 4) >> 28) + 1;
    case IQ3_XXS: return 2 * (int)(iq_u32(b + 66 + 4 * (h >> 1)) >> 28) + 1;
    case IQ2_XS: return 2 * ((b[66 + (h >> 1)] >> 4 * (h & 1)) & 15) + 1;
    case IQ2_S: return 2 * ((b[74 + (h >> 1)] >> 4 * (h & 1)) & 15) + 1;
    case IQ3_S: return 2 * ((b[106 + (h >> 2)] >> 4 * ((h >> 1) & 1)) & 15) + 1;
    case IQ1_S: return 2 * ((iq_u16(b + 34 + 2 * (h >> 1)) >> 12) & 7) + 1;
    default: return 2 * ((iq_u16(b + 48 + 2 * (h >> 2)) >> 3 * (h & 3)) & 7) + 1; /* IQ1_M */
    }
}

/* values 8 j .. 8 j + 7 of the block as w (|w| <= 62) */
static inline void iq_eight(int kind, const uint8_t *b, int j, int8_t *w) {
    if (kind == TQ2_0) {
        for (int i = 0; i < 8; i++) {
            const int v = 8 * j + i;
            w[i] = (int8_t)(((b[32 * (v >> 7) + (v & 31)] >> 2 * ((v >> 5) & 3)) & 3) - 1);
        }
        return;
    }
    if (kind == TQ1_0) {
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        for (int i = 0; i < 8; i++) {
            const int v = 8 * j + i;
            const int byte = v < 160 ? b[v & 31] : v < 240 ? b[32 + ((v - 160) & 15)]
                                                            : b[48 + ((v - 240) & 3)];
            const int m = v < 160 ? v >> 5 : v < 240 ? (v - 160) >> 4 : (v - 240) >> 2;
            const uint8_t q = (uint8_t)(byte * pow3[m]);
            w[i] = (int8_t)(((q * 3) >> 8) - 1);
        }
        return;
    }
    const int g = j >> 2, l = j & 3;
    const uint8_t *grid;
    uint32_t signs = 0;
    int delta = 0;
    switch (kind) {
    case IQ2_XXS: {
        const uint32_t aux = iq_u32(b + 2 + 8 * g + 4);
        grid = IQ_GRIDS + IQ_G2XXS + 8 * b[2 + 8 * g + l];
        signs = iq_ksign(aux >> 7 * l);
        break;
    }
    case IQ2_XS: {
        const uint16_t q = iq_u16(b + 2 + 2 * j);
        grid = IQ_GRIDS + IQ_G2XS + 8 * (q & 511);
        signs = iq_ksign(q >> 9);
        break;
    }
    case IQ2_S:
        grid = IQ_GRIDS + IQ_G2S + 8 * (b[2 + j] | ((b[66 + (j >> 2)] >> 2 * (j & 3)) & 3) << 8);
        signs = b[34 + j];
        break;
    case IQ3_XXS: {
        const uint32_t aux = iq_u32(b + 66 + 4 * g);
        signs = iq_ksign(aux >> 7 * l);
        const uint8_t *g0 = IQ_GRIDS + IQ_G3XXS + 4 * b[2 + 2 * j];
        const uint8_t *g1 = IQ_GRIDS + IQ_G3XXS + 4 * b[2 + 2 * j + 1];
        for (int i = 0; i < 4; i++) {
            w[i] = (int8_t)(signs >> i & 1 ? -g0[i] : g0[i]);
            w[i + 4] = (int8_t)(signs >> (i + 4) & 1 ? -g1[i] : g1[i]);
        }
        return;
    }
    case IQ3_S: {
        signs = b[74 + j];
        const int i0 = 2 * j, i1 = 2 * j + 1;
        const uint8_t *g0 = IQ_GRIDS + IQ_G3S + 4 * (b[2 + i0] | ((b[66 + (i0 >> 3)] >> (i0 & 7)) & 1) << 8);
        const uint8_t *g1 = IQ_GRIDS + IQ_G3S + 4 * (b[2 + i1] | ((b[66 + (i1 >> 3)] >> (i1 & 7)) & 1) << 8);
        for (int i = 0; i < 4; i++) {
            w[i] = (int8_t)(signs >> i & 1 ? -g0[i] : g0[i]);
            w[i + 4] = (int8_t)(signs >> (i + 4) & 1 ? -g1[i] : g1[i]);
        }
        return;
    }
    case IQ1_S: {
        const uint16_t qh = iq_u16(b + 34 + 2 * g);
        grid = IQ_GRIDS + IQ_G1S + 8 * (b[2 + j] | ((qh >> 3 * l) & 7) << 8);
        delta = qh & 0x8000 ? -1 : 1;
        break;
    }
    default: { /* IQ1_M */
        const int nib = (b[32 + (j >> 1)] >> 4 * (j & 1)) & 15;
        grid = IQ_GRIDS + IQ_G1S + 8 * (b[j] | (nib & 7) << 8);
        delta = nib & 8 ? -1 : 1;
        break;
    }
    }
    for (int i = 0; i < 8; i++)
        w[i] = delta ? (int8_t)(8 * (int8_t)grid[i] + delta)
                     : (int8_t)(signs >> i & 1 ? -grid[i] : grid[i]);
}

/* the whole block: w[256] and s[16]; returns d's fp16 bits (f = d * iq_f_mul(kind)) */
static inline uint16_t iq_decode(int kind, const uint8_t *b, int8_t *w, int *s) {
    for (int j = 0; j < 32; j++) iq_eight(kind, b, j, w + 8 * j);
    for (int h = 0; h < 16; h++) s[h] = iq_scale(kind, b, h);
    return iq_d_bits(kind, b);
}
