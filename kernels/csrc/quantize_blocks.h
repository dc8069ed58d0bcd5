/* Activations quantized to int8 for the MoE kernel's quantized weight rows (quant_rows.h,
 * int4_span_rows.h, fp8_rows.h): a bf16 row in blocks of QBLOCK values, each with one
 * float scale (its largest magnitude / 127) and the sums its weights' offsets need;
 * plain C, AVX2 or AVX-512, all three writing the same bytes
 * (tests/kernels/csrc/quant_rows_check.c).
 */
#ifndef MOX_QUANTIZE_BLOCKS_H
#define MOX_QUANTIZE_BLOCKS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define QBLOCK 64              /* activation values sharing one scale */
#define SPAN (2 * QBLOCK)       /* pairs 128: the values one 64-byte load of int4 holds */

enum { QUANT_PLAIN, QUANT_AVX2, QUANT_AVX512 };

/* Activation rows [M, K] quantized: q, per block of QBLOCK its scale, and per 32 values (in
 * the row's order: MXFP4 scales groups of 32) scale * sum(q), for the weights' offset. Packed
 * pools (two values a byte, the low nibble first) meet q deinterleaved within spans of
 * `pairs` values, as the nibbles unpack: lane i of a span holds value 2i, lane pairs / 2 + i
 * value 2i + 1 (pairs 64: one block, one 32-byte load of weights; 128: two blocks, one
 * 64-byte load, int4_rows_vnni, or two 32-byte loads, int4_rows_avx2); pairs 0: in order. */
typedef struct {
    int8_t *q;
    float *scale;
    float *sum32;
    float *sum128;     /* pairs 128: per span the four sum32 added (int4_row_*_m) */
    int64_t K;
    int pairs;
    int vec;           /* quantize_blocks' vectors: QUANT_AVX512 (F and BW), QUANT_AVX2 or
                        * QUANT_PLAIN */
} qrows_t;

/* per span of row p that [b0, b1) covers whole (callers pass even bounds), its four sum32
 * added */
static void span_sums(const qrows_t *qx, int64_t p, int64_t b0, int64_t b1) {
    int64_t nb = qx->K / QBLOCK;
    for (int64_t s = (b0 + 1) / 2; s < b1 / 2; s++) {
        const float *s32 = qx->sum32 + 2 * (p * nb + 2 * s);
        qx->sum128[p * (nb / 2) + s] = (s32[0] + s32[1]) + (s32[2] + s32[3]);
    }
}

/* block b of row p: its scale and, per 32 values, scale * sum(q) (the weights' offsets) */
static inline void set_block_scale(const qrows_t *qx, int64_t p, int64_t b, float scale,
                                   int64_t total0, int64_t total1) {
    int64_t i = p * (qx->K / QBLOCK) + b;
    qx->scale[i] = scale;
    qx->sum32[2 * i] = scale * (float)total0;
    qx->sum32[2 * i + 1] = scale * (float)total1;
}

/* where block b's values go in row q laid out in spans of `pairs` (qrows_t): its evens from
 * lane offset / 2 of its span, its odds from lane (pairs + offset) / 2 */
static inline void block_halves(int8_t *q, int64_t b, int64_t pairs, int8_t **evens,
                                int8_t **odds) {
    int64_t span = b * QBLOCK & -pairs, offset = b * QBLOCK & (pairs - 1);
    *evens = q + span + offset / 2;
    *odds = q + span + (pairs + offset) / 2;
}

