/* This CPU's AVX512-BF16 dot-product ceiling per core: independent VDPBF16PS chains in
 * registers, no memory. Each instruction is 32 bf16 multiply-adds (16 fp32 lanes, two
 * products each). From ~8 rows of activations on, a decode GEMV asks for more of them per
 * weight byte (M rows: M multiply-adds per 2-byte weight) than the read rate supplies, so this
 * ceiling, not the read rate, is the one to measure those shapes against (the AVX2 path's
 * is fma_peak.c).
 *
 *     cc -O3 -mavx512f -mavx512bf16 bench/micro/dpbf16_peak.c -o /tmp/dpbf16_peak
 *     /tmp/dpbf16_peak & /tmp/dpbf16_peak; wait        # one per core at once
 *
 * Chains: 16 (latency x throughput needs fewer; 16 of the 32 zmm registers). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 16

int main(void) {
    __m512 acc[CHAINS];
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
    for (int i = 0; i < CHAINS; i++)
        acc[i] = _mm512_set1_ps((float)i);
    const long iterations = 100000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < CHAINS; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    float sum = 0.0f;                    /* (keeps the chains live) */
    for (int i = 0; i < CHAINS; i++)
        sum += _mm512_reduce_add_ps(acc[i]);
    double ops = (double)iterations * CHAINS / s;
    printf("%.2f G VDPBF16PS/s per core, %.1f G bf16 multiply-adds/s (32 each) [%g]\n",
           ops / 1e9, ops * 32 / 1e9, sum);
    return 0;
}
