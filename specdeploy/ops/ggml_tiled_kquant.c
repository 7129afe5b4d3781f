/* The K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, and IQ4_XS, on the tiled kernel (#included by
 * ggml_tiled.c, which gives act_t, the activation quantization, TILE, KEEP, group_at, KVALUES
 * and the ISA attributes).
 *
 * GGUF's 256-value super-blocks (ggml_kernels.c's header) repacked per tile of 16 outputs and
 * super-block, the same bytes (16 GGUF super-blocks); offsets in a tile's super-block:
 *   Q4_K (2304): 16 fp16 d | 16 fp16 dmin | the 12 bytes of 6-bit scales and minimums as 3
 *       words w at 64 + 64 w + 4 o | at 256 + 512 p + 64 j + 4 o + i the byte whose low nibble
 *       is value 4 j + i of group 2 p, its high nibble that of group 2 p + 1 (GGUF's qs[32 p +
 *       4 j + i]): a group's 8 quads of values are 8 vectors of 16 outputs x 4 bytes.
 *   Q5_K (2816): Q4_K's, with GGUF's qh[4 j + i] (bit g: bit 4 of group g's value 4 j + i) at
 *       256 + 64 j + 4 o + i and the nibbles at 768.
 *   Q6_K (3360): 16 fp16 d | the 16 int8 scales s at 32 + 16 s + o | at 288 + 512 r + 64 j +
 *       4 o + i GGUF's ql[32 r + 4 j + i] (the low 4 bits of value 4 j + i: region 2 h + c holds
 *       groups 4 h + c, low nibble, and 4 h + 2 + c, high) | at 2336 + 512 q + 64 j + 4 o + i
 *       GGUF's qh[32 q + 4 j + i] (their high 2 bits, groups 4 q .. 4 q + 3 at bits 2 (g -
 *       4 q)). Values q - 32 (signed).
 *   Q2_K (1344): 16 fp16 d | 16 fp16 dmin | the 16 scale bytes s (low nibble sc, high m) at
 *       64 + 16 s + o | at 320 + 512 q + 64 j + 4 o + i GGUF's qs[32 q + 4 j + i] (bits 2 (g - 4
 *       q): group g's value 4 j + i, 0..3; scale s of values 16 s ..).
 *   Q3_K (1824, GGUF's 1760 + 64): 16 fp16 d | the 16 6-bit scales unpacked, minus 32, an int8
 *       at 32 + 16 s + o | Q2_K's 2-bit planes at 288 | at 1312 + 64 j + 4 o + i GGUF's
 *       hmask[4 j + i] (bit g: group g's bit 2). Values (q | bit 2 << 2) - 4.
 *   IQ4_XS (2176): 16 fp16 d | GGUF's scales_l (4 bytes) at 32 + 4 o | scales_h (2 bytes) at
 *       96 + 2 o | at 128 + 256 g + 64 j + 4 o + i GGUF's qs[16 g + 4 j + i] (low nibble: value
 *       4 j + i of group g, high: 16 + 4 j + i; IQ4_NL's tiled layout a group at a time). Values
 *       KVALUES[nibble], the group's scale ls - 32. IQ3_XXS / IQ3_S / IQ2_XXS / IQ1_S / TQ1_0 /
 *       TQ2_0: the same, from their blocks transcoded to IQ4_XS's bytes (ggml_tiled.c's XS
 *       tables; d times xs_d_mul).
 *
 * Activations as for every tiled kind: 8-bit blocks of 32 (one per group), fp32 d_x and sum s_x.
 * Per (output, row, group g) the integer P_g is exact: Q4_K / Q5_K / IQ4_XS sc_g * sum(q * x_q) (the
 * madd of the int16 pair sums by sc_g), Q6_K / Q3_K / Q2_K sc_lo * (sum over the first 16
 * values) + sc_hi * (the last 16) with signed q (Q3_K: q + 4 summed, then 4 * (sc_lo * S_lo +
 * sc_hi * S_hi) off, S the halves' sums of x_q); |P_g| < 2^24, so float(P_g) is exact. Then per
 * output lane, in super-block and group order: scale = d * d_x (one rounding), acc =
 * fma(float(P_g), scale, acc); Q4_K / Q5_K also macc = fma(-(dmin * m_g), s_x, macc) (an exact
 * product), Q2_K macc = fma(float(m_lo * S_lo + m_hi * S_hi), dmin * d_x, macc); y = acc + macc
 * (Q6_K, Q3_K: acc; Q2_K: acc - macc). The scalar and AVX2 paths perform exactly those fp32 operations, so they give
 * the same bits; AVX-512 CPUs run the AVX2 path (no code of their own: the same bits). The int16
 * sums stay below 2^15: Q4_K 8 quads of pairs <= 2 * 15 * 128, Q5_K 4 of 2 * 31 * 128 before a
 * madd, Q6_K 4 of 2 * 32 * 127 (|q| * x with q's sign). */
