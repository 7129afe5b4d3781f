/* The lattice-codebook kinds (ggml_iq.c) on the integer-dot kernel; #included by
 * ggml_kernels_int.c after its scalar and AVX2 helpers.
 *
 * Per (row r, output n) 8 fp32 lanes; lane g takes group g (values 32 g .. 32 g + 31) of every
 * super-block k, in k order:
 *     acc[g] = fmaf(f_k * d_x[8 k + g], (float)P, acc[g]),
 *     P = s_lo * sum_{i < 16} w_i q_i + s_hi * sum_{16 <= i < 32} w_i q_i   (exact in int32:
 *         |w| <= 62, |q| <= 127, s <= 31),
 * and y = sum8(acc). The scalar path and the AVX2 path (AVX-512 CPUs run it too) compute those
 * integers and those fp32 operations, so their outputs are bit-identical and an output never
 * depends on the other rows or the thread count. The error against the exact fp32 model is the
 * activation rounding's, (d_x / 2) sum |value| per 32 values, as for the other kinds. */

static void iq_tile_scalar(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0,
                           int n1, int N, float *y) {
    const int nk = K / 256, nb = K / 32, bytes = iq_bytes(kind);
    int8_t wv[256];
    int s[16];
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        for (int r = 0; r < R; r++) {
            float acc[8] = {0};
            for (int k = 0; k < nk; k++) {
                const uint8_t *b = row + (size_t)k * bytes;
                const float f = half_to_float(iq_decode(kind, b, wv, s)) * iq_f_mul(kind);
                for (int g = 0; g < 8; g++) {
                    const size_t rb = (size_t)r * nb + 8 * k + g;
                    const int8_t *qx = a->q + rb * 32;
                    int lo = 0, hi = 0;
                    for (int i = 0; i < 16; i++) {
                        lo += wv[32 * g + i] * qx[i];
                        hi += wv[32 * g + 16 + i] * qx[16 + i];
                    }
                    const int p = s[2 * g] * lo + s[2 * g + 1] * hi;
                    acc[g] = fmaf(f * a->d[rb], (float)p, acc[g]);
                }
            }
            y[(size_t)r * N + n] = sum8(acc);
        }
    }
}

#ifdef SD_X86
/* 32 sign bits (bit i: value i negative) as bytes -1 / +1 */
AVX2_FN __m256i iq_signs32(uint32_t bits) {
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                           _mm256_set1_epi8(1));
}

/* (size_t indices: the scaling folds into the load's address, no shift and sign extension) */
AVX2_FN uint64_t iq_g8(int off, size_t idx) {
    uint64_t v;
    memcpy(&v, IQ_GRIDS + off + 8 * idx, 8);
    return v;
}

/* four 7-bit sign indices (bits 0, 7, 14, 21 of aux) as 32 bytes -1 / +1 */
AVX2_FN __m256i iq_ksigns4(uint32_t aux) {
    const __m128i idx = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)aux),
                                                     _mm_setr_epi32(0, 7, 14, 21)),
                                      _mm_set1_epi32(127));
    return _mm256_i32gather_epi64((const long long *)IQ_KSIGNS, idx, 8);
}

/* TQ1_0's group g (values 32 g ..) as bytes w - 1 in -1..1 (ggml_iq.c's iq_eight): each byte q of
 * its source times the byte's 3^m mod 256 (16-bit multiplies of the even and the odd bytes
 * apart: no carry crosses), then the digit (t * 3) >> 8 = (t >= 86) + (t >= 171). Groups 0-4:
 * qs[0..31] times 3^g; 5, 6: qs[32..47] times 3^(2 (g - 5)) and 3^(2 (g - 5) + 1); 7: qs[32..47]
 * times 81, then qh's 4 bytes times 1, 3, 9, 27. */
