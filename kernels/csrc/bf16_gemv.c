/* bf16 matrix-vector products for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows
 * m of x (decode: one per sequence) against a row-major weight w [N, K] read in place.
 *
 * Decode on a CPU is bound by reading the weight once; the GEMMs torch dispatches to for a
 * few rows read it at half the machine's rate. Here each thread walks its rows of w in
 * memory order (one linear stream, which the hardware prefetcher follows at the full read
 * rate), every x row reusing each loaded cache line: AVX512-BF16 dot products (vdpbf16ps)
 * into fp32 accumulators. A plain-C path computes the same sums on CPUs without AVX512-BF16
 * (tests run it everywhere; mox only routes work here where the fast path exists).
 *
 * The MoE experts of a layer take the same products over bf16 or int8 slot pools (int8 rows
 * widened to bf16 in registers, the row's scale applied to its sums).
 *
 * Built at first use by mox/kernels/native.py (cc -O3 -fopenmp); threads are OpenMP's, the
 * same runtime torch uses, so torch.set_num_threads governs both.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MAX_ROWS 8

int mox_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

/* a row's M sums into y (float32, or bf16 rounded to nearest even) at column n */
static inline void store(void *y, int64_t ldy, int64_t n, const float *sums, int M,
                         int out_bf16) {
    for (int m = 0; m < M; m++) {
        if (out_bf16)
            ((uint16_t *)y)[m * ldy + n] = f32_to_bf16(sums[m]);
        else
            ((float *)y)[m * ldy + n] = sums[m];
    }
}

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

static void gemv(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *y,
                 int64_t ldy, int M, int64_t N, int64_t K, int out_bf16, int fast) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float sums[MAX_ROWS];
        if (fast)
            row_avx512(x, ldx, w + n * ldw, sums, 1, M, K);
        else
            row_plain(x, ldx, w + n * ldw, sums, 1, M, K);
        store(y, ldy, n, sums, M, out_bf16);
    }
}

/* one weight row against `count` x rows (any count: MAX_ROWS at a time, the row stays in L1) */
static void rows_dot(const uint16_t *x, int64_t ldx, int64_t count, const uint16_t *row,
                     float *out, int64_t ldy, int64_t K, int fast) {
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        if (fast)
            row_avx512(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
        else
            row_plain(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
    }
}

/* y [M, N] (row stride ldy; float32, or bf16 with out_bf16) = x [M, K] bf16 (ldx) . w [N, K]^T
 * bf16 (ldw). M <= 8; the fast path needs K % 32 == 0 (the caller checks). Returns 0, or -1
 * for arguments it does not take. */
int mox_gemv_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int out_bf16, int fast) {
    if (M < 1 || M > MAX_ROWS || N < 1 || K < 1)
        return -1;
    if (fast && (K % 32 != 0 || !mox_has_avx512bf16()))
        return -1;
    gemv(x, ldx, w, ldw, y, ldy, (int)M, N, K, out_bf16, fast);
    return 0;
}

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

/* A slot pool as the MoE kernel reads it: slot s's rows [N, K] at w + s * stride elements;
 * bf16, or int8 with `scale` (one float per row, slot s's at scale + s * scale_stride). */
typedef struct {
    const void *w;
    int64_t stride;
    const float *scale;
    int64_t scale_stride;
} pool_t;

/* row n of slot s against `count` x rows */
static void pool_rows_dot(const uint16_t *x, int64_t ldx, int64_t count, pool_t p, int64_t s,
                          int64_t n, float *out, int64_t ldy, int64_t K, int fast) {
    if (!p.scale) {
        rows_dot(x, ldx, count, (const uint16_t *)p.w + s * p.stride + n * K, out, ldy, K,
                 fast);
        return;
    }
    const int8_t *row = (const int8_t *)p.w + s * p.stride + n * K;
    float scale = p.scale[s * p.scale_stride + n];
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        if (fast)
            row_i8_avx512(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
        else
            row_i8_plain(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
        for (int j = 0; j < m; j++)
            out[(c + j) * ldy] *= scale;
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
    int64_t n13 = 2 * I, num_rows = 0;
    for (int64_t a = 0; a < num_active; a++)
        num_rows += counts[a];
    #pragma omp parallel
    {
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
    pool_t p13 = {w13, s13, 0, 0}, p2 = {w2, s2, 0, 0};
    return moe_silu(rows, p13, p2, slots, starts, counts, num_active, row_weights, H, I,
                    gate_up, act, down, fast);
}

/* int8 slot pools with one float32 scale per output row: w13's at sc13 + s * ss13 ([2I]),
 * w2's at sc2 + s * ss2 ([H]). */
int mox_moe_silu_int8(const uint16_t *rows, const int8_t *w13, int64_t s13, const float *sc13,
                      int64_t ss13, const int8_t *w2, int64_t s2, const float *sc2,
                      int64_t ss2, const int64_t *slots, const int64_t *starts,
                      const int64_t *counts, int64_t num_active, const float *row_weights,
                      int64_t H, int64_t I, float *gate_up, uint16_t *act, float *down,
                      int fast) {
    pool_t p13 = {w13, s13, sc13, ss13}, p2 = {w2, s2, sc2, ss2};
    return moe_silu(rows, p13, p2, slots, starts, counts, num_active, row_weights, H, I,
                    gate_up, act, down, fast);
}
