/* bf16 weight rows against a few x rows: the inner loops of the decode GEMVs (bf16_gemv.c)
 * and of the MoE experts over bf16 slot pools (moe_experts.c); one weight row at a time with
 * AVX512-BF16 or in plain C, tiles of three weight rows with AVX2. */
#ifndef MOX_ROWS_H
#define MOX_ROWS_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_ROWS 8
#define TILE_MIN_ROWS 5        /* AVX512-BF16: x rows from which tiles_avx512 beats row_avx512 */
#define PREFETCH_AHEAD 4096     /* tiles: prefetch weights 8 KiB ahead (tiles_avx2, tile_avx512) */
#define PREFETCH_AHEAD_ROW 512  /* ... 1 KiB ahead for a row at a time (see row_tile_avx2) */
#define PREFETCH_AHEAD_ONE 2048 /* AVX512-BF16 rows: 4 KiB ahead (row_avx512) */

/* one weight row against M x rows; K a multiple of 32. One x row (every weight read of a
 * batch-1 step) runs four chains of dot products, 256 bytes of the row an iteration: with two,
 * the chains' latency bound a row in cache at about half the rate a fast spell of this VM's
 * memory streams, and from memory a MoE layer at one token read 1.07-1.11x faster with four,
 * the GEMV 1.05x (AMD EPYC Zen 4, alternated builds). Each loop prefetches the row 4 KiB
 * ahead into L2, a line for each line it reads: against the stream timed beside it, a MoE
 * layer read 1.05x faster at 8 tokens (two runs), 0.99-1.03x at 1 and 32 (Zen 5,
 * bench/results/moe_stream-row-prefetch-{1,2}.md). */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline void row_avx512(const uint16_t *x, int64_t ldx, const uint16_t *row, float *out,
                              int64_t ldy, int M, int64_t K) {
    __m512 acc[MAX_ROWS][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    int64_t k = 0;
    if (M == 1) {
        __m512 acc2 = _mm512_setzero_ps(), acc3 = acc2;
        for (; k + 128 <= K; k += 128) {
            for (int l = 0; l < 4; l++)
                _mm_prefetch((const char *)(row + k + PREFETCH_AHEAD_ONE + 32 * l), _MM_HINT_T1);
            __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
            __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(row + k + 32));
            __m512bh w2 = (__m512bh)_mm512_loadu_si512((const void *)(row + k + 64));
            __m512bh w3 = (__m512bh)_mm512_loadu_si512((const void *)(row + k + 96));
            acc[0][0] = _mm512_dpbf16_ps(acc[0][0], (__m512bh)_mm512_loadu_si512(x + k), w0);
            acc[0][1] = _mm512_dpbf16_ps(acc[0][1], (__m512bh)_mm512_loadu_si512(x + k + 32),
                                         w1);
            acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_si512(x + k + 64), w2);
            acc3 = _mm512_dpbf16_ps(acc3, (__m512bh)_mm512_loadu_si512(x + k + 96), w3);
        }
        acc[0][0] = _mm512_add_ps(acc[0][0], acc2);
        acc[0][1] = _mm512_add_ps(acc[0][1], acc3);
    }
    for (; k + 64 <= K; k += 64) {          /* two independent chains per x row */
        _mm_prefetch((const char *)(row + k + PREFETCH_AHEAD_ONE), _MM_HINT_T1);
        _mm_prefetch((const char *)(row + k + PREFETCH_AHEAD_ONE + 32), _MM_HINT_T1);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(row + k + 32));
        for (int m = 0; m < M; m++) {
            const uint16_t *xm = x + m * ldx + k;
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xm), w0);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)_mm512_loadu_si512(xm + 32), w1);
        }
    }
    if (k < K) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(row + k));
        for (int m = 0; m < M; m++)
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0],
                                         (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w0);
    }
    for (int m = 0; m < M; m++)
        out[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
}

/* v[m]'s lanes summed into lane m, for 16 vectors at once: a tree of in-lane unpacks and
 * shuffles, then across 128-bit lanes (45 instructions, where a reduction of each vector
 * alone is a chain of ~8 on its own result) */
__attribute__((target("avx512f")))
static inline __m512 sum_each16(const __m512 *v) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)     /* per 128-bit lane: v0[0]+v0[2], v1[0]+v1[2], .. */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)     /* per 128-bit lane l: the lane's sum of v[4i .. 4i + 3] */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)     /* lanes (0 + 1), (2 + 3) of quads 2i, then of 2i + 1 */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* eight vectors' sums as one vector: out[j] = the sum of v[j]'s lanes (AVX2's sum_each16:
 * 9 instructions for eight, where sum8 is a chain of 6 for each) */
