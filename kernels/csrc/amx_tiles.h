/* bf16 GEMVs of many x rows on AMX tiles (Intel Sapphire Rapids and later): the decode
 * GEMVs (bf16_gemv.c) and a MoE layer's bf16 experts (moe_experts.c) from AMX_MIN_ROWS x rows.
 *
 * From eight rows on a dense weight byte asks for more multiply-adds than AVX512-BF16's
 * dot products give at the read rate: at 32 rows, 16 a byte, and the 4 x 4 tiles read the
 * lm_head and attention's weights at ~7 GB/s. One AMX tile multiply (tdpbf16ps) does 16 x 16 x
 * 32 of them. The weights stay as they are: a tile of 16 weight rows x 32 k (the "A" operand,
 * row-major, loaded with the weight's row stride) meets a tile of the x rows packed once a call
 * in AMX's pair-interleaved layout (the "B" operand: row r holds x[m][2r], x[m][2r + 1] for
 * each m), and the sums come out as [weight row][x row], 32 weight rows and up to 32 x rows
 * at a time (8 tiles: 4 of sums, 2 of weights, 2 of x). Products are summed in fp32 as
 * vdpbf16ps does, in another order. Against the 4 x 4 tiles (native_ab, Xeon with AMX, two
 * threads, bench olmoe shapes read from memory; bench/results/native_ab_amx-{1,2}.md):
 * 1.03-1.18x at 4 x rows, 1.19-1.42x at 8, 1.80-2.20x at 16, 2.81-3.51x at 32; 0.86-1.00x at
 * 2 (so from 4). A MoE layer's experts: 1.00-1.06x at ~4 rows an expert, 1.19-1.26x at ~8.
 *
 * Linux hands AMX's tile state to a process only on request (arch_prctl), once; each thread
 * loads the tile configuration before its first tile instruction and releases it after. */
#ifndef MOX_AMX_TILES_H
#define MOX_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rows.h"

