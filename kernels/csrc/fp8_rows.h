/* FP8 (E4M3) weight rows against bf16 activations (the MoE kernel's inner loop for FP8 slot
 * pools, moe_experts.c): FP8 weights are not integers, so they meet the activations as they
 * are, each byte widened in registers: to bf16 (its exponent rebiased) for AVX512-BF16, to
 * float32 through F16C for AVX2. One scale per `span` values of a row (block-wise: the
 * block's columns; per channel: the row).
 */
#ifndef MOX_FP8_ROWS_H
#define MOX_FP8_ROWS_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"
#include "quant_rows.h"
#include "rows.h"

/* E4M3 (bias 7) -> bf16 (bias 127): normals rebias the exponent (+120: the exponent field
 * sits 7 bits up in bf16, 3 in E4M3, hence the shift of 4); subnormals m * 2^-9 (m = 1..7)
 * are normal bf16 values, looked up (the table padded to the 32 lanes one permute reads).
 * E4M3FN's NaN (0x7f, 0xff) comes out as +-480: weights hold none. */
#define FP8_REBIAS (120 << 7)
static const uint16_t FP8_SUBNORMAL_BF16[32] = {0, 0x3B00, 0x3B80, 0x3BC0,
                                                0x3C00, 0x3C20, 0x3C40, 0x3C60};

static inline uint16_t fp8_to_bf16(uint8_t v) {
    uint16_t em = v & 0x7f, sign = (uint16_t)((v & 0x80) << 8);
    return sign | (em < 8 ? FP8_SUBNORMAL_BF16[em] : (uint16_t)((em << 4) + FP8_REBIAS));
}

/* 32 FP8 weights as bf16 */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline __m512bh fp8_as_bf16(const uint8_t *w) {
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    __m512i em = _mm512_and_si512(v, _mm512_set1_epi16(0x7f));
    __m512i sign = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8);
    __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(FP8_REBIAS));
    __m512i sub = _mm512_permutexvar_epi16(em, _mm512_loadu_si512(FP8_SUBNORMAL_BF16));
    __mmask32 tiny = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8));
    return (__m512bh)_mm512_or_si512(sign, _mm512_mask_blend_epi16(tiny, normal, sub));
}

/* one FP8 weight row (K values, one scale per `span` of them) against bf16 x rows */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static void row_fp8_avx512(const uint16_t *x, int64_t ldx, int M, const uint8_t *row,
                           const float *wscale, int64_t span, int64_t K, float *out,
                           int64_t ldy) {
    __m512 total[MAX_ROWS];
    for (int m = 0; m < M; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += span) {
        __m512 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = g0; k < g0 + span; k += 32) {
            __m512bh w = fp8_as_bf16(row + k);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m],
                                          (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w);
        }
        for (int m = 0; m < M; m++)
            total[m] = _mm512_fmadd_ps(acc[m], _mm512_set1_ps(wscale[g0 / span]), total[m]);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(total[m]);
}

/* 16 FP8 (E4M3) weights as float32, 2^-8 of their value (the caller's scale takes the 2^8):
 * an E4M3 byte s.eeee.mmm moved into a half's bits (sign at 15, eeee.mmm at 13..7) is an IEEE
 * half of value 2^-8 times the byte's, subnormals included (E4M3 bias 7, half 15), and F16C
 * widens halves exactly. Four integer ops and two conversions per 16 weights, where
 * rebiasing floats with a blend for subnormals took eleven per 8. E4M3FN's NaN reads +-480,
 * as fp8_to_bf16. */
#define FP8_HALF_SHIFT 7            /* E4M3's eeee.mmm (bits 6..0) to a half's bits 13..7 */
#define FP8_HALF_SIGN_SHIFTED 0x4000 /* ... where its sign lands: bit 14 */
#define FP8_HALF_SCALE 256.0f        /* the half's value is 2^-8 of the byte's */

__attribute__((target("avx2,fma,f16c")))
static inline void fp8_as_f32x16(const uint8_t *w, __m256 *lo, __m256 *hi) {
    __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w)),
                                  FP8_HALF_SHIFT);
    /* the sign bit added to itself: the sign at bit 15, bit 14 clear */
    __m256i half = _mm256_add_epi16(
        t, _mm256_and_si256(t, _mm256_set1_epi16(FP8_HALF_SIGN_SHIFTED)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(half));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1));
}

/* row_fp8_avx512 on AVX2: FP8 weights (fp8_as_f32x16) and bf16 activations widened to
 * float32, 16 at a time into two accumulators a row, so the chain of multiply-adds waits on
 * itself half as long (`span` a multiple of 16); compiled per row count (ROWS_CONSTANT), so
 * the accumulators stay in registers */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void row_fp8_avx2_m(
        const uint16_t *x, int64_t ldx, const int M, const uint8_t *row, const float *wscale,
        int64_t span, int64_t K, float *out, int64_t ldy) {
    __m256 total[MAX_ROWS];
    for (int m = 0; m < M; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += span) {
        __m256 acc[2][MAX_ROWS];
        for (int m = 0; m < M; m++) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + span; k += 16) {
            __m256 lo, hi;
            fp8_as_f32x16(row + k, &lo, &hi);
            for (int m = 0; m < M; m++) {
                acc[0][m] = _mm256_fmadd_ps(widen8(x + m * ldx + k), lo, acc[0][m]);
                acc[1][m] = _mm256_fmadd_ps(widen8(x + m * ldx + k + 8), hi, acc[1][m]);
            }
        }
        __m256 scale = _mm256_set1_ps(wscale[g0 / span] * FP8_HALF_SCALE);
        for (int m = 0; m < M; m++)
            total[m] = _mm256_fmadd_ps(_mm256_add_ps(acc[0][m], acc[1][m]), scale, total[m]);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = sum8(total[m]);
}

__attribute__((target("avx2,fma,f16c")))
static void row_fp8_avx2(const uint16_t *x, int64_t ldx, int M, const uint8_t *row,
                         const float *wscale, int64_t span, int64_t K, float *out,
                         int64_t ldy) {
    ROWS_CONSTANT(M, row_fp8_avx2_m, x, ldx, row, wscale, span, K, out, ldy)
}

static void row_fp8_plain(const uint16_t *x, int64_t ldx, int M, const uint8_t *row,
                          const float *wscale, int64_t span, int64_t K, float *out,
                          int64_t ldy) {
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++)
            sum += wscale[k / span] * bf16_to_f32(x[m * ldx + k])
                   * bf16_to_f32(fp8_to_bf16(row[k]));
        out[m * ldy] = sum;
    }
}

#endif