#define IS_KQ(kind) (((kind) >= Q4_K && (kind) <= Q6_K) || (kind) >= IQ4_XS)
#define Q6_HIGH 2336 /* Q6_K: where a super-block's high 2-bit planes start */
#define Q3_HMASK 1312 /* Q3_K: its bit 2 plane */
/* 2-bit planes (Q2_K, Q3_K: four groups a byte) or nibbles (two groups a byte) */
#define KQ_PLANES(kind) ((kind) == Q2_K || (kind) == Q3_K)
/* a scale per 16 values, an int8 at 32 + 16 s + o (Q2_K: its byte at 64 + 16 s + o) */
#define KQ_SCALE16(kind) ((kind) == Q6_K || (kind) == Q3_K || (kind) == Q2_K)
/* -dmin * m per 32 values against the exact s_x (Q4_K, Q5_K) */
#define KQ_MIN32(kind) ((kind) == Q4_K || (kind) == Q5_K)

static int kq_quant_off(int kind) {
    return kind == Q4_K ? 256 : kind == Q5_K ? 768 : kind == Q2_K ? 320 : 288;
}

/* super-block b of output o into t, a tile's super-block: GGUF's bytes in runs of 4 (Q3_K's
 * scales unpacked) */
static void kq_repack_block(int kind, const uint8_t *b, uint8_t *t, int o) {
    if (IS_XS(kind)) { /* (the lattice kinds: transcoded to IQ4_XS's bytes first) */
        memcpy(t + 2 * o, b, 2);
        memcpy(t + 32 + 4 * o, b + 4, 4);
        memcpy(t + 96 + 2 * o, b + 2, 2);
        for (int g = 0; g < 8; g++)
            for (int j = 0; j < 4; j++)
                memcpy(t + 128 + 256 * g + 64 * j + 4 * o, b + 8 + 16 * g + 4 * j, 4);
        return;
    }
    /* the quants: regions of 32 GGUF bytes (2-bit planes: 2, nibbles: 4), 8 runs of 4 each */
    const int qo = kq_quant_off(kind), planes = KQ_PLANES(kind) ? 2 : 4;
    const int src = kind == Q6_K ? 0 : kind == Q5_K ? 48 : kind == Q3_K ? 32 : 16;
    for (int r = 0; r < planes; r++)
        for (int j = 0; j < 8; j++) memcpy(t + qo + 512 * r + 64 * j + 4 * o, b + src + 32 * r + 4 * j, 4);
    if (kind == Q2_K) {
        memcpy(t + 2 * o, b + 80, 2);
        memcpy(t + 32 + 2 * o, b + 82, 2);
        for (int s = 0; s < 16; s++) t[64 + 16 * s + o] = b[s];
    } else if (kind == Q3_K) {
        memcpy(t + 2 * o, b + 108, 2);
        for (int s = 0; s < 16; s++) {
            const int lo = (b[96 + (s & 7)] >> 4 * (s >> 3)) & 0xF;
            const int hi = (b[104 + (s & 3)] >> 2 * (s >> 2)) & 3;
            t[32 + 16 * s + o] = (uint8_t)(int8_t)((lo | hi << 4) - 32);
        }
        for (int j = 0; j < 8; j++) memcpy(t + Q3_HMASK + 64 * j + 4 * o, b + 4 * j, 4);
    } else if (kind == Q6_K) {
        memcpy(t + 2 * o, b + 208, 2);
        for (int s = 0; s < 16; s++) t[32 + 16 * s + o] = b[192 + s];
        for (int q = 0; q < 2; q++)
            for (int j = 0; j < 8; j++)
                memcpy(t + Q6_HIGH + 512 * q + 64 * j + 4 * o, b + 128 + 32 * q + 4 * j, 4);
    } else {
        memcpy(t + 2 * o, b, 2);
        memcpy(t + 32 + 2 * o, b + 2, 2);
        for (int w = 0; w < 3; w++) memcpy(t + 64 + 64 * w + 4 * o, b + 4 + 4 * w, 4);
        if (kind == Q5_K)
            for (int j = 0; j < 8; j++) memcpy(t + 256 + 64 * j + 4 * o, b + 16 + 4 * j, 4);
    }
}

/* the nibble region of group g (Q4_K / Q5_K: groups 2 r, 2 r + 1 in region r, low / high
 * nibble; Q6_K as GGUF's ql: groups 4 h + c, 4 h + 2 + c in region 2 h + c) and its nibble */
