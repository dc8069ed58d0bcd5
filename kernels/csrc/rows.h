/* One weight row (bf16) against a few x rows: the inner loops of the decode GEMVs
 * (bf16_gemv.c) and of the MoE experts over bf16 slot pools (moe_experts.c). */
#ifndef MOX_ROWS_H
#define MOX_ROWS_H

#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define MAX_ROWS 8

/* one weight row against M x rows; K a multiple of 32 */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline void row_avx512(const uint16_t *x, int64_t ldx, const uint16_t *row, float *out,
                              int64_t ldy, int M, int64_t K) {
    __m512 acc[MAX_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {          /* two independent chains per x row */
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(row + k + 32));
        for (int m = 0; m < M; m++) {
            const uint16_t *xm = x + m * ldx + k;
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xm), w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
        }
    }
    if (k < K) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0],
                                         (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w0);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

static void row_plain(const uint16_t *x, int64_t ldx, const uint16_t *row, float *out,
                      int64_t ldy, int M, int64_t K) {
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++)
            sum += bf16_to_f32(x[m * ldx + k]) * bf16_to_f32(row[k]);
        out[m * ldy] = sum;
    }
}

/* one weight row against `count` x rows (any count: MAX_ROWS at a time, the row stays in L1) */
static inline void rows_dot(const uint16_t *x, int64_t ldx, int64_t count, const uint16_t *row,
                            float *out, int64_t ldy, int64_t K, int fast) {
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        if (fast)
            row_avx512(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
        else
            row_plain(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
    }
}

#endif
