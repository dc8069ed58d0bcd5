/* bf16 matrix-vector products for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows
 * m of x (decode: one per sequence) against a row-major weight w [N, K] read in place.
 *
 * Decode on a CPU is bound by reading the weight once; the GEMMs torch dispatches to for a
 * few rows read it at half the machine's rate. Here each thread walks its rows of w in
 * memory order (one linear stream, which the hardware prefetcher follows at the full read
 * rate), every x row reusing each loaded cache line: AVX512-BF16 dot products (vdpbf16ps)
 * into fp32 accumulators, or on CPUs with AVX2 but not AVX-512 (AMD's before Zen 4, most
 * cloud VMs' older hosts) the weights widened to fp32 in registers and met by FMAs. A plain-C
 * path computes the same sums on any CPU (tests run it everywhere; mox only routes work here
 * where a vector path exists).
 *
 * Built at first use by mox/kernels/native.py (cc -O3 -fopenmp); threads are OpenMP's, the
 * same runtime torch uses, so torch.set_num_threads governs both.
 */
#include <stdint.h>

#include "bf16.h"
#include "exported.h"
#include "rows.h"

#define MAX_GEMV_ROWS 1024       /* native.py GEMV_MAX_ROWS */

int mox_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

int mox_vector_isa(void) {
    __builtin_cpu_init();
    if (mox_has_avx512bf16())
        return ISA_AVX512BF16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return ISA_AVX2;
    return ISA_PLAIN;
}

/* a row's M sums (sums[m * lds]) into y at column n: float32 (OUT_F32), bf16 rounded to
 * nearest even (OUT_BF16), or float32 holding that bf16 (OUT_BF16_AS_F32: the logits of a
 * bf16 lm_head, as torch's bf16 linear then .float() gives them, in one pass) */
static inline void store(void *y, int64_t ldy, int64_t n, const float *sums, int64_t lds, int M,
                         int out) {
    for (int m = 0; m < M; m++) {
        if (out == OUT_BF16)
            ((uint16_t *)y)[m * ldy + n] = f32_to_bf16(sums[m * lds]);
        else if (out == OUT_BF16_AS_F32)
            ((float *)y)[m * ldy + n] = bf16_to_f32(f32_to_bf16(sums[m * lds]));
        else
            ((float *)y)[m * ldy + n] = sums[m * lds];
    }
}

static void gemv(const uint16_t *x, const float *xf, int64_t ldx, const uint16_t *w,
                 int64_t ldw, void *y, int64_t ldy, int M, int64_t N, int64_t K, int out,
                 int isa) {
    /* tiles of weight rows against every x row: AVX2's three (widened x), AVX512-BF16's four
     * from TILE_MIN_ROWS x rows on */
    if (isa == ISA_AVX2 || (isa == ISA_AVX512BF16 && M >= TILE_MIN_ROWS)) {
        int64_t step = isa == ISA_AVX2 ? 3 : 4;
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += step) {
            int nr = N - n < step ? (int)(N - n) : (int)step;
            float sums[4 * M];                   /* M <= MAX_GEMV_ROWS: 16 KiB of stack */
            if (isa == ISA_AVX2)
                tiles_avx2(xf, ldx, M, w + n * ldw, ldw, nr, sums, 4, K);
            else
                tiles_avx512(x, ldx, M, w + n * ldw, ldw, nr, sums, 4, K);
            for (int j = 0; j < nr; j++)
                store(y, ldy, n + j, sums + j, 4, M, out);
        }
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float sums[M];                       /* M <= MAX_GEMV_ROWS: a few KiB of stack */
        rows_dot(x, ldx, M, w + n * ldw, sums, 1, K, isa);
        store(y, ldy, n, sums, 1, M, out);
    }
}

/* y [M, N] (row stride ldy; `out`: OUT_F32, OUT_BF16 or OUT_BF16_AS_F32) = x [M, K] bf16
 * (ldx) . w [N, K]^T bf16 (ldw). M <= MAX_GEMV_ROWS; the fast path needs K % 32 == 0 (the
 * caller checks). Returns 0, -1 for arguments it does not take, or -2 out of memory. */
int mox_gemv_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int out, int fast) {
    if (M < 1 || M > MAX_GEMV_ROWS || N < 1 || K < 1 || out < OUT_F32 || out > OUT_BF16_AS_F32)
        return -1;
    int isa = fast ? mox_vector_isa() : ISA_PLAIN;
    if (fast && (K % 32 != 0 || isa == ISA_PLAIN))
        return -1;
    float *xf = widen_rows(x, ldx, M, K, isa);
    if (isa == ISA_AVX2 && xf == NULL)
        return -2;
    gemv(x, xf, xf ? K : ldx, w, ldw, y, ldy, (int)M, N, K, out, isa);
    free(xf);
    return 0;
}