static inline int kq_region(int kind, int g) {
    return kind == Q6_K ? 2 * (g >> 2) + (g & 1) : g >> 1;
}
static inline int kq_nibble(int kind, int g) { return kind == Q6_K ? (g >> 1) & 1 : g & 1; }

/* value v of group g, output o, in a tile's super-block t (Q6_K: minus 32, Q3_K: minus 4) */
static int kq_value(int kind, const uint8_t *t, int o, int g, int v) {
    if (IS_XS(kind))
        return xs_table(kind)[(t[128 + 256 * g + 64 * ((v & 15) >> 2) + 4 * o + (v & 3)]
                               >> 4 * (v >> 4)) & 0xF];
    const size_t at = (size_t)64 * (v >> 2) + 4 * o + (v & 3);
    if (KQ_PLANES(kind)) {
        const int q = (t[kq_quant_off(kind) + 512 * (g >> 2) + at] >> 2 * (g & 3)) & 3;
        return kind == Q2_K ? q : (q | ((t[Q3_HMASK + at] >> g) & 1) << 2) - 4;
    }
    int q = (t[kq_quant_off(kind) + 512 * kq_region(kind, g) + at] >> 4 * kq_nibble(kind, g)) & 0xF;
    if (kind == Q5_K) q |= ((t[256 + at] >> g) & 1) << 4;
    if (kind == Q6_K) q = (q | ((t[Q6_HIGH + 512 * (g >> 2) + at] >> 2 * (g & 3)) & 3) << 4) - 32;
    return q;
}

/* IQ4_XS: group g's scale of output o, ls - 32 */
static int iq4xs_scale(const uint8_t *t, int o, int g) {
    const int sh = t[96 + 2 * o] | t[97 + 2 * o] << 8;
    return (((t[32 + 4 * o + (g >> 1)] >> 4 * (g & 1)) & 0xF) | ((sh >> 2 * g) & 3) << 4) - 32;
}

/* Q4_K / Q5_K: group g's 6-bit scale and minimum of output o (GGUF's unpacking) */
static void kq_scale_min(const uint8_t *t, int o, int g, int *sc, int *m) {
    uint8_t s[12];
    for (int w = 0; w < 3; w++) memcpy(s + 4 * w, t + 64 + 64 * w + 4 * o, 4);
    *sc = g < 4 ? s[g] & 63 : (s[g + 4] & 0xF) | ((s[g - 4] >> 2) & 0x30);
    *m = g < 4 ? s[g + 4] & 63 : (s[g + 4] >> 4) | ((s[g] >> 2) & 0x30);
}

/* output o's 256 values of tile super-block t, as gguf dequantizes them: (d * sc) * q, minus
 * dmin * m for Q4_K / Q5_K / Q2_K (products, then the difference: numpy's roundings) */
static void kq_values(int kind, const uint8_t *t, int o, float *y) {
    const float d = half_at(t + 2 * o) * xs_d_mul(kind);
    for (int g = 0; g < 8; g++) {
        float s_lo, s_hi, m1 = 0.f, m_hi = 0.f;
        if (IS_XS(kind)) {
            s_lo = s_hi = d * (float)iq4xs_scale(t, o, g);
        } else if (kind == Q6_K || kind == Q3_K) {
            s_lo = d * (float)(int8_t)t[32 + 16 * (2 * g) + o];
            s_hi = d * (float)(int8_t)t[32 + 16 * (2 * g + 1) + o];
        } else if (kind == Q2_K) {
            const uint8_t lo = t[64 + 16 * (2 * g) + o], hi = t[64 + 16 * (2 * g + 1) + o];
            const float dmin = half_at(t + 32 + 2 * o);
            s_lo = d * (float)(lo & 0xF), s_hi = d * (float)(hi & 0xF);
            m1 = dmin * (float)(lo >> 4), m_hi = dmin * (float)(hi >> 4);
        } else {
            int sc, m;
            kq_scale_min(t, o, g, &sc, &m);
            s_lo = s_hi = d * (float)sc;
            m1 = m_hi = half_at(t + 32 + 2 * o) * (float)m;
        }
        for (int v = 0; v < 32; v++) {
            const float p = (v < 16 ? s_lo : s_hi) * (float)kq_value(kind, t, o, g, v);
            y[32 * g + v] = kind == Q6_K || kind == Q3_K || IS_XS(kind) ? p
                            : p - (v < 16 ? m1 : m_hi);
        }
    }
}