__attribute__((target("avx2")))
static inline __m256 sum_each8(const __m256 *v) {
    /* per 128-bit lane: pairs, then quads of v0 .. v3 (ab) and of v4 .. v7 (cd) */
    __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),     /* low lanes' quads */
                         _mm256_permute2f128_ps(ab, cd, 0x31));    /* + the high lanes' */
}

/* out[m * ldm + n] = x_m . w_n for MR x rows and NR weight rows (MR, NR <= 4), bf16, K a
 * multiple of 32. From two x rows on, one weight row at a time (row_avx512) loaded an x
 * vector for every dot product and read weights at 10 GB/s at 8 rows (AMD EPYC Zen 4, two
 * threads): compute-bound. A 4 x 4 tile loads 4 weight and 4 x vectors per 16 dot products
 * from 16 accumulators, enough chains to hide the dot product's latency. One chain an output,
 * the tile's sums reduced together (sum_each16): an output's sum does not depend on the tile
 * it fell in. Reduced one by one, the sixteen reductions were 15% of a 4 x 4 tile's
 * instructions at K 1024, 30% at 512. The next weight rows are
 * prefetched into L2, not L1 (_MM_HINT_T1): into L1 a tile's prefetches waited on L1's few
 * miss buffers and the x rows streaming through L1 evicted them; into L2 the GEMV read 1.5-1.7x
 * faster at 8 rows, 1.1-1.5x at 4, 16 and 32 (native_ab, two runs; at 4 rows against
 * row_avx512, which 4 rows took before; Zen 4). On Zen 5, twice Zen 4's dot-product rate, the
 * tiles start at 5 x rows (TILE_MIN_ROWS): from memory the rows one at a time (each weight row
 * streamed whole, where a tile reads 4 rows side by side) read 1.09-1.30x faster at 4 rows
 * (bench/results/native_ab_rows4-{1,2}.md), 1.25-1.29x at 3, 1.02-1.05x at 5, 0.90x at 6 and
 * 0.79x at 8 (ad-hoc, alternated builds). Inlined with constant MR, NR. */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl"), always_inline))
static inline void tile_avx512(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                               float *out, int64_t ldm, int MR, int NR, int64_t K) {
    __m512 acc[4][4];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            acc[m][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[4];
        for (int n = 0; n < NR; n++) {
            _mm_prefetch((const char *)(w + n * ldw + k + PREFETCH_AHEAD), _MM_HINT_T1);
            wv[n] = (__m512bh)_mm512_loadu_si512((const void *)(w + n * ldw + k));
        }
        for (int m = 0; m < MR; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));
            for (int n = 0; n < NR; n++)
                acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
        }
    }
    /* the MR x NR sums reduced together (zeros fill a smaller tile's 16): one output's
     * lanes meet in the same order wherever it sits in the tile */
    __m512 parked[16];
    for (int i = 0; i < 16; i++)
        parked[i] = i < MR * NR ? acc[i / NR][i % NR] : _mm512_setzero_ps();
    float sums[16];
    _mm512_storeu_ps(sums, sum_each16(parked));
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            out[m * ldm + n] = sums[m * NR + n];
}

#define TILE_AVX512(MR, NR) \
    case MR * 8 + NR: tile_avx512(xm, ldx, wn, ldw, o, ldm, MR, NR, K); break

/* out[m * ldm + n] = x_m . w_n for all M x rows and N weight rows, bf16, K a multiple of 32:
 * four weight rows at a time (read from memory once, then from L1 for every four x rows) */
__attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))
static inline void tiles_avx512(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *w,
                                int64_t ldw, int64_t N, float *out, int64_t ldm, int64_t K) {
    for (int64_t n = 0; n < N; n += 4) {
        int nr = N - n < 4 ? (int)(N - n) : 4;
        for (int64_t m = 0; m < M; m += 4) {
            int mr = M - m < 4 ? (int)(M - m) : 4;
            const uint16_t *xm = x + m * ldx, *wn = w + n * ldw;
            float *o = out + m * ldm + n;
            switch (mr * 8 + nr) {     /* constant tile shapes: fully unrolled, in registers */
            TILE_AVX512(1, 1); TILE_AVX512(1, 2); TILE_AVX512(1, 3); TILE_AVX512(1, 4);
            TILE_AVX512(2, 1); TILE_AVX512(2, 2); TILE_AVX512(2, 3); TILE_AVX512(2, 4);
            TILE_AVX512(3, 1); TILE_AVX512(3, 2); TILE_AVX512(3, 3); TILE_AVX512(3, 4);
            TILE_AVX512(4, 1); TILE_AVX512(4, 2); TILE_AVX512(4, 3);
            default: tile_avx512(xm, ldx, wn, ldw, o, ldm, 4, 4, K); break;
            }
        }
    }
}

