/* This CPU's AVX2 FMA ceiling per core: independent 8-wide FMA chains in registers, no
 * memory. From ~8 rows of activations on, a CPU decode GEMV does more FMA work per weight byte
 * (one fp32 FMA lane per weight and row: 8 FLOP a byte at 8 rows) than the read rate asks
 * for, so this ceiling, not the read rate, is the one to measure those shapes against.
 *
 *     cc -O3 -mavx2 -mfma bench/micro/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Chains: 12 (FMA latency x throughput needs about 10; 16 spill past the 16 ymm registers);
 * -O3 keeps them in registers (-O2 left them on the stack: a store-bound loop). Run one per
 * core at once for the machine's figure. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 12

int main(void) {
    __m256 acc[CHAINS], b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < CHAINS; i++)
        acc[i] = _mm256_set1_ps((float)i);
    const long iterations = 200000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < CHAINS; j++)
            acc[j] = _mm256_fmadd_ps(acc[j], b, c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    float sum = 0.0f;                    /* (keeps the chains live) */
    for (int i = 0; i < CHAINS; i++)
        sum += acc[i][0];
    double fmas = (double)iterations * CHAINS / s;
    printf("%.2f G FMA/s per core, %.1f GFLOP/s (8 lanes x 2) [%g]\n", fmas / 1e9,
           fmas * 16 / 1e9, sum);
    return 0;
}