/* blocks [b0, b1) of row p of x (bf16, K values a row) quantized into qx */
static void quantize_blocks_plain(const uint16_t *x, const qrows_t *qx, int64_t p, int64_t b0,
                                  int64_t b1) {
    int64_t K = qx->K, pairs = qx->pairs;
    int8_t *q = qx->q + p * K;
    for (int64_t b = b0; b < b1; b++) {
        float v[QBLOCK], amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            v[i] = bf16_to_f32(x[p * K + b * QBLOCK + i]);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int total[2] = {0, 0};
        /* the block's span and its offset there (pairs: a power of two) */
        int64_t span = pairs ? b * QBLOCK & -pairs : b * QBLOCK;
        int64_t offset = pairs ? b * QBLOCK & (pairs - 1) : 0;
        for (int i = 0; i < QBLOCK; i++) {
            int64_t o = offset + i;
            int t = (int)lrintf(v[i] * inv);
            q[span + (!pairs ? o : o & 1 ? pairs / 2 + o / 2 : o / 2)] = (int8_t)t;
            total[i / 32] += t;
        }
        set_block_scale(qx, p, b, amax / 127.0f, total[0], total[1]);
    }
}

/* quantize_blocks_plain's bits, 16 values a vector: the same products, and the conversion
 * rounds to nearest even as lrintf does (a scalar block of 64 took ~1.5 us: a libm call per
 * value for fmaxf and lrintf) */
__attribute__((target("avx512f,avx512bw")))
static void quantize_blocks_avx512(const uint16_t *x, const qrows_t *qx, int64_t p, int64_t b0,
                                   int64_t b1) {
    int64_t K = qx->K, pairs = qx->pairs;
    int8_t *q = qx->q + p * K;
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *src = x + p * K + b * QBLOCK;
        __m512 v[4], amax = _mm512_setzero_ps();
        for (int j = 0; j < 4; j++) {
            __m256i bits = _mm256_loadu_si256((const __m256i *)(src + 16 * j));
            v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
            amax = _mm512_max_ps(_mm512_abs_ps(v[j]), amax);  /* a NaN skipped, as fmaxf */
        }
        float top = _mm512_reduce_max_ps(amax);
        __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        __m512i t[4];
        for (int j = 0; j < 4; j++) {           /* a NaN product (NaN, or inf * 0): 0, as plain */
            __m512 scaled = _mm512_mul_ps(v[j], inv);
            t[j] = _mm512_maskz_cvtps_epi32(_mm512_cmp_ps_mask(scaled, scaled, _CMP_ORD_Q),
                                            scaled);
        }
        set_block_scale(qx, p, b, top / 127.0f,
                        _mm512_reduce_add_epi32(_mm512_add_epi32(t[0], t[1])),
                        _mm512_reduce_add_epi32(_mm512_add_epi32(t[2], t[3])));
        if (!pairs) {
            for (int j = 0; j < 4; j++)
                _mm_storeu_si128((__m128i *)(q + b * QBLOCK + 16 * j),
                                 _mm512_cvtepi32_epi8(t[j]));
            continue;
        }
        int8_t *at_even, *at_odd;
        block_halves(q, b, pairs, &at_even, &at_odd);
        for (int h = 0; h < 2; h++) {
            __m512i e = _mm512_permutex2var_epi32(t[2 * h], evens, t[2 * h + 1]);
            __m512i o = _mm512_permutex2var_epi32(t[2 * h], odds, t[2 * h + 1]);
            _mm_storeu_si128((__m128i *)(at_even + 16 * h), _mm512_cvtepi32_epi8(e));
            _mm_storeu_si128((__m128i *)(at_odd + 16 * h), _mm512_cvtepi32_epi8(o));
        }
    }
}

/* A block's 64 int8 values (8 vectors of int32, in order) stored as qrows_t lays them out:
 * in order (pairs 0), or split into evens and odds within the span. packs_epi32 / packs_epi16
 * keep 128-bit lanes apart, so one permute puts the bytes back in order; a byte shuffle per
 * 16 values and a permute then split evens from odds. */
