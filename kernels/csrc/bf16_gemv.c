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
 * Built at first use by mox/kernels/native.py (cc -O3 -fopenmp); threads are OpenMP's, the
 * same runtime torch uses, so torch.set_num_threads governs both.
 */
#include <stdint.h>

#include "bf16.h"
#include "rows.h"

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

