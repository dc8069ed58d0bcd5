/* The SiLU-gated experts of one MoE layer for decode, over bf16, int8 or int4 slot pools:
 * each weight row read once, in place, in memory order, with the GEMVs' inner loops (rows.h);
 * quantized rows are widened to bf16 in registers and their scales applied to the sums, so a
 * quantized expert costs its stored bytes. Built with bf16_gemv.c into one library
 * (mox/kernels/native.py); the plain-C paths compute the same sums everywhere.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "rows.h"

/* int8 weights (one float scale per row, applied by the caller): each 32 values widened to
 * bf16 (exact: |v| <= 127) and dotted like bf16 weights */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline __m512bh widen_i8(const int8_t *w) {
    __m256i b = _mm256_loadu_si256((const __m256i *)w);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline void row_i8_avx512(const uint16_t *x, int64_t ldx, const int8_t *row, float *out,
                                 int64_t ldy, int M, int64_t K) {
    __m512 acc[MAX_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512bh w0 = widen_i8(row + k), w1 = widen_i8(row + k + 32);
        for (int m = 0; m < M; m++) {
            const uint16_t *xm = x + m * ldx + k;
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xm), w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
        }
    }
    if (k < K) {
        __m512bh w0 = widen_i8(row + k);
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0],
                                         (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w0);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

static void row_i8_plain(const uint16_t *x, int64_t ldx, const int8_t *row, float *out,
                         int64_t ldy, int M, int64_t K) {
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++)
            sum += bf16_to_f32(x[m * ldx + k]) * (float)row[k];
        out[m * ldy] = sum;
    }
}

/* int4 weights in groups (`group` values sharing one float scale, a multiple of 32): 32
 * values are 16 bytes, byte i holding values 2i (low nibble) and 2i + 1 (high), each + 8. They
 * are dotted with x deinterleaved per 32 values (x'[i] = x[2i], x'[16 + i] = x[2i + 1]), so
 * the low nibbles meet the first 16 and the high nibbles the last 16 without a shuffle. */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline __m512bh widen_i4(const uint8_t *w) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w));
    __m512i eight = _mm512_set1_epi32(8);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)),
                                                    eight));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline void row_i4_avx512(const uint16_t *x, int64_t ldx, const uint8_t *row,
                                 const float *scales, int64_t group, float *out, int64_t ldy,
                                 int M, int64_t K) {
    __m512 total[MAX_ROWS];
    for (int m = 0; m < M; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += group) {
        __m512 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        int64_t end = g0 + group < K ? g0 + group : K;
        for (int64_t k = g0; k < end; k += 32) {
            __m512bh w = widen_i4(row + k / 2);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m],
                                          (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w);
        }
        __m512 scale = _mm512_set1_ps(scales[g0 / group]);
        for (int m = 0; m < M; m++) total[m] = _mm512_fmadd_ps(acc[m], scale, total[m]);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(total[m]);
}

static void row_i4_plain(const uint16_t *x, int64_t ldx, const uint8_t *row,
                         const float *scales, int64_t group, float *out, int64_t ldy, int M,
                         int64_t K) {
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++) {      /* k indexes x' (deinterleaved) */
            int64_t i = k % 32;
            uint8_t byte = row[k / 32 * 16 + i % 16];
            int v = (i < 16 ? byte & 15 : byte >> 4) - 8;
            sum += bf16_to_f32(x[m * ldx + k]) * (float)v * scales[k / group];
        }
        out[m * ldy] = sum;
    }
}

/* a row of x (K a multiple of 32) into the int4 kernels' order, in place */
static void deinterleave32(uint16_t *x, int64_t K) {
    uint16_t tmp[32];
    for (int64_t c = 0; c < K; c += 32) {
        for (int i = 0; i < 16; i++) {
            tmp[i] = x[c + 2 * i];
            tmp[16 + i] = x[c + 2 * i + 1];
        }
        memcpy(x + c, tmp, sizeof tmp);
    }
}

enum { WEIGHTS_BF16, WEIGHTS_INT8, WEIGHTS_INT4 };

/* A slot pool as the MoE kernel reads it: slot s's rows [N, K] at w + s * stride elements
 * (bytes for int8 and int4); int8: `scale` one float per row, slot s's at
 * scale + s * scale_stride; int4: K / group floats per row. */
typedef struct {
    const void *w;
    int64_t stride;
    int kind;
    const float *scale;
    int64_t scale_stride;
    int64_t group;
} pool_t;

/* row n of slot s against `count` x rows */
static void pool_rows_dot(const uint16_t *x, int64_t ldx, int64_t count, pool_t p, int64_t s,
                          int64_t n, float *out, int64_t ldy, int64_t K, int fast) {
    if (p.kind == WEIGHTS_BF16) {
        rows_dot(x, ldx, count, (const uint16_t *)p.w + s * p.stride + n * K, out, ldy, K,
                 fast);
        return;
    }
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        const uint16_t *xc = x + c * ldx;
        float *oc = out + c * ldy;
        if (p.kind == WEIGHTS_INT4) {
            const uint8_t *row = (const uint8_t *)p.w + s * p.stride + n * (K / 2);
            const float *scales = p.scale + s * p.scale_stride + n * (K / p.group);
            if (fast)
                row_i4_avx512(xc, ldx, row, scales, p.group, oc, ldy, m, K);
            else
                row_i4_plain(xc, ldx, row, scales, p.group, oc, ldy, m, K);
            continue;
        }
        const int8_t *row = (const int8_t *)p.w + s * p.stride + n * K;
        if (fast)
            row_i8_avx512(xc, ldx, row, oc, ldy, m, K);
        else
            row_i8_plain(xc, ldx, row, oc, ldy, m, K);
        float scale = p.scale[s * p.scale_stride + n];
        for (int j = 0; j < m; j++)
            oc[j * ldy] *= scale;
    }
}