AVX2_FN __attribute__((always_inline)) __m256i tq1_group_avx2(const uint8_t *b, int g) {
    __m256i q, m;
    if (g < 5) {
        q = _mm256_loadu_si256((const __m256i *)b);
        m = _mm256_set1_epi8((char)(g == 0 ? 1 : g == 1 ? 3 : g == 2 ? 9 : g == 3 ? 27 : 81));
    } else {
        const __m128i hi = _mm_loadu_si128((const __m128i *)(b + 32));
        if (g < 7) {
            q = _mm256_set_m128i(hi, hi);
            m = g == 5 ? _mm256_set_m128i(_mm_set1_epi8(3), _mm_set1_epi8(1))
                       : _mm256_set_m128i(_mm_set1_epi8(27), _mm_set1_epi8(9));
        } else {
            q = _mm256_set_m128i(_mm_set1_epi32((int)iq_u32(b + 48)), hi);
            m = _mm256_set_m128i(_mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27),
                                 _mm_set1_epi8(81));
        }
    }
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i t = _mm256_or_si256(
        _mm256_and_si256(_mm256_mullo_epi16(_mm256_and_si256(q, lo8), _mm256_and_si256(m, lo8)),
                         lo8),
        _mm256_mullo_epi16(_mm256_andnot_si256(lo8, q), _mm256_srli_epi16(m, 8)));
    const __m256i ge86 = _mm256_cmpeq_epi8(_mm256_max_epu8(t, _mm256_set1_epi8(86)), t);
    const __m256i ge171 = _mm256_cmpeq_epi8(_mm256_max_epu8(t, _mm256_set1_epi8((char)171)), t);
    return _mm256_sub_epi8(_mm256_sub_epi8(_mm256_set1_epi8(-1), ge86), ge171);
}

/* group g's 32 values as |w| (unsigned bytes) and bytes carrying w's sign. The 8-byte codebook
 * entries (IQ2 / IQ1) come as four scalar loads at indices read straight from the block (bytes,
 * not one word taken apart by shifts; size_t, so the scaling is the load's addressing): per
 * super-block and row, 1 thread, a 1024 x 4096 matrix (bench/vs_ggml_vec_dot.py, 2-core AMD
 * EPYC, AVX2): IQ2_XXS 40.7 -> 29.7 ns (with iq_scales_avx2's one broadcast), IQ2_XS 49.0 ->
 * 38.9 and IQ2_S 41.3 -> 38.0 (were vpgatherdq), IQ1_S 40.2 -> 33.8, IQ1_M 55.9 -> 51.9 (46.3
 * with its deltas as one load from IQ_DELTA4). Two scales a group as a shuffle of one dword:
 * no faster. llama.cpp's own dot products (libggml-cpu, same blocks): 19.5 / 22.6 / 19.5 /
 * 19.7 / 21.4 ns.
 * (Zen 3's gathers cost more than the loads; the IQ3 kinds' 4-byte entries, 8 a group, stay
 * gathered.) NOTE: reading the indices from a local copy the compiler spilled once stalled on
 * store forwarding (perf: ~40% of IQ2_XS): the reads here are of the weights themselves */