/* ---- portable scalar path: the stated operations one output at a time ---- */
static void kq_tiles_scalar(int kind, const act_t *a, int R, int K, const uint8_t *w, int t0,
                            int t1, int N, float *y) {
    const int nk = K / 256, nb = K / 32, tb = TILE * packed_bytes(kind);
    for (int t = t0; t < t1; t++)
        for (int o = 0; o < TILE; o++)
            for (int r = 0; r < R; r++) {
                float acc = 0.f, macc = 0.f;
                for (int k = 0; k < nk; k++) {
                    const uint8_t *blk = w + ((size_t)t * nk + k) * tb;
                    const float d = half_at(blk + 2 * o) * xs_d_mul(kind);
                    for (int g = 0; g < 8; g++) {
                        const size_t rb = (size_t)r * nb + 8 * k + g;
                        const int8_t *qx = a->q + rb * 32;
                        int32_t half[2] = {0, 0}, P;
                        for (int v = 0; v < 32; v++)
                            half[v >> 4] += kq_value(kind, blk, o, g, v) * qx[v];
                        int sc = 0, m = 0;
                        if (IS_XS(kind))
                            P = iq4xs_scale(blk, o, g) * (half[0] + half[1]);
                        else if (kind == Q6_K || kind == Q3_K)
                            P = (int8_t)blk[32 + 16 * (2 * g) + o] * half[0] +
                                (int8_t)blk[32 + 16 * (2 * g + 1) + o] * half[1];
                        else if (kind == Q2_K)
                            P = (blk[64 + 16 * (2 * g) + o] & 0xF) * half[0] +
                                (blk[64 + 16 * (2 * g + 1) + o] & 0xF) * half[1];
                        else {
                            kq_scale_min(blk, o, g, &sc, &m);
                            P = sc * (half[0] + half[1]);
                        }
                        acc = fmaf((float)P, d * a->d[rb], acc);
                        if (KQ_MIN32(kind))
                            macc = fmaf(-(half_at(blk + 32 + 2 * o) * (float)m), a->s[rb], macc);
                        if (kind == Q2_K) { /* the halves' sums of x_q (S16) by their m */
                            const int32_t s16 = a->S16[rb];
                            const int M = (blk[64 + 16 * (2 * g) + o] >> 4) * (int16_t)s16 +
                                          (blk[64 + 16 * (2 * g + 1) + o] >> 4) * (s16 >> 16);
                            macc = fmaf((float)M, half_at(blk + 32 + 2 * o) * a->d[rb], macc);
                        }
                    }
                }
                y[(size_t)r * N + (size_t)t * TILE + o] =
                    KQ_MIN32(kind) ? acc + macc : kind == Q2_K ? acc - macc : acc;
            }
}

#ifdef SD_X86
/* rows sharing one unpacking of a group: Q4_K holds an int16 sum and acc per row, Q5_K / Q6_K
 * an int32 one besides (ymm registers). bench/tiled_ab.py against 4 / 3 and 6 / 5: both slower
 * (Q5_K / Q6_K 4 / 16 rows 0.67-0.85x the time of 3; 5 rows of 5 1.3x those of 4 + 1) */
#define KQ_ROWS_Q4 5
#define KQ_ROWS_Q56 4
#define KQ_MACC_PASS(rg) ((rg) > 2) /* the minimum terms in a pass of their own */
/* The first half's pass asks for the super-block KQ_PF_BLOCKS ahead (past a tile's end: the
 * next tile's), an eighth per group. One super-block ahead, all at once, left the first loads of
 * each group waiting on memory (perf: ~17% of Q6_K's 1-row time on one load); bench/tiled_ab.py
 * against that (2-core AMD EPYC, AVX2, 12 layers of a 1024-wide model): Q6_K 0.76x / 0.83x the
 * time at 1 / 4 rows, Q4_K 0.88x / 0.91x, Q5_K 0.97x / 0.92x; 3 ahead: the same as 2. */
#ifndef KQ_Q6_PAIRS
#define KQ_Q6_PAIRS 1
#endif
#ifndef KQ_PF_BLOCKS
#define KQ_PF_BLOCKS 2
#endif

/* 8 outputs' 6-bit scales (which 0) or minimums (1) of groups 4 q .. 4 q + 3, a byte each in
 * their output's lane: GGUF's unpacking on the 3 scale words of half h */
AVX2_ATTR INLINE __m256i kq_six_bits(const uint8_t *blk, int h, int which, int q) {
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * h));
    const __m256i u1 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * h));
    const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F);
    const __m256i m2 = _mm256_set1_epi8(0x03);
    const __m256i lo = which ? u1 : u0; /* scales 0..3 / minimums 0..3 */
    if (q == 0) return _mm256_and_si256(lo, m6);
    const __m256i low4 = which ? _mm256_and_si256(_mm256_srli_epi32(u2, 4), m4)
                               : _mm256_and_si256(u2, m4);
    return _mm256_or_si256(low4, _mm256_slli_epi32(
        _mm256_and_si256(_mm256_srli_epi32(lo, 6), m2), 4));
}