__attribute__((target("avx2,fma")))
static inline void store_block_avx2(const __m256i *t, int8_t *q, int64_t b, int64_t pairs) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    int8_t *at_even = NULL, *at_odd = NULL;
    if (pairs)
        block_halves(q, b, pairs, &at_even, &at_odd);
    for (int h = 0; h < 2; h++) {                   /* values 0-31, then 32-63 */
        __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(t[4 * h], t[4 * h + 1]),
                                           _mm256_packs_epi32(t[4 * h + 2], t[4 * h + 3]));
        __m256i bytes = _mm256_permutevar8x32_epi32(words, order);
        if (!pairs) {
            _mm256_storeu_si256((__m256i *)(q + b * QBLOCK + 32 * h), bytes);
            continue;
        }
        /* 16 evens in the low half, 16 odds in the high */
        __m256i parts = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split),
                                                 _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i *)(at_even + 16 * h), _mm256_castsi256_si128(parts));
        _mm_storeu_si128((__m128i *)(at_odd + 16 * h), _mm256_extracti128_si256(parts, 1));
    }
}

/* quantize_blocks_avx512's bits in 8 lanes (AVX2 without AVX-512: the scalar loop was ~9% of
 * an int4 expert call at one row, perf) */
__attribute__((target("avx2,fma")))
static void quantize_blocks_avx2(const uint16_t *x, const qrows_t *qx, int64_t p, int64_t b0,
                                 int64_t b1) {
    int64_t K = qx->K;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = b0; b < b1; b++) {
        const uint16_t *src = x + p * K + b * QBLOCK;
        __m256 v[8], amax = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            __m128i bits = _mm_loadu_si128((const __m128i *)(src + 8 * j));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
            amax = _mm256_max_ps(_mm256_and_ps(v[j], magnitude), amax);  /* a NaN skipped */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
        __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        __m256i t[8];
        for (int j = 0; j < 8; j++) {   /* nearest even, as lrintf; a NaN product: 0, as plain */
            __m256 scaled = _mm256_mul_ps(v[j], inv);
            t[j] = _mm256_and_si256(_mm256_cvtps_epi32(scaled),
                                    _mm256_castps_si256(_mm256_cmp_ps(scaled, scaled, _CMP_ORD_Q)));
        }
        __m256i half0 = _mm256_add_epi32(_mm256_add_epi32(t[0], t[1]),
                                         _mm256_add_epi32(t[2], t[3]));
        __m256i half1 = _mm256_add_epi32(_mm256_add_epi32(t[4], t[5]),
                                         _mm256_add_epi32(t[6], t[7]));
        __m256i sums = _mm256_hadd_epi32(half0, half1);      /* (lanes 0-1, 4-5: half0's) */
        sums = _mm256_hadd_epi32(sums, sums);
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, sums);
        set_block_scale(qx, p, b, top / 127.0f, lanes[0] + lanes[4], lanes[1] + lanes[5]);
        store_block_avx2(t, qx->q + p * K, b, qx->pairs);
    }
}

static void quantize_blocks(const uint16_t *x, const qrows_t *qx, int64_t p, int64_t b0,
                            int64_t b1) {
    if (qx->vec == QUANT_AVX512)
        quantize_blocks_avx512(x, qx, p, b0, b1);
    else if (qx->vec == QUANT_AVX2)
        quantize_blocks_avx2(x, qx, p, b0, b1);
    else
        quantize_blocks_plain(x, qx, p, b0, b1);
    if (qx->pairs == SPAN)
        span_sums(qx, p, b0, b1);
}

static int qrows_alloc(qrows_t *q, int64_t rows, int64_t K, int pairs, int vec) {
    q->K = K;
    q->pairs = pairs;
    q->vec = vec;
    q->q = malloc((size_t)(rows * K));
    q->scale = malloc(sizeof(float) * (size_t)(rows * K / QBLOCK));
    q->sum32 = malloc(sizeof(float) * (size_t)(rows * K / 32));
    q->sum128 = malloc(sizeof(float) * (size_t)(rows * K / SPAN + 1));
    return q->q && q->scale && q->sum32 && q->sum128;
}

static void qrows_free(qrows_t *q) {
    free(q->q);
    free(q->scale);
    free(q->sum32);
    free(q->sum128);
}

#endif