AVX2_FN __attribute__((always_inline)) void iq_group_avx2(const int kind, const uint8_t *b,
                                                         int g, __m256i *u, __m256i *sg) {
    if (kind == TQ2_0) { /* bits 2 (g & 3) of the 32 bytes 32 (g >> 2) .., minus 1 */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 * (g >> 2)));
        const __m256i wv = _mm256_sub_epi8(
            _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * (g & 3))),
                             _mm256_set1_epi8(3)), _mm256_set1_epi8(1));
        *u = _mm256_abs_epi8(wv);
        *sg = wv; /* (0 where w is: the product is 0 either way) */
        return;
    }
    if (kind == TQ1_0) { /* base-3 digits, 32 at once (was the scalar decoder: 30x the time) */
        const __m256i wv = tq1_group_avx2(b, g);
        *u = _mm256_abs_epi8(wv);
        *sg = wv; /* (0 where w is: the product is 0 either way) */
        return;
    }
    if (kind == IQ1_S || kind == IQ1_M) {
        const uint8_t *qb = b + (kind == IQ1_S ? 2 : 0) + 4 * g;
        const uint32_t qh = iq_u16(b + (kind == IQ1_S ? 34 : 32) + 2 * g);
        /* each 8 values' 3 high index bits: IQ1_S's in 3s, IQ1_M's in nibbles (bit 3: delta) */
        const int sh = kind == IQ1_S ? 3 : 4;
        const __m256i gv = _mm256_set_epi64x(
            (long long)iq_g8(IQ_G1S, qb[3] | (size_t)(qh >> 3 * sh & 7) << 8),
            (long long)iq_g8(IQ_G1S, qb[2] | (size_t)(qh >> 2 * sh & 7) << 8),
            (long long)iq_g8(IQ_G1S, qb[1] | (size_t)(qh >> sh & 7) << 8),
            (long long)iq_g8(IQ_G1S, qb[0] | (size_t)(qh & 7) << 8));
        /* delta's signs as bytes -1 / +1: IQ1_S's one per 32 values, IQ1_M's per 8 */
        const __m256i delta = kind == IQ1_S ? _mm256_set1_epi8(qh & 0x8000 ? -1 : 1)
            : _mm256_loadu_si256((const __m256i *)IQ_DELTA4[(qh >> 3 & 1) | (qh >> 6 & 2) |
                                                            (qh >> 9 & 4) | (qh >> 12 & 8)]);
        const __m256i g2 = _mm256_add_epi8(gv, gv), g4 = _mm256_add_epi8(g2, g2);
        const __m256i wv = _mm256_add_epi8(_mm256_add_epi8(g4, g4), delta); /* 8 grid +- 1 */
        *u = _mm256_abs_epi8(wv);
        *sg = wv; /* never 0 */
        return;
    }
    uint32_t bits;
    if (kind == IQ3_XXS || kind == IQ3_S) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * g)));
        if (kind == IQ3_S) { /* bit m of qh: entry m's 9th index bit */
            const __m256i hb = _mm256_srlv_epi32(_mm256_set1_epi32(b[66 + g]),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            idx = _mm256_or_si256(idx, _mm256_slli_epi32(_mm256_and_si256(hb, _mm256_set1_epi32(1)), 8));
        }
        *u = _mm256_i32gather_epi32((const int *)(IQ_GRIDS + (kind == IQ3_XXS ? IQ_G3XXS : IQ_G3S)),
                                    idx, 4);
        if (kind == IQ3_XXS) {
            *sg = iq_ksigns4(iq_u32(b + 66 + 4 * g));
            return;
        } else {
            bits = iq_u32(b + 74 + 4 * g);
        }
    } else if (kind == IQ2_XXS) { /* the index bytes read as bytes: no shifts */
        const uint8_t *qb = b + 2 + 8 * g;
        const uint32_t aux = iq_u32(qb + 4);
        *u = _mm256_set_epi64x((long long)iq_g8(IQ_G2XXS, qb[3]),
                               (long long)iq_g8(IQ_G2XXS, qb[2]),
                               (long long)iq_g8(IQ_G2XXS, qb[1]),
                               (long long)iq_g8(IQ_G2XXS, qb[0]));
        *sg = _mm256_set_epi64x(IQ_KSIGNS[aux >> 21 & 127], IQ_KSIGNS[aux >> 14 & 127],
                                IQ_KSIGNS[aux >> 7 & 127], IQ_KSIGNS[aux & 127]);
        return;
    } else if (kind == IQ2_XS) { /* 4 uint16s: 9 index bits, 7 sign-index bits */
        uint16_t q[4];
        memcpy(q, b + 2 + 8 * g, 8);
        *u = _mm256_set_epi64x((long long)iq_g8(IQ_G2XS, q[3] & 511u),
                               (long long)iq_g8(IQ_G2XS, q[2] & 511u),
                               (long long)iq_g8(IQ_G2XS, q[1] & 511u),
                               (long long)iq_g8(IQ_G2XS, q[0] & 511u));
        *sg = _mm256_set_epi64x(IQ_KSIGNS[q[3] >> 9], IQ_KSIGNS[q[2] >> 9], IQ_KSIGNS[q[1] >> 9],
                                IQ_KSIGNS[q[0] >> 9]);
        return;
    } else { /* IQ2_S: 4 index bytes, their 2 high bits from qh */
        const uint8_t *qb = b + 2 + 4 * g;
        const size_t qh = b[66 + g];
        *u = _mm256_set_epi64x((long long)iq_g8(IQ_G2S, qb[3] | (qh >> 6 & 3) << 8),
                               (long long)iq_g8(IQ_G2S, qb[2] | (qh >> 4 & 3) << 8),
                               (long long)iq_g8(IQ_G2S, qb[1] | (qh >> 2 & 3) << 8),
                               (long long)iq_g8(IQ_G2S, qb[0] | (qh & 3) << 8));
        bits = iq_u32(b + 34 + 4 * g);
    }
    *sg = iq_signs32(bits);
}

