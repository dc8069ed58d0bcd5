/* int4 rows in spans of 128, for int4 pools in groups of a multiple of 128 (VNNI and AVX2);
 * the other integer rows are in quant_rows.h. */
#ifndef MOX_INT4_SPAN_ROWS_H
#define MOX_INT4_SPAN_ROWS_H

#include "quant_rows.h"

#define PREFETCH_AHEAD_INT4 2048  /* int4_row_vnni_m */

/* int4 rows in groups of a multiple of 128 against activations in spans of 128 (pairs 128):
 * one 64-byte load holds 128 weights, its low nibbles (the span's even values) meet the
 * span's first 64 activation bytes and its high nibbles the next 64, and the int32 sums of
 * the span's two blocks land apart (lanes 0-7: its first block, 8-15: its second), each
 * block keeping its own scale. Per 128 weights that is one load, three bitwise ops and two
 * VPDPBUSD, where two 32-byte loads (row_q_vnni) also took a lane-crossing insert each, a
 * convert and a multiply-add more. row_q_vnni read int4 experts at ~2/3 of bf16's rate; this
 * loop alone read 1.03-1.10x its rate (perf: most samples wait on the weight load), and with
 * the prefetch PREFETCH_AHEAD_INT4 ahead 1.19x (1 KiB 1.14x, 4 KiB 1.17x; two experts a call,
 * experts preset shapes, alternated builds). Each span's sums go straight into the row's
 * total, scaled by the activation blocks' scales times the weights' group scale, and the
 * offset's share is the span's activation sum (sum128) times that group scale: no per-group
 * accumulator, no divide and no four-way sum a span (a loop of ~50 instructions per 128
 * weights became ~20: with the experts in cache, one thread, 1.4x; from memory at one x row
 * 1.06-1.13x, where the read binds, and at four and eight 1.08x and 1.86x, expert_rate). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int4_row_vnni_m(
        const qrows_t *x, int64_t m0, const int M, const int R, const uint8_t *row,
        int64_t row_bytes, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    int64_t spans = x->K / SPAN, per_group = group / SPAN;
    const int8_t *q = x->q;
    const float *xscale = x->scale, *sum128 = x->sum128;
    __m512i low = _mm512_set1_epi8(15);
    __m512 total[2][MAX_ROWS];
    float corr[2][MAX_ROWS] = {{0}};
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) total[r][m] = _mm512_setzero_ps();
    for (int64_t s = 0, g = 0, group_end = per_group; s < spans; s++) {
        if (s == group_end) {       /* the weights' next scale group (no divide a span) */
            g++;
            group_end += per_group;
        }
        __m512i even[2], odd[2];
        float ws[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *w = row + r * row_bytes + s * (SPAN / 2);
            if (r == R - 1)     /* one a pass: the second row's, which runs ahead of the
                                 * first's (the rows are consecutive) */
                _mm_prefetch((const char *)(w + PREFETCH_AHEAD_INT4), _MM_HINT_T0);
            __m512i bytes = _mm512_loadu_si512(w);
            even[r] = _mm512_and_si512(bytes, low);
            odd[r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            ws[r] = wscale[r * per_row + g];
        }
        for (int m = 0; m < M; m++) {
            int64_t qs = (m0 + m) * spans + s;
            __m512i xe = _mm512_loadu_si512(q + qs * SPAN);
            __m512i xo = _mm512_loadu_si512(q + qs * SPAN + QBLOCK);
            __m512 scales = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xscale[2 * qs]),
                                                 _mm512_set1_ps(xscale[2 * qs + 1]));
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even[r], xe);
                d = _mm512_dpbusd_epi32(d, odd[r], xo);
                total[r][m] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(d), _mm512_mul_ps(scales, _mm512_set1_ps(ws[r])),
                    total[r][m]);
                corr[r][m] += ws[r] * sum128[qs];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)      /* the nibbles hold v + 8 */
            out[m * ldy + r] = _mm512_reduce_add_ps(total[r][m]) - 8.0f * corr[r][m];
}

/* From four x rows, two weight rows a pass: they share each activation load, scale and
 * block sum (1.13x the one-row passes' rate at four x rows, two experts a call; at one and
 * two x rows 0.93x and 0.90x: two rows a pass are two interleaved streams) */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int4_rows_vnni_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t row_bytes,
        int64_t N, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    int64_t n = 0;
    for (; M >= 4 && n + 2 <= N; n += 2)
        int4_row_vnni_m(x, m0, M, 2, w + n * row_bytes, row_bytes, wscale + n * per_row,
                        per_row, group, out + n, ldy);
    for (; n < N; n++)
        int4_row_vnni_m(x, m0, M, 1, w + n * row_bytes, row_bytes, wscale + n * per_row,
                        per_row, group, out + n, ldy);
}