/* The SiLU-gated experts of one MoE layer for a few rows each (decode), in one call.
 * `rows` [P, H] bf16: the tokens' hidden states gathered and sorted by slot; active slot a
 * owns rows [starts[a], starts[a] + counts[a]). Weights read in place from the slot pools:
 * w13 slot s ([2I, H]: gate rows, then up rows), w2 ([H, I]).
 * Out: `down` [P, H] f32 = row_weight * (silu(gate) * up) @ w2[s]^T. Scratch: `gate_up`
 * [P, 2I] f32, `act` [P, I] bf16. Each weight is read once, in memory order, split across
 * the threads; the activation is rounded to bf16 once, as the down projection reads it. */
static int moe_silu(const uint16_t *rows, pool_t p13, pool_t p2, const int64_t *slots,
                    const int64_t *starts, const int64_t *counts, int64_t num_active,
                    const float *row_weights, int64_t H, int64_t I, float *gate_up,
                    uint16_t *act, float *down, int fast) {
    if (fast && (H % 32 != 0 || I % 32 != 0 || !mox_has_avx512bf16()))
        return -1;
    if (p13.kind == WEIGHTS_INT4 && (H % 32 || I % 32 || p13.group % 32 || H % p13.group
                                     || I % p13.group))
        return -1;
    int64_t n13 = 2 * I, num_rows = 0;
    for (int64_t a = 0; a < num_active; a++)
        num_rows += counts[a];
    #pragma omp parallel
    {
        if (p13.kind == WEIGHTS_INT4) {
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < num_rows; p++)
                deinterleave32((uint16_t *)rows + p * H, H);
        }
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < num_active * n13; j++) {
            int64_t a = j / n13, n = j % n13;
            pool_rows_dot(rows + starts[a] * H, H, counts[a], p13, slots[a], n,
                          gate_up + starts[a] * n13 + n, n13, H, fast);
        }
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < num_rows * I; j++) {
            int64_t p = j / I, i = j % I;
            float g = gate_up[p * n13 + i], u = gate_up[p * n13 + I + i];
            act[j] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
        }
        if (p2.kind == WEIGHTS_INT4) {
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < num_rows; p++)
                deinterleave32(act + p * I, I);
        }
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < num_active * H; j++) {
            int64_t a = j / H, h = j % H;
            float *out = down + starts[a] * H + h;
            pool_rows_dot(act + starts[a] * I, I, counts[a], p2, slots[a], h, out, H, I, fast);
            for (int64_t c = 0; c < counts[a]; c++)
                out[c * H] *= row_weights[starts[a] + c];
        }
    }
    return 0;
}

/* bf16 slot pools: w13 slot s at w13 + s * s13, w2 at w2 + s * s2 (elements). */
int mox_moe_silu_bf16(const uint16_t *rows, const uint16_t *w13, int64_t s13,
                      const uint16_t *w2, int64_t s2, const int64_t *slots,
                      const int64_t *starts, const int64_t *counts, int64_t num_active,
                      const float *row_weights, int64_t H, int64_t I, float *gate_up,
                      uint16_t *act, float *down, int fast) {
    pool_t p13 = {w13, s13, WEIGHTS_BF16, 0, 0, 0}, p2 = {w2, s2, WEIGHTS_BF16, 0, 0, 0};
    return moe_silu(rows, p13, p2, slots, starts, counts, num_active, row_weights, H, I,
                    gate_up, act, down, fast);
}

/* Quantized slot pools: int8 (`group` 0) with one float32 scale per output row, w13's at
 * sc13 + s * ss13 ([2I]), w2's at sc2 + s * ss2 ([H]); or int4 in groups of `group` inputs
 * ([2I, H / group], [H, I / group]), which permutes `rows` in place (deinterleave32). */
int mox_moe_silu_quantized(const uint16_t *rows, const void *w13, int64_t s13,
                           const float *sc13, int64_t ss13, const void *w2, int64_t s2,
                           const float *sc2, int64_t ss2, int64_t group, const int64_t *slots,
                           const int64_t *starts, const int64_t *counts, int64_t num_active,
                           const float *row_weights, int64_t H, int64_t I, float *gate_up,
                           uint16_t *act, float *down, int fast) {
    int kind = group ? WEIGHTS_INT4 : WEIGHTS_INT8;
    pool_t p13 = {w13, s13, kind, sc13, ss13, group}, p2 = {w2, s2, kind, sc2, ss2, group};
    return moe_silu(rows, p13, p2, slots, starts, counts, num_active, row_weights, H, I,
                    gate_up, act, down, fast);
}
