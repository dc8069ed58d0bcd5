/* This CPU's arithmetic ceilings per core, from independent chains in registers (no memory):
 * AVX2 8-wide FMAs, and AVX512-BF16 VDPBF16PS (32 bf16 multiply-adds each) where the CPU has
 * it. From ~8 rows of activations on, a CPU decode GEMV does more multiply-adds per weight
 * byte (one per weight and row: at 8 rows, 8 FMA lanes or 8 bf16 products a 2-byte weight)
 * than the read rate asks for, so these ceilings, not the read rate, are the ones to measure
 * those shapes against.
 *
 *     cc -O3 bench/micro/fma_peak.c -o /tmp/fma_peak
 *     /tmp/fma_peak                                    # one core
 *     /tmp/fma_peak & /tmp/fma_peak; wait              # one per core at once: the machine
 *
 * Chains: 12 FMA (latency x throughput needs about 10; 16 spill past the 16 ymm registers),
 * 16 VDPBF16PS (of the 32 zmm registers); -O3 keeps them in registers (-O2 left them on the
 * stack: a store-bound loop). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define FMA_CHAINS 12
#define DP_CHAINS 16
#define ITERATIONS 100000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* instructions a second; the chains' sum goes to `sink` so they stay live */
__attribute__((target("avx2,fma")))
static double fma_rate(float *sink) {
    __m256 acc[FMA_CHAINS], b = _mm256_set1_ps(1.0000001f), c = _mm256_set1_ps(1e-7f);
    for (int i = 0; i < FMA_CHAINS; i++)
        acc[i] = _mm256_set1_ps((float)i);
    double start = now();
    for (long i = 0; i < ITERATIONS; i++)
        for (int j = 0; j < FMA_CHAINS; j++)
            acc[j] = _mm256_fmadd_ps(acc[j], b, c);
    double seconds = now() - start;
    for (int i = 0; i < FMA_CHAINS; i++)
        *sink += acc[i][0];
    return (double)ITERATIONS * FMA_CHAINS / seconds;
}

__attribute__((target("avx512f,avx512bf16")))
static double dpbf16_rate(float *sink) {
    __m512 acc[DP_CHAINS];
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
    for (int i = 0; i < DP_CHAINS; i++)
        acc[i] = _mm512_set1_ps((float)i);
    double start = now();
    for (long i = 0; i < ITERATIONS; i++)
        for (int j = 0; j < DP_CHAINS; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    double seconds = now() - start;
    for (int i = 0; i < DP_CHAINS; i++)
        *sink += _mm512_reduce_add_ps(acc[i]);
    return (double)ITERATIONS * DP_CHAINS / seconds;
}

int main(void) {
    float sink = 0.0f;
    double fmas = fma_rate(&sink);
    printf("%.2f G FMA/s per core, %.1f GFLOP/s (8 lanes x 2)\n", fmas / 1e9, fmas * 16 / 1e9);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16")) {
        double dps = dpbf16_rate(&sink);
        printf("%.2f G VDPBF16PS/s per core, %.1f G bf16 multiply-adds/s (32 each)\n",
               dps / 1e9, dps * 32 / 1e9);
    }
    printf("[%g]\n", sink);
    return 0;
}