/* group g's scales as madd's multiplier: values 0..15 by the first, 16..31 by the second (the
 * kinds with one scale per 32 values: one broadcast) */
AVX2_FN __attribute__((always_inline)) __m256i iq_scales_avx2(const int kind, const uint8_t *b,
                                                             int g) {
    if (kind == IQ2_XS || kind == IQ2_S || kind == IQ1_M)
        return _mm256_set_m128i(_mm_set1_epi16((short)iq_scale(kind, b, 2 * g + 1)),
                                _mm_set1_epi16((short)iq_scale(kind, b, 2 * g)));
    return _mm256_set1_epi16((short)iq_scale(kind, b, 2 * g));
}

/* [P_0 .. P_7]: each v[g]'s 8 int32 lanes summed (exact; any order) */
AVX2_FN __m256i iq_reduce8(const __m256i *v) {
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                         _mm256_hadd_epi32(v[2], v[3]));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                         _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* outputs n0 .. n1 for rows r0 .. r0 + rg - 1 (rg <= ROW_GROUP and kind constants at each
 * call): each super-block decoded once for the group's rows */
AVX2_FN __attribute__((always_inline)) void iq_group_rows(const act_t *a, int K,
                                                         const uint8_t *w, int n0, int n1,
                                                         int N, float *y, int r0, const int rg,
                                                         const int kind) {
    const int nk = K / 256, nb = K / 32, bytes = iq_bytes(kind);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        __m256 acc[ROW_GROUP];
        for (int r = 0; r < rg; r++) acc[r] = _mm256_setzero_ps();
        for (int k = 0; k < nk; k++) {
            const uint8_t *b = row + (size_t)k * bytes;
            _mm_prefetch((const char *)(b + 2 * bytes), _MM_HINT_T0);
            const float f = half_to_float(iq_d_bits(kind, b)) * iq_f_mul(kind);
            __m256i p[ROW_GROUP][8];
            for (int g = 0; g < 8; g++) {
                __m256i u, sg;
                iq_group_avx2(kind, b, g, &u, &sg);
                const __m256i sc = iq_scales_avx2(kind, b, g);
                for (int r = 0; r < rg; r++) {
                    const __m256i qx = _mm256_loadu_si256(
                        (const __m256i *)(a->q + ((size_t)(r0 + r) * nb + 8 * k + g) * 32));
                    p[r][g] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(qx, sg)),
                                                sc);
                }
            }
            for (int r = 0; r < rg; r++) {
                const __m256 dx = _mm256_loadu_ps(a->d + (size_t)(r0 + r) * nb + 8 * k);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(f), dx),
                                         _mm256_cvtepi32_ps(iq_reduce8(p[r])), acc[r]);
            }
        }
        for (int r = 0; r < rg; r++) y[(size_t)(r0 + r) * N + n] = hsum8(acc[r]);
    }
}

/* one row, outputs n and n + 1 together (two independent decode chains for the core; each
 * output's operations are iq_group_rows' own) */
AVX2_FN __attribute__((always_inline)) void iq_pair_row(const act_t *a, int K, const uint8_t *w,
                                                       int n, int N, float *y, int r,
                                                       const int kind) {
    const int nk = K / 256, nb = K / 32, bytes = iq_bytes(kind);
    const uint8_t *row0 = w + (size_t)n * nk * bytes, *row1 = row0 + (size_t)nk * bytes;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int k = 0; k < nk; k++) {
        const uint8_t *b0 = row0 + (size_t)k * bytes, *b1 = row1 + (size_t)k * bytes;
        _mm_prefetch((const char *)(b0 + 2 * bytes), _MM_HINT_T0);
        _mm_prefetch((const char *)(b1 + 2 * bytes), _MM_HINT_T0);
        const float f0 = half_to_float(iq_d_bits(kind, b0)) * iq_f_mul(kind);
        const float f1 = half_to_float(iq_d_bits(kind, b1)) * iq_f_mul(kind);
        __m256i p0[8], p1[8];
        for (int g = 0; g < 8; g++) {
            __m256i u0, s0, u1, s1;
            iq_group_avx2(kind, b0, g, &u0, &s0);
            iq_group_avx2(kind, b1, g, &u1, &s1);
            const __m256i qx = _mm256_loadu_si256(
                (const __m256i *)(a->q + ((size_t)r * nb + 8 * k + g) * 32));
            const __m256i c0 = iq_scales_avx2(kind, b0, g);
            const __m256i c1 = iq_scales_avx2(kind, b1, g);
            p0[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(qx, s0)), c0);
            p1[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(qx, s1)), c1);
        }
        const __m256 dx = _mm256_loadu_ps(a->d + (size_t)r * nb + 8 * k);
        acc0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(f0), dx),
                               _mm256_cvtepi32_ps(iq_reduce8(p0)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(f1), dx),
                               _mm256_cvtepi32_ps(iq_reduce8(p1)), acc1);
    }
    y[(size_t)r * N + n] = hsum8(acc0);
    y[(size_t)r * N + n + 1] = hsum8(acc1);
}