/* bf16 widened to float32 (its bits are the float's top half), 8 at a time, in order */
__attribute__((target("avx2,fma")))
static inline __m256 widen8(const uint16_t *w) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Where x's element k sits in its float32 copy for the AVX2 path: within each whole block of
 * 16, the second and third quads trade places. The weights are widened by interleaving their
 * bf16 bits with zeros (unpacklo/hi_epi16: a float's top half; one single-cycle op per 8
 * weights), which yields a block's elements in the order 0-3, 8-11 (lo), 4-7, 12-15 (hi);
 * a dot product does not care about order as long as x is stored in the same one. Elements
 * past the last whole block keep their places. */
static inline int64_t avx2_lane(int64_t k, int64_t K) {
    if (k >= K - K % 16)
        return k;
    int64_t quad = (k >> 2) & 3;
    int64_t moved = quad == 1 ? 2 : quad == 2 ? 1 : quad;
    return (k & ~(int64_t)15) | (moved << 2) | (k & 3);
}

__attribute__((target("avx2,fma")))
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* out[m * ldm + n] = x_m . w_n for MR x rows already widened to float32 (`xf`, row stride
 * ldx, in `avx2_lane` order) and NR weight rows (bf16, row stride ldw), MR, NR <= 3. AVX2 has
 * no bf16 dot product, so the weights are widened in registers and met by FMAs; the
 * activations are widened once per call, not once per weight row. Each widened weight vector
 * meets MR rows and each x vector NR weight rows from registers: one weight row at a time
 * loaded x once per FMA and, from 8 rows on, streamed x from L2 for every weight row (the FMA
 * units two thirds idle; tiles: 1.3-1.7x at 2-32 rows). Small tiles keep two accumulators per
 * output (low and high halves) so the FMA latency stays hidden. While it computes, the tile
 * prefetches `pf_rows` rows (pf, row stride pf_ld) at the column it reads: its share of the
 * weight rows ahead (tiles_avx2). Inlined with constant MR, NR (tiles_avx2). */
__attribute__((target("avx2,fma"), always_inline))
static inline void tile_avx2(const float *xf, int64_t ldx, const uint16_t *w, int64_t ldw,
                             float *out, int64_t ldm, int MR, int NR, int64_t K,
                             const uint16_t *pf, int pf_rows, int64_t pf_ld) {
    const int chains = MR * NR <= 4 ? 2 : 1;
    __m256 acc[3][3][2];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            acc[m][n][0] = acc[m][n][1] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 x[3];
        for (int r = 0; r < pf_rows; r++)
            _mm_prefetch((const char *)(pf + r * pf_ld + k), _MM_HINT_T0);
        for (int m = 0; m < MR; m++)
            x[m] = _mm256_loadu_ps(xf + m * ldx + k);
        for (int n = 0; n < NR; n++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(w + n * ldw + k));
            __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));  /* avx2_lane */
            for (int m = 0; m < MR; m++)
                acc[m][n][0] = _mm256_fmadd_ps(x[m], lo, acc[m][n][0]);
        }
        for (int m = 0; m < MR; m++)
            x[m] = _mm256_loadu_ps(xf + m * ldx + k + 8);
        for (int n = 0; n < NR; n++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(w + n * ldw + k));
            __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
            for (int m = 0; m < MR; m++)
                acc[m][n][chains - 1] = _mm256_fmadd_ps(x[m], hi, acc[m][n][chains - 1]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) {
            __m256 total = chains == 2 ? _mm256_add_ps(acc[m][n][0], acc[m][n][1])
                                       : acc[m][n][0];
            float sum = sum8(total);
            for (int64_t j = k; j < K; j++)
                sum += xf[m * ldx + j] * bf16_to_f32(w[n * ldw + j]);
            out[m * ldm + n] = sum;
        }
}