#define AMX_MIN_ROWS 4         /* x rows from which amx_block beats tiles_avx512 (below) */
#define AMX_ROWS 16            /* a tile's rows: weight rows, or k pairs */
#define AMX_K 32               /* bf16 values of k in a tile row (64 bytes) */
#define AMX_MAX_X_ROWS 32      /* two tiles of x */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this CPU has AMX-BF16 and Linux lets this process use it (asked once). */
static inline int amx_usable(void) {
    static int usable = -1;           /* the answer does not change: a benign race */
    if (usable < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int has = (d >> 22 & 1) && (d >> 24 & 1);      /* AMX-BF16, AMX-TILE */
        usable = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return usable;
}

/* x rows from which tiles_avx512 beats row_avx512 (one weight row at a time): TILE_MIN_ROWS
 * (5, measured on AMD Zen 5), or 2 on a CPU with AMX: on the Xeon with AMX the tiles read
 * 1.04-1.10x faster at 2 x rows (GEMV) and a MoE layer at 16-32 tokens (~1-3 rows an
 * expert) 1.05-1.06x (native_ab, alternated builds, two runs). AMX stands in for "an Intel
 * server core" here: the measurement, not a rule. */
#define TILE_MIN_ROWS_AMX 2

static inline int tile_min_rows(void) {
    return amx_usable() ? TILE_MIN_ROWS_AMX : TILE_MIN_ROWS;
}

struct amx_config {               /* ldtilecfg's 64-byte layout, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-3: sums [16 weight rows][16 x rows] (0, 1: x rows 0-15 of weight rows 0-15, 16-31;
 * 2, 3: x rows 16-31); 4, 5: the two weight tiles; 6, 7: the two x tiles */
__attribute__((target("amx-tile,amx-bf16")))
static inline void amx_begin(void) {
    struct amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = AMX_ROWS;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

__attribute__((target("amx-tile")))
static inline void amx_end(void) { _tile_release(); }

/* bf16 values amx_pack_x writes for up to AMX_MAX_X_ROWS x rows of K */
static inline size_t amx_packed_size(int64_t K) {
    return (size_t)(K / AMX_K) * 2 * AMX_ROWS * AMX_K;
}

/* x [M, K] bf16 (row stride ldx), M <= AMX_MAX_X_ROWS, K % AMX_K == 0, as B tiles into
 * `packed` (amx_packed_size, 64-byte aligned): for each k step, one tile of x rows 0-15 then
 * one of 16-31 (if M > 16), each [16 k pairs][16 x rows][2], zeros past M */
static inline void amx_pack_x(const uint16_t *x, int64_t ldx, int M, int64_t K,
                              uint16_t *packed) {
    int tiles = M > AMX_ROWS ? 2 : 1;
    size_t tile = AMX_ROWS * AMX_K;
    for (int64_t s = 0; s < K / AMX_K; s++)
        for (int t = 0; t < tiles; t++) {
            uint16_t *b = packed + (s * tiles + t) * tile;
            for (int r = 0; r < AMX_ROWS; r++)
                for (int c = 0; c < AMX_ROWS; c++) {
                    int m = t * AMX_ROWS + c;
                    const uint16_t *xk = x + m * ldx + s * AMX_K + 2 * r;
                    b[r * AMX_K + 2 * c] = m < M ? xk[0] : 0;
                    b[r * AMX_K + 2 * c + 1] = m < M ? xk[1] : 0;
                }
        }
}

/* sums [16][16] tiles into out[m * ldm + n] for x rows m < M of tile column `m0` */
static inline void amx_put(const float *tile, int m0, int M, float *out, int64_t ldm,
                           int64_t n0) {
    for (int n = 0; n < AMX_ROWS; n++)
        for (int m = 0; m < AMX_ROWS && m0 + m < M; m++)
            out[(m0 + m) * ldm + n0 + n] = tile[n * AMX_ROWS + m];
}

/* the two weight tiles at k, the next 32 rows' lines at k prefetched into L2: one block ahead
 * whatever K is. Against 4 KiB ahead in the row (native_ab, alternated on the same data,
 * K 1024: 1.00-1.11x at 32 x rows); 1 KiB ahead read 0.88-0.95x at 8-32 rows. */
#define AMX_WEIGHTS(k)                                                                     \
    do {                                                                                   \
        for (int r = 0; r < 2 * AMX_ROWS; r++)                                             \
            _mm_prefetch((const char *)(w + (r + 2 * AMX_ROWS) * ldw + (k)), _MM_HINT_T1); \
        _tile_loadd(4, w + (k), ldw * 2);                                                  \
        _tile_loadd(5, w + AMX_ROWS * ldw + (k), ldw * 2);                                 \
    } while (0)

/* out[m * ldm + n] = x_m . w_n for 32 weight rows (w: row stride ldw) and the M x rows
 * packed by amx_pack_x (`tiles` of them a k step); K % AMX_K == 0 */
__attribute__((target("amx-tile,amx-bf16")))
static inline void amx_block(const uint16_t *packed, int tiles, int M, const uint16_t *w,
                             int64_t ldw, float *out, int64_t ldm, int64_t K) {
    float tile[AMX_ROWS * AMX_ROWS];
    _tile_zero(0); _tile_zero(1);
    const int64_t stride = AMX_K * 2;            /* a packed tile's row: 64 bytes */
    if (tiles == 1) {
        for (int64_t k = 0; k < K; k += AMX_K) {
            AMX_WEIGHTS(k);
            _tile_loadd(6, packed + k / AMX_K * AMX_ROWS * AMX_K, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
        }
    } else {
        _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += AMX_K) {
            AMX_WEIGHTS(k);
            const uint16_t *b = packed + k / AMX_K * 2 * AMX_ROWS * AMX_K;
            _tile_loadd(6, b, stride);
            _tile_loadd(7, b + AMX_ROWS * AMX_K, stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, tile, AMX_ROWS * 4);
        amx_put(tile, AMX_ROWS, M, out, ldm, 0);
        _tile_stored(3, tile, AMX_ROWS * 4);
        amx_put(tile, AMX_ROWS, M, out, ldm, AMX_ROWS);
    }
    _tile_stored(0, tile, AMX_ROWS * 4);
    amx_put(tile, 0, M, out, ldm, 0);
    _tile_stored(1, tile, AMX_ROWS * 4);
    amx_put(tile, 0, M, out, ldm, AMX_ROWS);
}

/* out[m * ldm + n] = x_m . w_n for M x rows and N weight rows (blocks of 32, the last few by
 * tiles_avx512), between amx_begin and amx_end. The x rows in groups of AMX_MAX_X_ROWS:
 * packed[g] when the caller packed them (the GEMV, once a call), else each packed in turn into
 * `scratch` (amx_packed_size(K); the MoE experts, once an expert). */
__attribute__((target("amx-tile,amx-bf16")))
static inline void amx_rows(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *w,
                            int64_t ldw, int64_t N, float *out, int64_t ldm, int64_t K,
                            uint16_t *const *packed, uint16_t *scratch) {
    int64_t whole = N / (2 * AMX_ROWS) * 2 * AMX_ROWS;
    for (int64_t m0 = 0; m0 < M && whole; m0 += AMX_MAX_X_ROWS) {
        int rows = M - m0 < AMX_MAX_X_ROWS ? (int)(M - m0) : AMX_MAX_X_ROWS;
        const uint16_t *b = packed ? packed[m0 / AMX_MAX_X_ROWS] : scratch;
        if (!packed)
            amx_pack_x(x + m0 * ldx, ldx, rows, K, scratch);
        for (int64_t n = 0; n < whole; n += 2 * AMX_ROWS)
            amx_block(b, rows > AMX_ROWS ? 2 : 1, rows, w + n * ldw, ldw, out + m0 * ldm + n,
                      ldm, K);
    }
    if (whole < N)
        tiles_avx512(x, ldx, M, w + whole * ldw, ldw, N - whole, out + whole, ldm, K);
}

#endif