#define IQ_TILE_FN(NAME, KIND)                                                                 \
    AVX2_ATTR static void NAME(const act_t *a, int R, int K, const uint8_t *w, int n0, int n1,  \
                               int N, float *y) {                                              \
        for (int t0 = n0; t0 < n1; t0 += OUT_TILE) {                                           \
            const int t1 = t0 + OUT_TILE < n1 ? t0 + OUT_TILE : n1;                            \
            for (int r0 = 0; r0 < R; r0 += ROW_GROUP) {                                        \
                switch (R - r0 < ROW_GROUP ? R - r0 : ROW_GROUP) {                             \
                case 1: {                                                                  \
                    int n = t0;                                                                \
                    for (; n + 2 <= t1; n += 2) iq_pair_row(a, K, w, n, N, y, r0, KIND);      \
                    if (n < t1) iq_group_rows(a, K, w, n, t1, N, y, r0, 1, KIND);              \
                    break;                                                                     \
                }                                                                              \
                case 2: iq_group_rows(a, K, w, t0, t1, N, y, r0, 2, KIND); break;              \
                case 3: iq_group_rows(a, K, w, t0, t1, N, y, r0, 3, KIND); break;              \
                default: iq_group_rows(a, K, w, t0, t1, N, y, r0, 4, KIND); break;             \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }
IQ_TILE_FN(iq2_xxs_avx2, IQ2_XXS)
IQ_TILE_FN(iq2_xs_avx2, IQ2_XS)
IQ_TILE_FN(iq2_s_avx2, IQ2_S)
IQ_TILE_FN(iq3_xxs_avx2, IQ3_XXS)
IQ_TILE_FN(iq3_s_avx2, IQ3_S)
IQ_TILE_FN(iq1_s_avx2, IQ1_S)
IQ_TILE_FN(iq1_m_avx2, IQ1_M)
IQ_TILE_FN(tq1_0_avx2, TQ1_0)
IQ_TILE_FN(tq2_0_avx2, TQ2_0)

/* Prefill-sized calls (more rows than a row group): each output's weight row decoded once into
 * buffers (|w|, sign bytes, scale vectors, f per super-block), then every row over it: the same
 * integers and fp32 operations per (row, output) as iq_group_rows, the decode paid once per
 * output instead of once per group of 4 rows. 0, or -1 without scratch memory. */
AVX2_FN __attribute__((always_inline)) int iq_rows_buffered(const act_t *a, int R, int K,
                                                           const uint8_t *w, int n0, int n1,
                                                           int N, float *y, const int kind) {
    const int nk = K / 256, nb = K / 32, bytes = iq_bytes(kind);
    __m256i *buf = (__m256i *)aligned_alloc(32, (size_t)nb * 3 * sizeof(__m256i) +
                                                    (size_t)nk * sizeof(float) + 32);
    if (!buf) return -1;
    __m256i *ub = buf, *sb = buf + nb, *cb = buf + 2 * nb;
    float *fb = (float *)(buf + 3 * nb);
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + (size_t)n * nk * bytes;
        for (int k = 0; k < nk; k++) {
            const uint8_t *b = row + (size_t)k * bytes;
            fb[k] = half_to_float(iq_d_bits(kind, b)) * iq_f_mul(kind);
            for (int g = 0; g < 8; g++) {
                iq_group_avx2(kind, b, g, ub + 8 * k + g, sb + 8 * k + g);
                cb[8 * k + g] = iq_scales_avx2(kind, b, g);
            }
        }
        for (int r = 0; r < R; r++) {
            __m256 acc = _mm256_setzero_ps();
            const int8_t *xr = a->q + (size_t)r * K;
            const float *dr = a->d + (size_t)r * nb;
            for (int k = 0; k < nk; k++) {
                __m256i p[8];
                for (int g = 0; g < 8; g++) {
                    const __m256i qx = _mm256_loadu_si256((const __m256i *)(xr + 256 * k + 32 * g));
                    p[g] = _mm256_madd_epi16(_mm256_maddubs_epi16(
                        ub[8 * k + g], _mm256_sign_epi8(qx, sb[8 * k + g])), cb[8 * k + g]);
                }
                acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(fb[k]),
                                                    _mm256_loadu_ps(dr + 8 * k)),
                                      _mm256_cvtepi32_ps(iq_reduce8(p)), acc);
            }
            y[(size_t)r * N + n] = hsum8(acc);
        }
    }
    free(buf);
    return 0;
}