/* byte g & 3 of each lane of six (kq_six_bits), as the int32 lane */
AVX2_ATTR INLINE __m256i kq_lane_byte(__m256i six, int g) {
    return _mm256_and_si256(_mm256_srlv_epi32(six, _mm256_set1_epi32(8 * (g & 3))),
                            _mm256_set1_epi32(0xFF));
}

/* an int32 lane's value in both of its int16 halves: madd's multiplier */
AVX2_ATTR INLINE __m256i kq_both16(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(v, 16));
}

/* -(dmin * m_g) for 8 outputs (a product, then the sign, as the scalar path) */
AVX2_ATTR INLINE __m256 kq_neg_min(const uint8_t *blk, int h, int g) {
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
    const __m256 m = _mm256_cvtepi32_ps(kq_lane_byte(kq_six_bits(blk, h, 1, g >> 2), g));
    return _mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(dmin, m));
}

/* the per-16 scales of group g of 8 outputs (Q6_K, Q3_K: int8s; Q2_K: the bytes' low
 * nibbles, `mins` their high ones), one a lane: [0] values 0..15, [1] 16..31 */
AVX2_ATTR INLINE void kq_scale16(const uint8_t *blk, int h, int g, const int kind, __m256i *sc,
                                 __m256i *mins) {
    for (int i = 0; i < 2; i++) {
        const __m128i raw = _mm_loadl_epi64(
            (const __m128i *)(blk + (kind == Q2_K ? 64 : 32) + 16 * (2 * g + i) + 8 * h));
        if (kind == Q2_K) {
            const __m256i u = _mm256_cvtepu8_epi32(raw);
            sc[i] = _mm256_and_si256(u, _mm256_set1_epi32(0xF));
            mins[i] = _mm256_srli_epi32(u, 4);
        } else {
            sc[i] = _mm256_cvtepi8_epi32(raw);
        }
    }
}

/* lanes lo and hi as one int32 lane of two int16s (madd by a row's S16: lo S_lo + hi S_hi) */
AVX2_ATTR INLINE __m256i kq_pair16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)),
                           _mm256_slli_epi32(hi, 16));
}

