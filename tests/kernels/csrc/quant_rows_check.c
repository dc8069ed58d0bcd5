/* The native kernels' vector loops against their plain-C definitions on this CPU:
 * - the activation quantizers (AVX2, AVX-512), byte for byte: the int8 values in each layout
 *   (pairs 0, 64, 128), the block scales and the activation sums, over random bf16 rows with
 *   outliers, zeros, whole zero blocks, NaN and infinity;
 * - AVX2's int4 span loop (groups of 128, 256, 384) and FP8 loop (blocks of 32, 96 and per
 *   channel) at 1 to 8 activation rows, to float rounding (the sums' order differs).
 * Exit status: the number of mismatches, at most 99 (tests/kernels/test_quant_rows_check.py
 * builds and runs it). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "int4_span_rows.h"
#include "quant_rows.h"
#include "fp8_rows.h"

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static float uniform(void) { return rand() / (float)RAND_MAX - 0.5f; }

static int differ(const void *a, const void *b, size_t n, const char *what, int vec, int pairs) {
    if (!memcmp(a, b, n))
        return 0;
    printf("%s differ: vec %d, pairs %d\n", what, vec, pairs);
    return 1;
}

static void fill_rows(uint16_t *x, int64_t n, int trial) {
    for (int64_t i = 0; i < n; i++) {
        float v = uniform() * (float)(trial % 7 + 1);
        if (i % 97 == 0)
            v *= 50.0f;                                   /* an outlier sets a block's scale */
        if ((trial % 11 == 0 && i % 64 == 5) || (trial % 13 == 0 && i < QBLOCK))
            v = 0.0f;                                     /* zeros, and a zero block */
        if (trial % 17 == 0 && i % 200 == 7)
            v = NAN;
        if (trial % 19 == 0 && i % 300 == 9)
            v = INFINITY;
        x[i] = to_bf16(v);
    }
}

static int check_quantizers(void) {
    const int64_t K = 1024, rows = 3;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * K);
    int vecs[2], nvec = 0, bad = 0;
    if (__builtin_cpu_supports("avx2"))
        vecs[nvec++] = QUANT_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        vecs[nvec++] = QUANT_AVX512;
    const int layouts[3] = {0, QBLOCK, SPAN};
    for (int trial = 0; trial < 100; trial++) {
        fill_rows(x, rows * K, trial);
        for (int l = 0; l < 3; l++)
            for (int v = 0; v < nvec; v++) {
                qrows_t a = {0}, b = {0};
                if (!qrows_alloc(&a, rows, K, layouts[l], QUANT_PLAIN)
                    || !qrows_alloc(&b, rows, K, layouts[l], vecs[v]))
                    exit(99);
                for (int64_t p = 0; p < rows; p++) {
                    quantize_blocks(x, &a, p, 0, K / QBLOCK);
                    quantize_blocks(x, &b, p, 0, K / QBLOCK);
                }
                bad += differ(a.q, b.q, rows * K, "q", vecs[v], layouts[l]);
                bad += differ(a.scale, b.scale, sizeof(float) * rows * K / QBLOCK, "scale",
                              vecs[v], layouts[l]);
                bad += differ(a.sum32, b.sum32, sizeof(float) * rows * K / 32, "sum32",
                              vecs[v], layouts[l]);
                if (layouts[l] == SPAN)
                    bad += differ(a.sum128, b.sum128, sizeof(float) * rows * K / SPAN, "sum128",
                                  vecs[v], layouts[l]);
                qrows_free(&a);
                qrows_free(&b);
            }
    }
    free(x);
    printf("vector quantizers checked: %d\n", nvec);
    return bad;
}

/* `got` against `want` [n]: within 1e-4 of the largest |want| (a wrong layout or scale is
 * off by the values themselves) */
static int close_to(const float *got, const float *want, int64_t n, const char *what, int M,
                    int64_t group) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++)
        top = fmaxf(top, fabsf(want[i]));
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(got[i] - want[i]) <= 1e-4f * top)) {
            printf("%s differs: M %d, group %ld, [%ld] %g vs %g\n", what, M, (long)group,
                   (long)i, got[i], want[i]);
            return 1;
        }
    return 0;
}

__attribute__((target("avx2,fma,f16c")))
static int check_avx2_rows(void) {
    const int64_t K = 768, N = 5, rows = 10;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * K);
    uint8_t *w = malloc(N * K);
    float *wscale = malloc(sizeof(float) * N * K), got[8 * 5], want[8 * 5];
    int bad = 0;
    fill_rows(x, rows * K, 1);
    for (int64_t i = 0; i < N * K; i++) {
        w[i] = (uint8_t)rand();
        wscale[i] = 0.5f + uniform();
    }
    qrows_t spans = {0}, blocks = {0};           /* int4_rows_avx2's layout, row_q_plain's */
    if (!qrows_alloc(&spans, rows, K, SPAN, QUANT_PLAIN)
        || !qrows_alloc(&blocks, rows, K, QBLOCK, QUANT_PLAIN))
        exit(99);
    for (int64_t p = 0; p < rows; p++) {
        quantize_blocks(x, &spans, p, 0, K / QBLOCK);
        quantize_blocks(x, &blocks, p, 0, K / QBLOCK);
    }
    const int64_t groups[3] = {128, 256, 384}, spans_fp8[3] = {32, 96, 768};
    for (int g = 0; g < 3; g++)
        for (int M = 1; M <= 8; M++) {
            int64_t m0 = rows - M, per_row = K / groups[g];
            int4_rows_avx2(&spans, m0, M, w, K / 2, N, wscale, per_row, groups[g], got, N);
            for (int64_t n = 0; n < N; n++)
                row_q_plain(&blocks, m0, M, w + n * K / 2, WEIGHTS_INT4, wscale + n * per_row,
                            groups[g], want + n, N);
            bad += close_to(got, want, M * N, "int4_rows_avx2", M, groups[g]);
            int64_t span = spans_fp8[g], fp8_per_row = K / span;
            for (int64_t n = 0; n < N; n++) {
                row_fp8_avx2(x + m0 * K, K, M, w + n * K, wscale + n * fp8_per_row, span, K,
                             got + n, N);
                row_fp8_plain(x + m0 * K, K, M, w + n * K, wscale + n * fp8_per_row, span, K,
                              want + n, N);
            }
            bad += close_to(got, want, M * N, "row_fp8_avx2", M, span);
        }
    qrows_free(&spans);
    qrows_free(&blocks);
    free(x);
    free(w);
    free(wscale);
    printf("AVX2 row loops checked\n");
    return bad;
}

int main(void) {
    __builtin_cpu_init();
    srand(1);
    int bad = check_quantizers();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        bad += check_avx2_rows();
    printf("mismatches: %d\n", bad);
    return bad > 99 ? 99 : bad;
}