#define IQ_BUFFERED_FN(NAME, KIND)                                                             \
    AVX2_ATTR static int NAME(const act_t *a, int R, int K, const uint8_t *w, int n0, int n1,   \
                              int N, float *y) {                                               \
        return iq_rows_buffered(a, R, K, w, n0, n1, N, y, KIND);                               \
    }
IQ_BUFFERED_FN(iq2_xxs_buf, IQ2_XXS)
IQ_BUFFERED_FN(iq2_xs_buf, IQ2_XS)
IQ_BUFFERED_FN(iq2_s_buf, IQ2_S)
IQ_BUFFERED_FN(iq3_xxs_buf, IQ3_XXS)
IQ_BUFFERED_FN(iq3_s_buf, IQ3_S)
IQ_BUFFERED_FN(iq1_s_buf, IQ1_S)
IQ_BUFFERED_FN(iq1_m_buf, IQ1_M)
IQ_BUFFERED_FN(tq1_0_buf, TQ1_0)
IQ_BUFFERED_FN(tq2_0_buf, TQ2_0)

static int iq_buffered(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0, int n1,
                       int N, float *y) {
    switch (kind) {
    case IQ2_XXS: return iq2_xxs_buf(a, R, K, w, n0, n1, N, y);
    case IQ2_XS: return iq2_xs_buf(a, R, K, w, n0, n1, N, y);
    case IQ2_S: return iq2_s_buf(a, R, K, w, n0, n1, N, y);
    case IQ3_XXS: return iq3_xxs_buf(a, R, K, w, n0, n1, N, y);
    case IQ3_S: return iq3_s_buf(a, R, K, w, n0, n1, N, y);
    case IQ1_S: return iq1_s_buf(a, R, K, w, n0, n1, N, y);
    case TQ1_0: return tq1_0_buf(a, R, K, w, n0, n1, N, y);
    case TQ2_0: return tq2_0_buf(a, R, K, w, n0, n1, N, y);
    default: return iq1_m_buf(a, R, K, w, n0, n1, N, y);
    }
}

static void iq_tile_avx2(int kind, const act_t *a, int R, int K, const uint8_t *w, int n0,
                         int n1, int N, float *y) {
    /* NOTE: the same bits either way; on a failed allocation the row-group path */
    if (R > ROW_GROUP && iq_buffered(kind, a, R, K, w, n0, n1, N, y) == 0) return;
    switch (kind) {
    case IQ2_XXS: iq2_xxs_avx2(a, R, K, w, n0, n1, N, y); break;
    case IQ2_XS: iq2_xs_avx2(a, R, K, w, n0, n1, N, y); break;
    case IQ2_S: iq2_s_avx2(a, R, K, w, n0, n1, N, y); break;
    case IQ3_XXS: iq3_xxs_avx2(a, R, K, w, n0, n1, N, y); break;
    case IQ3_S: iq3_s_avx2(a, R, K, w, n0, n1, N, y); break;
    case IQ1_S: iq1_s_avx2(a, R, K, w, n0, n1, N, y); break;
    case TQ1_0: tq1_0_avx2(a, R, K, w, n0, n1, N, y); break;
    case TQ2_0: tq2_0_avx2(a, R, K, w, n0, n1, N, y); break;
    default: iq1_m_avx2(a, R, K, w, n0, n1, N, y); break;
    }
}
#endif /* SD_X86 */
