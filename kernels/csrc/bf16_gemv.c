/* bf16 matrix-vector products for CPU decode: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows
 * m of x (decode: one per sequence) against a row-major weight w [N, K] read in place.
 *
 * Decode on a CPU is bound by reading the weight once; the GEMMs torch dispatches to for a
 * few rows read it at half the machine's rate. Here each thread walks its rows of w in
 * memory order (one linear stream, which the hardware prefetcher follows at the full read
 * rate), every x row reusing each loaded cache line: AVX512-BF16 dot products (vdpbf16ps)
 * into fp32 accumulators, from AMX_MIN_ROWS x rows on AMX tiles where the CPU has them
 * (amx_tiles.h), or on CPUs with AVX2 but not AVX-512 (AMD's before Zen 4, most cloud VMs'
 * older hosts) the weights widened to fp32 in registers and met by FMAs. A plain-C
 * path computes the same sums on any CPU (tests run it everywhere; mox only routes work here
 * where a vector path exists).
 *
 * Built at first use by mox/kernels/native.py (cc -O3 -fopenmp); threads are OpenMP's, the
 * same runtime torch uses, so torch.set_num_threads governs both.
 */
#include <omp.h>
#include <stdint.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "exported.h"
#include "rows.h"

#define MAX_GEMV_ROWS 1024       /* native.py GEMV_MAX_ROWS */

int mox_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

int mox_has_amx(void) { return amx_usable(); }

int mox_vector_isa(void) {
    __builtin_cpu_init();
    if (mox_has_avx512bf16())
        return ISA_AVX512BF16;
    /* (F16C widens FP8 weights: row_fp8_avx2; every AVX2 CPU has it) */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
    return ISA_PLAIN;
}

/* sums [M, cols] (row stride lds) into y's columns [n, n + cols): float32 (OUT_F32), bf16
 * rounded to nearest even (OUT_BF16), or float32 holding that bf16 (OUT_BF16_AS_F32: the
 * logits of a bf16 lm_head, as torch's bf16 linear then .float() gives them, in one pass) */
static inline void store(void *y, int64_t ldy, int64_t n, const float *sums, int64_t lds, int M,
                         int64_t cols, int out) {
    for (int m = 0; m < M; m++)
        for (int64_t j = 0; j < cols; j++) {
            float v = sums[m * lds + j];
            if (out == OUT_BF16)
                ((uint16_t *)y)[m * ldy + n + j] = f32_to_bf16(v);
            else if (out == OUT_BF16_AS_F32)
                ((float *)y)[m * ldy + n + j] = bf16_to_f32(f32_to_bf16(v));
            else
                ((float *)y)[m * ldy + n + j] = v;
        }
}

/* How many of y's columns one claim of the tiles computes before it stores them: a block
 * [M, cols] of sums kept in TILE_SUMS_FLOATS floats (16 KiB) on the thread's stack, then
 * stored row by row. Storing each tile's four columns straight into y wrote M rows ldy apart:
 * where a row of y is a multiple of 4 KiB (o_proj's 1024 float32 columns) they all fall in
 * one L1 set, and at 32 rows the GEMV ran at 0.6x its rate at 1000 or 3000 columns (214
 * against 340-380 G multiply-adds a second, 1024 and 3072 columns; AMD EPYC Zen 5, two
 * threads). Claims come in even shares, at least two a thread, so the threads finish together. */
#define TILE_SUMS_FLOATS 4096

static int64_t tile_columns(int64_t M, int64_t N, int64_t step, int64_t unit) {
    int64_t most = TILE_SUMS_FLOATS / M / unit * unit;  /* `unit`: a multiple of tiles' widths */
    if (most < unit)
        return step;
    int64_t threads = omp_get_max_threads(), claims = (N + most - 1) / most;
    claims = (claims + 2 * threads - 1) / (2 * threads) * (2 * threads);   /* even shares */
    int64_t cols = (N + claims - 1) / claims;
    return cols < 4 * unit ? step : (cols + unit - 1) / unit * unit;   /* few columns: tiles */
}

/* gemv's AMX path (amx_tiles.h): the x rows packed once, in groups of AMX_MAX_X_ROWS, for
 * every claim of columns. -2 out of memory. */
static int gemv_amx(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *y,
                    int64_t ldy, int M, int64_t N, int64_t K, int out) {
    int groups = (M + AMX_MAX_X_ROWS - 1) / AMX_MAX_X_ROWS;
    size_t size = amx_packed_size(K);
    uint16_t *packed[MAX_GEMV_ROWS / AMX_MAX_X_ROWS];
    uint16_t *all = aligned_alloc(64, groups * size * sizeof *all);
    if (all == NULL)
        return -2;
    for (int g = 0; g < groups; g++) {
        int left = M - g * AMX_MAX_X_ROWS, rows = left < AMX_MAX_X_ROWS ? left : AMX_MAX_X_ROWS;
        packed[g] = all + g * size;
        amx_pack_x(x + g * AMX_MAX_X_ROWS * ldx, ldx, rows, K, packed[g]);
    }
    int64_t cols = tile_columns(M, N, 2 * AMX_ROWS, 2 * AMX_ROWS);
    #pragma omp parallel
    {
        amx_begin();
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += cols) {
            int64_t nc = N - n < cols ? N - n : cols;
            float sums[M * cols];
            amx_rows(x, ldx, M, w + n * ldw, ldw, nc, sums, cols, K, packed, NULL);
            store(y, ldy, n, sums, cols, M, nc, out);
        }
        amx_end();
    }
    free(all);
    return 0;
}

static int gemv(const uint16_t *x, const float *xf, int64_t ldx, const uint16_t *w,
                 int64_t ldw, void *y, int64_t ldy, int M, int64_t N, int64_t K, int out,
                 int isa) {
    /* tiles of weight rows against every x row: AMX's from AMX_MIN_ROWS x rows, AVX2's
     * (widened x: one weight row at a time for one or two x rows, three from three),
     * AVX512-BF16's four from tile_min_rows() x rows */
    if (isa == ISA_AVX512BF16 && M >= AMX_MIN_ROWS && N >= 2 * AMX_ROWS && amx_usable())
        return gemv_amx(x, ldx, w, ldw, y, ldy, M, N, K, out);
    if (isa == ISA_AVX2 || (isa == ISA_AVX512BF16 && M >= tile_min_rows())) {
        int64_t step = isa == ISA_AVX2 ? 3 : 4, cols = tile_columns(M, N, step, 12);
        #pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += cols) {
            int64_t nc = N - n < cols ? N - n : cols;
            float sums[M * cols];                /* TILE_SUMS_FLOATS, or 4 * MAX_GEMV_ROWS */
            if (isa == ISA_AVX2)
                tiles_avx2(xf, ldx, M, w + n * ldw, ldw, nc, sums, cols, K);
            else
                tiles_avx512(x, ldx, M, w + n * ldw, ldw, nc, sums, cols, K);
            store(y, ldy, n, sums, cols, M, nc, out);
        }
        return 0;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float sums[M];                       /* M <= MAX_GEMV_ROWS: a few KiB of stack */
        rows_dot(x, ldx, M, w + n * ldw, sums, 1, K, isa);
        store(y, ldy, n, sums, 1, M, 1, out);
    }
    return 0;
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
    int status = gemv(x, xf, xf ? K : ldx, w, ldw, y, ldy, (int)M, N, K, out, isa);
    free(xf);
    return status;
}