/* half h (outputs 8 h .. 8 h + 7) of a tile, rows r0 .. r0 + rg - 1 */
AVX2_ATTR INLINE void kq_half_avx2(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                   int r0, const int rg, const int kind, const int h) {
    const int nk = K / 256, nb = K / 32, tb = TILE * packed_bytes(kind), qo = kq_quant_off(kind);
    const __m256i mask = _mm256_set1_epi8(KQ_PLANES(kind) ? 0x03 : 0x0F);
    __m256 acc[ROW_GROUP], macc[ROW_GROUP];
    for (int r = 0; r < rg; r++) acc[r] = macc[r] = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        const uint8_t *blk = tile + (size_t)k * tb;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        const int8_t *qx = a->q + (size_t)r0 * K + 256 * k; /* row r0 + r: qx + r * K */
        for (int g = 0; g < 8; g++) {
            if (h == 0) /* an eighth of the super-block KQ_PF_BLOCKS on, a group at a time */
                for (int l = g * tb / 8 / 64 * 64; l < ((g + 1) * tb / 8 + 63) / 64 * 64; l += 64)
                    _mm_prefetch((const char *)blk + KQ_PF_BLOCKS * tb + l, _MM_HINT_T0);
            /* madd's multipliers: the group's (per-16 kinds: its first half's) scale, the
             * second half's; Q3_K / Q2_K: both halves' scales / minimums as int16 pairs */
            __m256i s_a, s_b, s_ab = _mm256_setzero_si256(), m_ab = _mm256_setzero_si256();
            if (KQ_SCALE16(kind)) {
                __m256i sc[2], mins[2];
                kq_scale16(blk, h, g, kind, sc, mins);
                s_a = kq_both16(sc[0]), s_b = kq_both16(sc[1]);
                if (kind == Q3_K) s_ab = kq_pair16(sc[0], sc[1]);
                if (kind == Q2_K) m_ab = kq_pair16(mins[0], mins[1]);
            } else {
                s_a = s_b = kq_both16(kq_lane_byte(kq_six_bits(blk, h, 0, g >> 2), g));
            }
            __m256i p16[ROW_GROUP], p32[ROW_GROUP];
            for (int r = 0; r < rg; r++) p16[r] = p32[r] = _mm256_setzero_si256();
            const uint8_t *qs = blk + qo + 512 * (KQ_PLANES(kind) ? g >> 2 : kq_region(kind, g))
                                + 32 * h;
#pragma GCC unroll 8 /* (j == 3 constant: no branch; Q5_K / Q6_K 0.86-0.9x at 4-16 rows) */
            for (int j = 0; j < 8; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 64 * j));
                __m256i wv = KQ_PLANES(kind) ? _mm256_and_si256(_mm256_srli_epi16(v, 2 * (g & 3)),
                                                                mask)
                             : kq_nibble(kind, g) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)
                                             : _mm256_and_si256(v, mask);
                __m256i wabs = wv;
                if (kind == Q5_K || kind == Q3_K) { /* bit 4 (Q5_K) / bit 2 (Q3_K): bit g */
                    const __m256i hv = _mm256_loadu_si256((const __m256i *)(
                        blk + (kind == Q5_K ? 256 : Q3_HMASK) + 64 * j + 32 * h));
                    wv = _mm256_or_si256(wv, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(hv, g), _mm256_set1_epi8(1)), kind == Q5_K ? 4 : 2));
                    wabs = wv; /* (Q3_K: q + 4, 0..7; 4 * the halves' x_q sums come off P) */
                }
                if (kind == Q6_K) {
                    const __m256i hv = _mm256_loadu_si256(
                        (const __m256i *)(blk + Q6_HIGH + 512 * (g >> 2) + 64 * j + 32 * h));
                    wv = _mm256_sub_epi8(_mm256_or_si256(wv, _mm256_slli_epi16(_mm256_and_si256(
                        _mm256_srli_epi16(hv, 2 * (g & 3)), _mm256_set1_epi8(3)), 4)),
                        _mm256_set1_epi8(32));
                    wabs = _mm256_abs_epi8(wv);
                }
                for (int r = 0; r < rg; r++) {
                    __m256i x = _mm256_set1_epi32(group_at(qx + (size_t)r * K + 32 * g + 4 * j));
                    if (kind == Q6_K) x = _mm256_sign_epi8(x, wv);
                    p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(wabs, x));
                    if (kind != Q4_K && j == 3) { /* the first 16 values: into int32 */
                        p32[r] = _mm256_madd_epi16(p16[r], s_a);
                        p16[r] = _mm256_setzero_si256();
                    }
                    KEEP(p16[r]);
                }
            }
            const __m256 nm = KQ_MIN32(kind) && !KQ_MACC_PASS(rg) ? kq_neg_min(blk, h, g)
                                                                   : _mm256_setzero_ps();
            const __m256 dminv = kind == Q2_K && !KQ_MACC_PASS(rg)
                ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
                : _mm256_setzero_ps();
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + 8 * k + g;
                __m256i P = _mm256_add_epi32(p32[r], _mm256_madd_epi16(p16[r], s_b));
                if (kind == Q3_K) /* - 4 (sc_lo * S_lo + sc_hi * S_hi) */
                    P = _mm256_sub_epi32(P, _mm256_slli_epi32(
                        _mm256_madd_epi16(s_ab, _mm256_set1_epi32(a->S16[rb])), 2));
                const __m256 dx = _mm256_set1_ps(a->d[rb]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P), _mm256_mul_ps(dv, dx), acc[r]);
                if (KQ_MIN32(kind) && !KQ_MACC_PASS(rg))
                    macc[r] = _mm256_fmadd_ps(nm, _mm256_set1_ps(a->s[rb]), macc[r]);
                if (kind == Q2_K && !KQ_MACC_PASS(rg))
                    macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                        m_ab, _mm256_set1_epi32(a->S16[rb]))), _mm256_mul_ps(dminv, dx), macc[r]);
            }
        }
    }
    for (int k = 0; (KQ_MIN32(kind) || kind == Q2_K) && KQ_MACC_PASS(rg) && k < nk; k++) {
        const uint8_t *blk = tile + (size_t)k * tb;
        const __m256 dminv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
        for (int g = 0; g < 8; g++) {
            __m256 nm = _mm256_setzero_ps();
            __m256i m_ab = _mm256_setzero_si256();
            if (kind == Q2_K) {
                __m256i sc[2], mins[2];
                kq_scale16(blk, h, g, kind, sc, mins);
                m_ab = kq_pair16(mins[0], mins[1]);
            } else {
                nm = kq_neg_min(blk, h, g);
            }
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + 8 * k + g;
                if (kind == Q2_K)
                    macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(
                        m_ab, _mm256_set1_epi32(a->S16[rb]))),
                        _mm256_mul_ps(dminv, _mm256_set1_ps(a->d[rb])), macc[r]);
                else
                    macc[r] = _mm256_fmadd_ps(nm, _mm256_set1_ps(a->s[rb]), macc[r]);
            }
        }
    }
    for (int r = 0; r < rg; r++)
        _mm256_storeu_ps(y + (size_t)(r0 + r) * N + 8 * h,
                         KQ_MIN32(kind) ? _mm256_add_ps(acc[r], macc[r])
                         : kind == Q2_K ? _mm256_sub_ps(acc[r], macc[r]) : acc[r]);
}

