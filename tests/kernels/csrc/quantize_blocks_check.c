/* quant_rows.h's vector quantizers (AVX2, AVX-512) against its scalar one, byte for byte:
 * the int8 values in each layout (pairs 0, 64, 128), the block scales and the activation
 * sums, over random bf16 rows with outliers, zeros and whole zero blocks. Exit status: the
 * number of mismatches (tests/kernels/test_quantize_blocks.py builds and runs it). */
#include <stdio.h>
#include <string.h>

#include "quant_rows.h"

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static int differ(const void *a, const void *b, size_t n, const char *what, int vec, int pairs) {
    if (!memcmp(a, b, n))
        return 0;
    printf("%s differ: vec %d, pairs %d\n", what, vec, pairs);
    return 1;
}

int main(void) {
    const int64_t K = 1024, rows = 3;
    uint16_t *x = malloc(sizeof(uint16_t) * rows * K);
    int vecs[2], nvec = 0, bad = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        vecs[nvec++] = QUANT_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        vecs[nvec++] = QUANT_AVX512;
    srand(1);
    for (int trial = 0; trial < 100; trial++) {
        for (int64_t i = 0; i < rows * K; i++) {
            float v = (rand() / (float)RAND_MAX - 0.5f) * (float)(trial % 7 + 1);
            if (i % 97 == 0)
                v *= 50.0f;                                   /* an outlier sets a block's scale */
            if ((trial % 11 == 0 && i % 64 == 5) || (trial % 13 == 0 && i < QBLOCK))
                v = 0.0f;                                     /* zeros, and a zero block */
            x[i] = to_bf16(v);
        }
        const int layouts[3] = {0, QBLOCK, SPAN};
        for (int l = 0; l < 3; l++)
            for (int v = 0; v < nvec; v++) {
                qrows_t a = {0}, b = {0};
                if (!qrows_alloc(&a, rows, K, layouts[l], QUANT_PLAIN)
                    || !qrows_alloc(&b, rows, K, layouts[l], vecs[v]))
                    return 100;
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
    printf("vector quantizers checked: %d, mismatches: %d\n", nvec, bad);
    free(x);
    return bad > 99 ? 99 : bad;
}