/* one weight row against MR <= 2 x rows (widened, as tile_avx2): 32 values an iteration into
 * four chains of FMAs a row, prefetching 1 KiB ahead. One x row is batch-1 decode's every
 * weight read. 8 KiB ahead, as the multi-row
 * tiles do, read 21-23 GB/s where 1 KiB read 26-30 over 1 MiB matrices on 4 KiB pages (AMD
 * EPYC VM, two threads, alternated; 512 B: 25-28.5, 2 KiB: 22-26); in native_ab's two runs the
 * one-row GEMV gained 1.06-1.28x and a MoE layer at one token 1.10-1.11x. The multi-row
 * tiles keep 8 KiB: 1 KiB there read 0.71-0.84x. Inlined with constant MR (tiles_avx2). */
__attribute__((target("avx2,fma"), always_inline))
static inline void row_tile_avx2(const float *xf, int64_t ldx, const uint16_t *w, float *out,
                                 int64_t ldm, int MR, int64_t K) {
    __m256 acc[2][4];
    for (int m = 0; m < MR; m++)
        for (int c = 0; c < 4; c++)
            acc[m][c] = _mm256_setzero_ps();
    const __m256i zero = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k + PREFETCH_AHEAD_ROW), _MM_HINT_T0);
        __m256i bits0 = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256i bits1 = _mm256_loadu_si256((const __m256i *)(w + k + 16));
        __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits0));   /* avx2_lane */
        __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits0));
        __m256 w2 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits1));
        __m256 w3 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits1));
        for (int m = 0; m < MR; m++) {
            const float *x = xf + m * ldx + k;
            acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, acc[m][2]);
            acc[m][3] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, acc[m][3]);
        }
    }
    for (; k + 16 <= K; k += 16) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(w + k));
        __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));
        __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
        for (int m = 0; m < MR; m++) {
            acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * ldx + k), lo, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * ldx + k + 8), hi, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++) {
        float sum = sum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]),
                                       _mm256_add_ps(acc[m][2], acc[m][3])));
        for (int64_t j = k; j < K; j++)
            sum += xf[m * ldx + j] * bf16_to_f32(w[j]);
        out[m * ldm] = sum;
    }
}

/* out[m * ldm + n] = x_m . w_n for all M x rows (widened, as tile_avx2) and N weight rows:
 * three weight rows at a time (read from memory once, then from L1 for every x row); one
 * at a time for one or two x rows, where the multiply-adds wait on memory
 * and a single stream reads fastest: three rows at once read 0.9-1.0x at one x row, and at
 * two the GEMV read 1.05-1.20x and a MoE layer at 32 tokens (a third of whose experts get two
 * rows) 1.09-1.15x faster one row at a time (bench/results/native_ab_avx2_rowtile2-{1,2}.md;
 * over eight layers' pools, expert_spells-rowtile2-1.md, 1.03-1.05x at 8 and 32 tokens in
 * both spells, the A/A control 0.99-1.01x). Up to four x rows (two chains each): the GEMV at
 * four rows 0.89-0.98x, MoE 1.00-1.03x (native_ab_avx2_rowtile{3,4}-1.md,
 * expert_spells-rowtile4-1.md); AMD EPYC Zen 3.
 *
 * Each weight row is prefetched 8 KiB ahead of the column a tile reads: a software prefetch
 * keeps reads in flight across the short runs the MoE kernel streams (64-row chunks), 1.1-1.3x
 * its read rate on an AMD EPYC (Zen 3) VM. Only a triple's first tile reads its rows from
 * memory; the tiles after it read them from cache. So with several tiles a triple, each
 * prefetches a share of the rows (tile j rows j, j + tiles, ...), rather than every tile all
 * three: prefetches the first tile had already issued asked memory for nothing, and the next
 * rows came in a burst. At 8 x rows the GEMV read 1.12-1.27x faster, at 4 and 16 0.97-1.17x,
 * at 32 (bound by the multiply-adds) and in the MoE layer (mostly one tile) 0.97-1.06x
 * (bench/results/native_ab_avx2_pfshare-{1,2}.md, AMD EPYC Zen 3; rows of 1024 values, the
 * bench model's; longer rows not measured). Prefetches past the end of a pool do not fault. */