/* IQ4_XS, half h of a tile: the table's signed values as |w| times x with w's sign, each
 * maddubs result (pairs <= 2 * 127 * 127) madd'ed by the group's scale straight into int32 */
AVX2_ATTR INLINE void iq4xs_half_avx2(const act_t *a, int K, const uint8_t *tile, int N,
                                      float *y, int r0, const int rg, const int h,
                                      const int kind) {
    const int nk = K / 256, nb = K / 32, tb = TILE * packed_bytes(kind);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i nl = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)xs_table(kind)));
    __m256 acc[ROW_GROUP];
    for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        const uint8_t *blk = tile + (size_t)k * tb;
        __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        if (xs_d_mul(kind) != 1.f) /* a power of two: exact */
            dv = _mm256_mul_ps(dv, _mm256_set1_ps(xs_d_mul(kind)));
        const __m256i sl = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
        const __m256i sh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 96 + 16 * h)));
        const int8_t *qx = a->q + (size_t)r0 * K + 256 * k;
        for (int g = 0; g < 8; g++) {
            if (h == 0)
                for (int l = g * tb / 8 / 64 * 64; l < ((g + 1) * tb / 8 + 63) / 64 * 64; l += 64)
                    _mm_prefetch((const char *)blk + KQ_PF_BLOCKS * tb + l, _MM_HINT_T0);
            const __m256i ls = _mm256_or_si256(
                _mm256_and_si256(_mm256_srlv_epi32(sl, _mm256_set1_epi32(8 * (g >> 1) + 4 * (g & 1))),
                                 _mm256_set1_epi32(0xF)),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(sh, _mm256_set1_epi32(2 * g)),
                                                   _mm256_set1_epi32(3)), 4));
            const __m256i sc = kq_both16(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
            __m256i p[ROW_GROUP];
            for (int r = 0; r < rg; r++) p[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256(
                    (const __m256i *)(blk + 128 + 256 * g + 64 * j + 32 * h));
                const __m256i w0 = _mm256_shuffle_epi8(nl, _mm256_and_si256(v, mask));
                const __m256i w1 = _mm256_shuffle_epi8(
                    nl, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
                const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
                for (int r = 0; r < rg; r++) {
                    const int8_t *qr = qx + (size_t)r * K + 32 * g + 4 * j;
                    const __m256i x0 = _mm256_set1_epi32(group_at(qr));
                    const __m256i x1 = _mm256_set1_epi32(group_at(qr + 16));
                    p[r] = _mm256_add_epi32(p[r], _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x0, w0)), sc),
                        _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x1, w1)), sc)));
                    KEEP(p[r]);
                }
            }
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + 8 * k + g;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[r]),
                                         _mm256_mul_ps(dv, _mm256_set1_ps(a->d[rb])), acc[r]);
            }
        }
    }
    for (int r = 0; r < rg; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + 8 * h, acc[r]);
}

/* Q6_K, half h of a tile, two groups at a time: groups 4 q + c and 4 q + 2 + c share their
 * nibble bytes (low / high) and, with the other two of q, their high-bit bytes, so each 32-byte
 * load feeds two weight vectors, and each group's high bits come to bits 4-5 with one shift and
 * one mask (an int16 shift's stray bits fall outside 0x30). Values go in unsigned, q = 0..63
 * (maddubs pairs <= 2 * 63 * 127 = 16002: two fit int16), each two loads' sums madd'ed by the
 * 16 values' scale; the 32 comes off once per group, P = sum(sc * q * x) - 32 (sc_lo S_lo +
 * sc_hi S_hi) (S16: the halves' sums of x_q) = the signed values' P, the same integer as the
 * scalar path's, and the fmas run in group order. bench/tiled_ab.py against the signed one-group
 * loop (kq_half_avx2), 2-core AMD EPYC, AVX2, 12 layers of a 1024-wide model: see the note at
 * KQ_Q6_PAIRS. */