/* int4 weight rows [0, N) against x rows m0 .. m0 + M quantized with pairs 128 */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void int4_rows_vnni(const qrows_t *x, int64_t m0, int M, const uint8_t *w,
                           int64_t row_bytes, int64_t N, const float *wscale, int64_t per_row,
                           int64_t group, float *out, int64_t ldy) {
    ROWS_CONSTANT(M, int4_rows_vnni_m, x, m0, w, row_bytes, N, wscale, per_row, group, out,
                  ldy)
}

/* int4_row_vnni_m's span on AVX2 (no VNNI): a span's 64 bytes are two 32-byte loads, the
 * first holding its first block's 64 values (low nibbles the evens, high the odds) and the
 * second its second block's. VPMADDUBSW meets each nibble half with its activation bytes;
 * the two halves' int16 pairs add before one VPMADDWD (|15 x 127 x 2| x 2 < 2^15: no
 * saturation), one int32 sum a block, scaled into one of two accumulators a row. Per 128
 * weights that is ~26 instructions where row_q_avx2's two blocks, a scalar activation-sum
 * chain and a group epilogue took ~40. */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void int4_row_avx2_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *row, const float *wscale,
        int64_t group, float *out, int64_t ldy) {
    int64_t spans = x->K / SPAN, per_group = group / SPAN;
    const int8_t *q = x->q;
    const float *xscale = x->scale, *sum128 = x->sum128;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total[2][MAX_ROWS];
    float corr[MAX_ROWS] = {0};
    for (int m = 0; m < M; m++) total[0][m] = total[1][m] = _mm256_setzero_ps();
    float ws = wscale[0];
    for (int64_t s = 0, g = 0, group_end = per_group; s < spans; s++) {
        if (s == group_end) {       /* the weights' next scale group (no divide a span) */
            ws = wscale[++g];
            group_end += per_group;
        }
        _mm_prefetch((const char *)(row + s * (SPAN / 2) + PREFETCH_AHEAD_QUANT), _MM_HINT_T0);
        /* each block's nibbles: w0 its evens, w1 its odds */
        bytes_avx2_t a = weight_bytes_avx2(row, s * SPAN, WEIGHTS_INT4);
        bytes_avx2_t b = weight_bytes_avx2(row, s * SPAN + QBLOCK, WEIGHTS_INT4);
        for (int m = 0; m < M; m++) {
            int64_t qs = (m0 + m) * spans + s;
            const int8_t *xs = q + qs * SPAN;      /* evens (64), then odds (64) */
            __m256i d0 = _mm256_add_epi16(
                _mm256_maddubs_epi16(a.w0, _mm256_loadu_si256((const __m256i *)xs)),
                _mm256_maddubs_epi16(a.w1, _mm256_loadu_si256((const __m256i *)(xs + 64))));
            __m256i d1 = _mm256_add_epi16(
                _mm256_maddubs_epi16(b.w0, _mm256_loadu_si256((const __m256i *)(xs + 32))),
                _mm256_maddubs_epi16(b.w1, _mm256_loadu_si256((const __m256i *)(xs + 96))));
            total[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d0, ones)),
                                          _mm256_set1_ps(xscale[2 * qs] * ws), total[0][m]);
            total[1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d1, ones)),
                                          _mm256_set1_ps(xscale[2 * qs + 1] * ws), total[1][m]);
            corr[m] += ws * sum128[qs];
        }
    }
    for (int m = 0; m < M; m++)      /* the nibbles hold v + 8 */
        out[m * ldy] = sum8(_mm256_add_ps(total[0][m], total[1][m])) - 8.0f * corr[m];
}

__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void int4_rows_avx2_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t row_bytes,
        int64_t N, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    for (int64_t n = 0; n < N; n++)
        int4_row_avx2_m(x, m0, M, w + n * row_bytes, wscale + n * per_row, group, out + n,
                        ldy);
}

/* int4 weight rows [0, N) against x rows m0 .. m0 + M quantized with pairs 128, on AVX2 */
__attribute__((target("avx2,fma")))
static void int4_rows_avx2(const qrows_t *x, int64_t m0, int M, const uint8_t *w,
                           int64_t row_bytes, int64_t N, const float *wscale, int64_t per_row,
                           int64_t group, float *out, int64_t ldy) {
    ROWS_CONSTANT(M, int4_rows_avx2_m, x, m0, w, row_bytes, N, wscale, per_row, group, out,
                  ldy)
}

#endif
