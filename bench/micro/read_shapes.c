/* Does the shape of a decode step's reads cost read rate? A step reads many 1-3 MiB matrices
 * (q/k/v, o, each expert's gate/up and down), each split between the threads, with a barrier
 * between dependent ones; the step's bound is set by one long GEMV. This reads the same bytes
 * (random bf16, widened and summed against an activation row as a GEMV's inner loop does) as:
 *
 *   big        one matrix of all the bytes, halves per thread
 *   barrier    matrices of MATRIX KiB in one parallel region, a barrier after each
 *   region     a parallel region per matrix (fork and join each)
 *   nobarrier  matrices of MATRIX KiB, each thread its half of each, no barrier
 *   dyn64K     a region per matrix, 64 KiB chunks claimed dynamically (the MoE kernel's way)
 *
 * with an optional software prefetch PF bytes ahead (0: none), over huge pages or not.
 *
 *     cc -O3 -mavx2 -mfma -fopenmp bench/micro/read_shapes.c -o /tmp/read_shapes
 *     OMP_NUM_THREADS=2 /tmp/read_shapes TOTAL_MIB MATRIX_KIB [HUGE [PF]]
 *
 * Random bytes, not a fill: pages of one repeated value may be merged by the host (KSM) and
 * read from cache. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static long prefetch_ahead;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* n bytes of bf16 at p against x, as a GEMV row's inner loop */
static float read_row(const uint16_t *p, size_t n, const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000);
    for (size_t i = 0; i < n / 2; i += 32) {
        if (prefetch_ahead)
            _mm_prefetch((const char *)(p + i) + prefetch_ahead, _MM_HINT_T0);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(p + i + 16));
        const float *xx = x + (i & 1023);
        a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)),
                             _mm256_loadu_ps(xx), a0);
        a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w0, high)),
                             _mm256_loadu_ps(xx + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)),
                             _mm256_loadu_ps(xx + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w1, high)),
                             _mm256_loadu_ps(xx + 24), a3);
    }
    float o[8];
    _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    return o[0] + o[1] + o[2] + o[3] + o[4] + o[5] + o[6] + o[7];
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s TOTAL_MIB MATRIX_KIB [HUGE [PF]]\n", argv[0]);
        return 2;
    }
    size_t total = (size_t)atol(argv[1]) << 20, matrix = (size_t)atol(argv[2]) << 10;
    int huge = argc > 3 && atoi(argv[3]);
    prefetch_ahead = argc > 4 ? atol(argv[4]) : 0;
    size_t count = total / matrix, chunk = 64 << 10;
    char *buf = aligned_alloc(1 << 21, total);
    if (buf == NULL)
        return 1;
    if (huge)
        madvise(buf, total, MADV_HUGEPAGE);
    uint64_t z = 88172645463325252ull;           /* xorshift: bf16 values in [1, 2) */
    for (size_t i = 0; i < total / 8; i++) {
        z ^= z << 13, z ^= z >> 7, z ^= z << 17;
        ((uint64_t *)buf)[i] = z & 0x3f803f803f803f80ull;
    }
    float x[2048];
    for (int i = 0; i < 2048; i++)
        x[i] = 1.0f;
    volatile float sink = 0;
    for (int rep = 0; rep < 4; rep++) {
        float s = 0;
        double t = now();
        #pragma omp parallel reduction(+:s)
        {
            size_t half = total / omp_get_num_threads();
            s += read_row((uint16_t *)(buf + omp_get_thread_num() * half), half, x);
        }
        double big = total / (now() - t) / 1e9;
        t = now();
        #pragma omp parallel reduction(+:s)
        {
            size_t half = matrix / omp_get_num_threads();
            for (size_t m = 0; m < count; m++) {
                s += read_row((uint16_t *)(buf + m * matrix + omp_get_thread_num() * half),
                              half, x);
                #pragma omp barrier
            }
        }
        double barrier = total / (now() - t) / 1e9;
        t = now();
        for (size_t m = 0; m < count; m++) {
            #pragma omp parallel reduction(+:s)
            {
                size_t half = matrix / omp_get_num_threads();
                s += read_row((uint16_t *)(buf + m * matrix + omp_get_thread_num() * half),
                              half, x);
            }
        }
        double region = total / (now() - t) / 1e9;
        t = now();
        #pragma omp parallel reduction(+:s)
        {
            size_t half = matrix / omp_get_num_threads();
            for (size_t m = 0; m < count; m++)
                s += read_row((uint16_t *)(buf + m * matrix + omp_get_thread_num() * half),
                              half, x);
        }
        double nobarrier = total / (now() - t) / 1e9;
        t = now();
        for (size_t m = 0; m < count; m++) {
            #pragma omp parallel for schedule(dynamic, 1) reduction(+:s)
            for (size_t c = 0; c < matrix / chunk; c++)
                s += read_row((uint16_t *)(buf + m * matrix + c * chunk), chunk, x);
        }
        double dynamic = total / (now() - t) / 1e9;
        sink += s;
        printf("matrix %zu KiB, huge %d, prefetch %ld: big %.1f  barrier %.1f  region %.1f  "
               "nobarrier %.1f  dyn64K %.1f GB/s\n", matrix >> 10, huge, prefetch_ahead, big,
               barrier, region, nobarrier, dynamic);
    }
    free(buf);
    return 0;
}