AVX2_ATTR INLINE void q6k_half_avx2(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                    int r0, const int rg, const int h) {
    const int nk = K / 256, nb = K / 32, tb = TILE * packed_bytes(Q6_K);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    __m256 acc[ROW_GROUP];
    for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        const uint8_t *blk = tile + (size_t)k * tb;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
        const int8_t *qx = a->q + (size_t)r0 * K + 256 * k;
        __m256i sc[16], P[8][ROW_GROUP];
        for (int s = 0; s < 16; s++) /* scale s (values 16 s ..) in both int16 halves */
            sc[s] = kq_both16(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(blk + 32 + 16 * s + 8 * h))));
        for (int p = 0; p < 4; p++) {
            const int q = p >> 1, c = p & 1, ga = 4 * q + c, gb = ga + 2;
            if (h == 0) /* a quarter of the super-block KQ_PF_BLOCKS on */
                for (int l = p * tb / 4 / 64 * 64; l < ((p + 1) * tb / 4 + 63) / 64 * 64; l += 64)
                    _mm_prefetch((const char *)blk + KQ_PF_BLOCKS * tb + l, _MM_HINT_T0);
            const uint8_t *ql = blk + 288 + 512 * (2 * q + c) + 32 * h;
            const uint8_t *qh = blk + Q6_HIGH + 512 * q + 32 * h;
            __m256i pa[ROW_GROUP], pb[ROW_GROUP];
            for (int r = 0; r < rg; r++) pa[r] = pb[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                __m256i wa[2], wb[2];
                for (int e = 0; e < 2; e++) {
                    const __m256i L = _mm256_loadu_si256((const __m256i *)(ql + 64 * (j + e)));
                    const __m256i H = _mm256_loadu_si256((const __m256i *)(qh + 64 * (j + e)));
                    wa[e] = _mm256_or_si256(_mm256_and_si256(L, m4), _mm256_and_si256(
                        c ? _mm256_slli_epi16(H, 2) : _mm256_slli_epi16(H, 4), m30));
                    wb[e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L, 4), m4),
                                            _mm256_and_si256(c ? _mm256_srli_epi16(H, 2) : H, m30));
                }
                const __m256i sa = sc[2 * ga + (j >= 4)], sb = sc[2 * gb + (j >= 4)];
                for (int r = 0; r < rg; r++) {
                    const int8_t *xa = qx + (size_t)r * K + 32 * ga + 4 * j, *xb = xa + 64;
                    pa[r] = _mm256_add_epi32(pa[r], _mm256_madd_epi16(_mm256_add_epi16(
                        _mm256_maddubs_epi16(wa[0], _mm256_set1_epi32(group_at(xa))),
                        _mm256_maddubs_epi16(wa[1], _mm256_set1_epi32(group_at(xa + 4)))), sa));
                    pb[r] = _mm256_add_epi32(pb[r], _mm256_madd_epi16(_mm256_add_epi16(
                        _mm256_maddubs_epi16(wb[0], _mm256_set1_epi32(group_at(xb))),
                        _mm256_maddubs_epi16(wb[1], _mm256_set1_epi32(group_at(xb + 4)))), sb));
                    KEEP(pa[r]);
                    KEEP(pb[r]);
                }
            }
            /* - 32 (sc_lo S_lo + sc_hi S_hi): the scales as one int32 lane of two int16s */
            const __m256i ab_a = _mm256_or_si256(_mm256_and_si256(sc[2 * ga], lo16),
                                                 _mm256_andnot_si256(lo16, sc[2 * ga + 1]));
            const __m256i ab_b = _mm256_or_si256(_mm256_and_si256(sc[2 * gb], lo16),
                                                 _mm256_andnot_si256(lo16, sc[2 * gb + 1]));
            for (int r = 0; r < rg; r++) {
                const size_t rb = (size_t)(r0 + r) * nb + 8 * k;
                P[ga][r] = _mm256_sub_epi32(pa[r], _mm256_slli_epi32(
                    _mm256_madd_epi16(ab_a, _mm256_set1_epi32(a->S16[rb + ga])), 5));
                P[gb][r] = _mm256_sub_epi32(pb[r], _mm256_slli_epi32(
                    _mm256_madd_epi16(ab_b, _mm256_set1_epi32(a->S16[rb + gb])), 5));
            }
        }
        for (int g = 0; g < 8; g++)
            for (int r = 0; r < rg; r++) {
                const __m256 dx = _mm256_set1_ps(a->d[(size_t)(r0 + r) * nb + 8 * k + g]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(P[g][r]), _mm256_mul_ps(dv, dx),
                                         acc[r]);
            }
    }
    for (int r = 0; r < rg; r++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + 8 * h, acc[r]);
}

AVX2_ATTR INLINE void kq_tile_avx2(const act_t *a, int K, const uint8_t *tile, int N, float *y,
                                   int r0, const int rg, const int kind) {
    if (IS_XS(kind)) {
        iq4xs_half_avx2(a, K, tile, N, y, r0, rg, 0, kind);
        iq4xs_half_avx2(a, K, tile, N, y, r0, rg, 1, kind);
        return;
    }
    if (kind == Q6_K && KQ_Q6_PAIRS) {
        q6k_half_avx2(a, K, tile, N, y, r0, rg, 0);
        q6k_half_avx2(a, K, tile, N, y, r0, rg, 1);
        return;
    }
    kq_half_avx2(a, K, tile, N, y, r0, rg, kind, 0);
    kq_half_avx2(a, K, tile, N, y, r0, rg, kind, 1);
}
#endif /* SD_X86 */