__attribute__((target("avx2,fma")))
static inline void tiles_avx2(const float *xf, int64_t ldx, int64_t M, const uint16_t *w,
                              int64_t ldw, int64_t N, float *out, int64_t ldm, int64_t K) {
    if (M <= 2) {              /* constant row counts: the accumulators stay in registers */
        for (int64_t n = 0; n < N; n++)
            if (M == 1)
                row_tile_avx2(xf, ldx, w + n * ldw, out + n, ldm, 1, K);
            else
                row_tile_avx2(xf, ldx, w + n * ldw, out + n, ldm, 2, K);
        return;
    }
    const int step = 3;
    const int tiles = (int)((M + 2) / 3);          /* a triple's tiles (four rows: two of 2) */
    /* 8 KiB ahead, or where rows are longer the next triple's rows: never the rows a tile is
     * reading (at 4096 values a row, 8 KiB ahead was the next row, read in the same tile) */
    const int64_t ahead = 3 * ldw > PREFETCH_AHEAD ? 3 * ldw : PREFETCH_AHEAD;
    for (int64_t n = 0; n < N; n += step) {
        int nr = N - n < step ? (int)(N - n) : step;
        int j = 0;
        for (int64_t m = 0; m < M; j++) {
            /* (four rows left: two and two, not three and a lone one) */
            int mr = M - m == 4 ? 2 : M - m < 3 ? (int)(M - m) : 3;
            const float *xm = xf + m * ldx;
            const uint16_t *wn = w + n * ldw;
            float *o = out + m * ldm + n;
            const uint16_t *pf = wn + j * ldw + ahead;
            int pf_rows = j < nr ? (nr - j + tiles - 1) / tiles : 0;
            int64_t pf_ld = tiles * ldw;
            /* constant tile shapes, fully unrolled, in registers; from three x rows on, a lone
             * row is never left (four left are two and two) */
            switch (mr * 4 + nr) {
            case 9: tile_avx2(xm, ldx, wn, ldw, o, ldm, 2, 1, K, pf, pf_rows, pf_ld); break;
            case 10: tile_avx2(xm, ldx, wn, ldw, o, ldm, 2, 2, K, pf, pf_rows, pf_ld); break;
            case 11: tile_avx2(xm, ldx, wn, ldw, o, ldm, 2, 3, K, pf, pf_rows, pf_ld); break;
            case 13: tile_avx2(xm, ldx, wn, ldw, o, ldm, 3, 1, K, pf, pf_rows, pf_ld); break;
            case 14: tile_avx2(xm, ldx, wn, ldw, o, ldm, 3, 2, K, pf, pf_rows, pf_ld); break;
            default: tile_avx2(xm, ldx, wn, ldw, o, ldm, 3, 3, K, pf, pf_rows, pf_ld); break;
            }
            m += mr;
        }
    }
}

static void row_plain(const uint16_t *x, int64_t ldx, const uint16_t *row, float *out,
                      int64_t ldy, int M, int64_t K) {
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++)
            sum += bf16_to_f32(x[m * ldx + k]) * bf16_to_f32(row[k]);
        out[m * ldy] = sum;
    }
}

/* one weight row against `count` x rows (any count, a few at a time: the row stays in L1) on
 * the path `isa` names, AVX512-BF16 or plain C (AVX2 computes whole tiles: tiles_avx2) */
static inline void rows_dot(const uint16_t *x, int64_t ldx, int64_t count, const uint16_t *row,
                            float *out, int64_t ldy, int64_t K, int isa) {
    for (int64_t c = 0; c < count; c += MAX_ROWS) {
        int m = count - c < MAX_ROWS ? (int)(count - c) : MAX_ROWS;
        if (isa == ISA_AVX512BF16)
            row_avx512(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
        else
            row_plain(x + c * ldx, ldx, row, out + c * ldy, ldy, m, K);
    }
}

/* one bf16 row [K] as float32 in `avx2_lane` order: each whole block of 16 widened as the
 * tiles widen weights (unpacklo/hi with zeros), the tail in place */
__attribute__((target("avx2")))
static inline void widen_row_avx2(const uint16_t *x, int64_t K, float *xf) {
    const __m256i zero = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256i bits = _mm256_loadu_si256((const __m256i *)(x + k));
        _mm256_storeu_si256((__m256i *)(xf + k), _mm256_unpacklo_epi16(zero, bits));
        _mm256_storeu_si256((__m256i *)(xf + k + 8), _mm256_unpackhi_epi16(zero, bits));
    }
    for (; k < K; k++)
        xf[k] = bf16_to_f32(x[k]);
}

/* bf16 rows [M, K] (row stride ldx) as float32 [M, K] in `avx2_lane` order for the AVX2
 * path, or NULL (other paths need none; NULL too if out of memory, which the caller reports).
 * Vectorized: a scalar pass over 32 rows' activations was a serial 0.1 ms a GEMV. */
static inline float *widen_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                int isa) {
    if (isa != ISA_AVX2)
        return NULL;
    float *xf = malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    for (int64_t m = 0; xf != NULL && m < M; m++)
        widen_row_avx2(x + m * ldx, K, xf + m * K);
    return xf;
}

#endif
