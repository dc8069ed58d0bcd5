/* Quantized weight rows against activations quantized to int8 (the MoE kernel's inner loops
 * for int8, int4 and MXFP4 slot pools, moe_experts.c): activations in blocks of QBLOCK values
 * with one float scale each; VPDPBUSD multiplies 64 unsigned weight bytes by 64 signed
 * activation bytes, so weights are held as unsigned values with an offset (int8: w + 128,
 * int4: v + 8 as stored, MXFP4: 2v + 12 from its E2M1 codes), the offset's share subtracted
 * from the sums; without VNNI, AVX2 does the same in two steps (block_dot_avx2; int4 in spans
 * of 128: int4_rows_avx2). FP8 (E4M3) weights are not integers: fp8_rows.h.
 */
#ifndef MOX_QUANT_ROWS_H
#define MOX_QUANT_ROWS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "rows.h"

#define QBLOCK 64              /* activation values sharing one scale */
#define SPAN (2 * QBLOCK)       /* pairs 128: the values one 64-byte load of int4 holds */
#define PREFETCH_AHEAD_QUANT 1024 /* AVX2 row loops: prefetch 1 KiB ahead (see QUANT_ROWS) */
#define PREFETCH_AHEAD_INT4 2048  /* int4_row_vnni_m */

enum { WEIGHTS_BF16, WEIGHTS_INT8, WEIGHTS_INT4, WEIGHTS_MXFP4, WEIGHTS_FP8 };
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

/* An E2M1 code (sign, 2 exponent bits, 1 mantissa bit) as the unsigned byte 2v + 12. */
static const uint8_t MXFP4_BYTES[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                        12, 11, 10, 9, 8, 6, 4, 0};
#define MXFP4_OFFSET 12

/* 64 weights as unsigned bytes: int8 + 128, int4 nibbles (v + 8; low nibbles, then high), or
 * MXFP4 codes mapped to 2v + 12 */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512i weight_bytes_vnni(const uint8_t *row, int64_t k, int kind) {
    if (kind == WEIGHTS_INT8)
        return _mm512_xor_si512(_mm512_loadu_si512(row + k), _mm512_set1_epi8((char)0x80));
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + k / 2)), low = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    if (kind == WEIGHTS_INT4)
        return nibbles;
    __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MXFP4_BYTES));
    return _mm512_shuffle_epi8(table, nibbles);          /* a table lookup per byte */
}

/* a block's 64 weights (weight_bytes_vnni) against 64 activation bytes: int32 sums of 4 bytes */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512i block_dot_vnni(__m512i w, const int8_t *xq, int kind) {
    (void)kind;
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq));
}

/* a block's two groups of 32 (packed: deinterleaved) land in alternate quarters */
__attribute__((target("avx512f")))
static inline __m512 group_scales_vnni(float s0, float s1) {
    return _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
}

/* On AVX2 without VNNI, VPMADDUBSW multiplies unsigned by signed bytes into int16 pairs, which
 * saturate: int4's v + 8 and MXFP4's 2v + 12 stay far below that, and int8 goes as |w| times x
 * with w's sign (so the int8 offset is 0: nothing to subtract). VPMADDWD then sums the pairs
 * into int32. A block of 64 is two halves of 32 bytes (packed: the low nibbles, then the
 * high), each lane of the sum covering 4 bytes of both. */
typedef struct {
    __m256i w0, w1;               /* int8: as stored (signed); packed: unsigned bytes */
} bytes_avx2_t;

__attribute__((target("avx2,fma")))
static inline bytes_avx2_t weight_bytes_avx2(const uint8_t *row, int64_t k, int kind) {
    bytes_avx2_t w;
    if (kind == WEIGHTS_INT8) {
        w.w0 = _mm256_loadu_si256((const __m256i *)(row + k));
        w.w1 = _mm256_loadu_si256((const __m256i *)(row + k + 32));
        return w;
    }
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + k / 2)), low = _mm256_set1_epi8(15);
    w.w0 = _mm256_and_si256(b, low);
    w.w1 = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    if (kind == WEIGHTS_MXFP4) {                        /* a table lookup per byte */
        __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_BYTES));
        w.w0 = _mm256_shuffle_epi8(table, w.w0);
        w.w1 = _mm256_shuffle_epi8(table, w.w1);
    }
    return w;
}

__attribute__((target("avx2,fma")))
static inline __m256i block_dot_avx2(bytes_avx2_t w, const int8_t *xq, int kind) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)xq);
    __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32));
    if (kind == WEIGHTS_INT8) {                         /* x times w's sign, then |w| */
        x0 = _mm256_sign_epi8(x0, w.w0);
        x1 = _mm256_sign_epi8(x1, w.w1);
        w.w0 = _mm256_sign_epi8(w.w0, w.w0);
        w.w1 = _mm256_sign_epi8(w.w1, w.w1);
    }
    __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w.w0, x0), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(w.w1, x1), ones));
}

/* lanes 0-3 of each half's sums hold a block's first group of 32, lanes 4-7 the second */
__attribute__((target("avx2,fma")))
static inline __m256 group_scales_avx2(float s0, float s1) {
    return _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
}

/* The two row loops for each of those: `isa` the suffix of the helpers above, `int8_offset`
 * what its int8 bytes hold beyond the value (VNNI: w + 128; AVX2: none).
 * row_g32_*: one packed weight row with a scale per 32 values (MXFP4, or int4 in groups of
 * 32) against quantized x rows m0 .. m0 + M, a block's two groups' scales as one vector.
 * row_q_*: one quantized weight row (K values; scales per `group` inputs, 0: one per row).
 * Each is compiled once per number of x rows up to 4 (ROWS_CONSTANT): with M known, the
 * accumulators stay in registers. With M a variable up to MAX_ROWS they lived on the stack:
 * on one AVX2 core (AMD EPYC) an int4 row in groups of 128 read 2.0-2.2 GB/s at M = 1 and
 * 9.3-10.8 compiled for it; MXFP4's 4.5-4.8 and 9.9-10.5; at M = 3, 2.3-2.7 and 4.0-4.2.
 * The weight kind is a constant too (rows_*: the branches on it left the inner loop), and
 * the AVX2 loops prefetch `prefetch` bytes of the row ahead, as the bf16 one-row tile does:
 * together 1.3x the int8 and int4 rates of a MoE call with one or two threads (1.1-1.3x
 * from the constant kind and the loop over rows inside, the rest from the prefetch; 512 B
 * ahead read less, 2 KiB the same; bench/micro/expert_rate.py --base). The VNNI loops take
 * no prefetch: 1 KiB ahead gave int8 0.96-1.22x and int4 0.91-1.19x in four expert_rate runs
 * on an AMD EPYC Zen 4 (bf16, unchanged, 1.00-1.42x in the same runs): no gain seen. */
#define ROWS_CONSTANT(M, body, x, m0, ...)                                                   \
    switch (M) {                                                                             \
    case 1: body(x, m0, 1, __VA_ARGS__); break;                                              \
    case 2: body(x, m0, 2, __VA_ARGS__); break;                                              \
    case 3: body(x, m0, 3, __VA_ARGS__); break;                                              \
    case 4: body(x, m0, 4, __VA_ARGS__); break;                                              \
    default: body(x, m0, M, __VA_ARGS__);                                                    \
    }
#define QUANT_ROWS(isa, attributes, vec, wvec, zero, cvt, fma, mul, set1, reduce, int8_offset, \
                   prefetch)                                                                 \
    attributes static inline __attribute__((always_inline)) void row_g32_##isa##_m(        \
            const qrows_t *x, int64_t m0, const int M, const uint8_t *row, int kind,        \
            const float *wscale, float *out, int64_t ldy) {                                 \
        int64_t K = x->K, nb = K / QBLOCK;                                                   \
        /* the bytes hold int4's v + 8, or MXFP4's 2v + 12 (halved at the end) */            \
        float offset = kind == WEIGHTS_INT4 ? 8.0f : MXFP4_OFFSET;                           \
        float unit = kind == WEIGHTS_INT4 ? 1.0f : 0.5f, corr[MAX_ROWS] = {0};               \
        vec acc[MAX_ROWS];                                                                   \
        for (int m = 0; m < M; m++) acc[m] = zero();                                         \
        for (int64_t k = 0; k < K; k += QBLOCK) {                                            \
            if (prefetch)                                                                    \
                _mm_prefetch((const char *)(row + k / 2 + prefetch), _MM_HINT_T0);          \
            wvec w = weight_bytes##_##isa(row, k, kind);                                     \
            float s0 = wscale[k / 32], s1 = wscale[k / 32 + 1];                              \
            vec scales = group_scales_##isa(s0, s1);                                         \
            for (int m = 0; m < M; m++) {                                                    \
                int64_t b = (m0 + m) * nb + k / QBLOCK;                                      \
                vec d = cvt(block_dot_##isa(w, x->q + b * QBLOCK, kind));                    \
                acc[m] = fma(d, mul(scales, set1(x->scale[b])), acc[m]);                     \
                corr[m] += s0 * x->sum32[2 * b] + s1 * x->sum32[2 * b + 1];                  \
            }                                                                                \
        }                                                                                    \
        for (int m = 0; m < M; m++)                                                          \
            out[m * ldy] = unit * (reduce(acc[m]) - offset * corr[m]);                       \
    }                                                                                        \
    attributes static inline __attribute__((always_inline)) void row_q_##isa##_m(          \
            const qrows_t *x, int64_t m0, const int M, const uint8_t *row, int kind,        \
            const float *wscale, int64_t group, float *out, int64_t ldy) {                  \
        int64_t K = x->K, nb = K / QBLOCK, span = group ? group : K;                         \
        int64_t block_bytes = kind == WEIGHTS_INT8 ? QBLOCK : QBLOCK / 2;                    \
        float offset = kind == WEIGHTS_INT8 ? int8_offset : 8.0f, corr[MAX_ROWS] = {0};      \
        vec total[MAX_ROWS];                                                                 \
        for (int m = 0; m < M; m++) total[m] = zero();                                       \
        /* the group's index counted, not divided: a 64-bit IDIV per group of 128 int4     \
         * values (64 bytes) cost more than reading them */                                  \
        for (int64_t g0 = 0, g = 0; g0 < K; g0 += span, g++) {                               \
            vec acc[MAX_ROWS];                                                               \
            float block_sums[MAX_ROWS] = {0}, ws = wscale[g];                                \
            for (int m = 0; m < M; m++) acc[m] = zero();                                     \
            for (int64_t k = g0; k < g0 + span; k += QBLOCK) {                               \
                if (prefetch)                                                                \
                    _mm_prefetch((const char *)(row + k / QBLOCK * block_bytes + prefetch),  \
                                 _MM_HINT_T0);                                               \
                wvec w = weight_bytes##_##isa(row, k, kind);                                 \
                for (int m = 0; m < M; m++) {                                                \
                    int64_t b = (m0 + m) * nb + k / QBLOCK;                                  \
                    vec d = cvt(block_dot_##isa(w, x->q + b * QBLOCK, kind));                \
                    acc[m] = fma(d, set1(x->scale[b]), acc[m]);                              \
                    if (offset != 0.0f)                                                      \
                        block_sums[m] += x->sum32[2 * b] + x->sum32[2 * b + 1];              \
                }                                                                            \
            }                                                                                \
            for (int m = 0; m < M; m++) {                                                    \
                total[m] = fma(acc[m], set1(ws), total[m]);                                  \
                corr[m] += ws * block_sums[m];                                               \
            }                                                                                \
        }                                                                                    \
        for (int m = 0; m < M; m++)                                                          \
            out[m * ldy] = reduce(total[m]) - offset * corr[m];                              \
    }                                                                                        \
    /* weight rows [0, N) (row_bytes apart, scales per_row apart): each kind and row count  \
     * compiled apart, the loop over rows inside, so a row costs no dispatch (int4's 512-byte \
     * rows of 1,024 values took two calls and two switches each) */                         \
    attributes static inline __attribute__((always_inline)) void rows_##isa##_m(          \
            const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t row_bytes, \
            int64_t N, const int kind, const float *wscale, int64_t per_row, int64_t group, \
            float *out, int64_t ldy) {                                                      \
        if (kind != WEIGHTS_INT8 && (kind == WEIGHTS_MXFP4 || group == 32))                  \
            for (int64_t n = 0; n < N; n++)                                                  \
                row_g32_##isa##_m(x, m0, M, w + n * row_bytes, kind, wscale + n * per_row,  \
                                  out + n, ldy);                                             \
        else                                                                                 \
            for (int64_t n = 0; n < N; n++)                                                  \
                row_q_##isa##_m(x, m0, M, w + n * row_bytes, kind, wscale + n * per_row,    \
                                group, out + n, ldy);                                        \
    }                                                                                        \
    attributes static void rows_##isa(const qrows_t *x, int64_t m0, int M, const uint8_t *w, \
                                      int64_t row_bytes, int64_t N, int kind,                \
                                      const float *wscale, int64_t per_row, int64_t group,   \
                                      float *out, int64_t ldy) {                             \
        if (kind == WEIGHTS_INT8)                                                            \
            ROWS_CONSTANT(M, rows_##isa##_m, x, m0, w, row_bytes, N, WEIGHTS_INT8, wscale,   \
                          per_row, group, out, ldy)                                          \
        else if (kind == WEIGHTS_MXFP4)                                                      \
            ROWS_CONSTANT(M, rows_##isa##_m, x, m0, w, row_bytes, N, WEIGHTS_MXFP4, wscale,  \
                          per_row, group, out, ldy)                                          \
        else                                                                                 \
            ROWS_CONSTANT(M, rows_##isa##_m, x, m0, w, row_bytes, N, WEIGHTS_INT4, wscale,   \
                          per_row, group, out, ldy)                                          \
    }

QUANT_ROWS(vnni, __attribute__((target("avx512f,avx512bw,avx512vnni"))), __m512, __m512i,
           _mm512_setzero_ps, _mm512_cvtepi32_ps, _mm512_fmadd_ps, _mm512_mul_ps,
           _mm512_set1_ps, _mm512_reduce_add_ps, 128.0f, 0)
QUANT_ROWS(avx2, __attribute__((target("avx2,fma"))), __m256, bytes_avx2_t, _mm256_setzero_ps,
           _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_set1_ps, sum8, 0.0f,
           PREFETCH_AHEAD_QUANT)

/* int4 rows in groups of a multiple of 128 against activations in spans of 128 (pairs 128):
 * one 64-byte load holds 128 weights, its low nibbles (the span's even values) meet the
 * span's first 64 activation bytes and its high nibbles the next 64, and the int32 sums of
 * the span's two blocks land apart (lanes 0-7: its first block, 8-15: its second), each
 * block keeping its own scale. Per 128 weights that is one load, three bitwise ops and two
 * VPDPBUSD, where two 32-byte loads (row_q_vnni) also took a lane-crossing insert each, a
 * convert and a multiply-add more. row_q_vnni read int4 experts at ~2/3 of bf16's rate; this
 * loop alone read 1.03-1.10x its rate (perf: most samples wait on the weight load), and with
 * the prefetch PREFETCH_AHEAD_INT4 ahead 1.19x (1 KiB 1.14x, 4 KiB 1.17x; two experts a call,
 * experts preset shapes, alternated builds). Each span's sums go straight into the row's
 * total, scaled by the activation blocks' scales times the weights' group scale, and the
 * offset's share is the span's activation sum (sum128) times that group scale: no per-group
 * accumulator, no divide and no four-way sum a span (a loop of ~50 instructions per 128
 * weights became ~20: with the experts in cache, one thread, 1.4x; from memory at one x row
 * 1.06-1.13x, where the read binds, and at four and eight 1.08x and 1.86x, expert_rate). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int4_row_vnni_m(
        const qrows_t *x, int64_t m0, const int M, const int R, const uint8_t *row,
        int64_t row_bytes, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    int64_t spans = x->K / SPAN, per_group = group / SPAN;
    const int8_t *q = x->q;
    const float *xscale = x->scale, *sum128 = x->sum128;
    __m512i low = _mm512_set1_epi8(15);
    __m512 total[2][MAX_ROWS];
    float corr[2][MAX_ROWS] = {{0}};
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++) total[r][m] = _mm512_setzero_ps();
    for (int64_t s = 0, g = 0, group_end = per_group; s < spans; s++) {
        if (s == group_end) {       /* the weights' next scale group (no divide a span) */
            g++;
            group_end += per_group;
        }
        __m512i even[2], odd[2];
        float ws[2];
        for (int r = 0; r < R; r++) {
            const uint8_t *w = row + r * row_bytes + s * (SPAN / 2);
            if (r == R - 1)     /* one a pass: the second row's, which runs ahead of the
                                 * first's (the rows are consecutive) */
                _mm_prefetch((const char *)(w + PREFETCH_AHEAD_INT4), _MM_HINT_T0);
            __m512i bytes = _mm512_loadu_si512(w);
            even[r] = _mm512_and_si512(bytes, low);
            odd[r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            ws[r] = wscale[r * per_row + g];
        }
        for (int m = 0; m < M; m++) {
            int64_t qs = (m0 + m) * spans + s;
            __m512i xe = _mm512_loadu_si512(q + qs * SPAN);
            __m512i xo = _mm512_loadu_si512(q + qs * SPAN + QBLOCK);
            __m512 scales = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xscale[2 * qs]),
                                                 _mm512_set1_ps(xscale[2 * qs + 1]));
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even[r], xe);
                d = _mm512_dpbusd_epi32(d, odd[r], xo);
                total[r][m] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(d), _mm512_mul_ps(scales, _mm512_set1_ps(ws[r])),
                    total[r][m]);
                corr[r][m] += ws[r] * sum128[qs];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < M; m++)      /* the nibbles hold v + 8 */
            out[m * ldy + r] = _mm512_reduce_add_ps(total[r][m]) - 8.0f * corr[r][m];
}

/* From four x rows, two weight rows a pass: they share each activation load, scale and
 * block sum (1.13x the one-row passes' rate at four x rows, two experts a call; at one and
 * two x rows 0.93x and 0.90x: two rows a pass are two interleaved streams) */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int4_rows_vnni_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t row_bytes,
        int64_t N, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    int64_t n = 0;
    for (; M >= 4 && n + 2 <= N; n += 2)
        int4_row_vnni_m(x, m0, M, 2, w + n * row_bytes, row_bytes, wscale + n * per_row,
                        per_row, group, out + n, ldy);
    for (; n < N; n++)
        int4_row_vnni_m(x, m0, M, 1, w + n * row_bytes, row_bytes, wscale + n * per_row,
                        per_row, group, out + n, ldy);
}

/* int4 weight rows [0, N) against x rows m0 .. m0 + M quantized with pairs 128 */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void int4_rows_vnni(const qrows_t *x, int64_t m0, int M, const uint8_t *w,
                           int64_t row_bytes, int64_t N, const float *wscale, int64_t per_row,
                           int64_t group, float *out, int64_t ldy) {
    ROWS_CONSTANT(M, int4_rows_vnni_m, x, m0, w, row_bytes, N, wscale, per_row, group, out,
                  ldy)
}

/* int4_row_vnni_m's span on AVX2 (no VNNI): a span's 64 bytes are two 32-byte loads, the
 * first holding its first block's 64 values (low nibbles the evens, high the odds) and the
 * second its second block's. VPMADDUBSW meets each nibble half with its activation bytes;
 * the two halves' int16 pairs add before one VPMADDWD (|15 x 127 x 2| x 2 < 2^15: no
 * saturation), one int32 sum a block, scaled into one of two accumulators a row. Per 128
 * weights that is ~26 instructions where row_q_avx2's two blocks, a scalar activation-sum
 * chain and a group epilogue took ~40. */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void int4_row_avx2_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *row, const float *wscale,
        int64_t group, float *out, int64_t ldy) {
    int64_t spans = x->K / SPAN, per_group = group / SPAN;
    const int8_t *q = x->q;
    const float *xscale = x->scale, *sum128 = x->sum128;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 total[2][MAX_ROWS];
    float corr[MAX_ROWS] = {0};
    for (int m = 0; m < M; m++) total[0][m] = total[1][m] = _mm256_setzero_ps();
    float ws = wscale[0];
    for (int64_t s = 0, g = 0, group_end = per_group; s < spans; s++) {
        if (s == group_end) {       /* the weights' next scale group (no divide a span) */
            ws = wscale[++g];
            group_end += per_group;
        }
        _mm_prefetch((const char *)(row + s * (SPAN / 2) + PREFETCH_AHEAD_QUANT), _MM_HINT_T0);
        /* each block's nibbles: w0 its evens, w1 its odds */
        bytes_avx2_t a = weight_bytes_avx2(row, s * SPAN, WEIGHTS_INT4);
        bytes_avx2_t b = weight_bytes_avx2(row, s * SPAN + QBLOCK, WEIGHTS_INT4);
        for (int m = 0; m < M; m++) {
            int64_t qs = (m0 + m) * spans + s;
            const int8_t *xs = q + qs * SPAN;      /* evens (64), then odds (64) */
            __m256i d0 = _mm256_add_epi16(
                _mm256_maddubs_epi16(a.w0, _mm256_loadu_si256((const __m256i *)xs)),
                _mm256_maddubs_epi16(a.w1, _mm256_loadu_si256((const __m256i *)(xs + 64))));
            __m256i d1 = _mm256_add_epi16(
                _mm256_maddubs_epi16(b.w0, _mm256_loadu_si256((const __m256i *)(xs + 32))),
                _mm256_maddubs_epi16(b.w1, _mm256_loadu_si256((const __m256i *)(xs + 96))));
            total[0][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d0, ones)),
                                          _mm256_set1_ps(xscale[2 * qs] * ws), total[0][m]);
            total[1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d1, ones)),
                                          _mm256_set1_ps(xscale[2 * qs + 1] * ws), total[1][m]);
            corr[m] += ws * sum128[qs];
        }
    }
    for (int m = 0; m < M; m++)      /* the nibbles hold v + 8 */
        out[m * ldy] = sum8(_mm256_add_ps(total[0][m], total[1][m])) - 8.0f * corr[m];
}

__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void int4_rows_avx2_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t row_bytes,
        int64_t N, const float *wscale, int64_t per_row, int64_t group, float *out,
        int64_t ldy) {
    for (int64_t n = 0; n < N; n++)
        int4_row_avx2_m(x, m0, M, w + n * row_bytes, wscale + n * per_row, group, out + n,
                        ldy);
}

/* int4 weight rows [0, N) against x rows m0 .. m0 + M quantized with pairs 128, on AVX2 */
__attribute__((target("avx2,fma")))
static void int4_rows_avx2(const qrows_t *x, int64_t m0, int M, const uint8_t *w,
                           int64_t row_bytes, int64_t N, const float *wscale, int64_t per_row,
                           int64_t group, float *out, int64_t ldy) {
    ROWS_CONSTANT(M, int4_rows_avx2_m, x, m0, w, row_bytes, N, wscale, per_row, group, out,
                  ldy)
}

/* block b of an int8 weight row (64 values, + 128 as VNNI takes them) against x rows m0 ..
 * m0 + M: total[m] += their sums times the x row's block scale */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int8_block_vnni(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *row, int64_t b, __m512 *total) {
    int64_t nb = x->K / QBLOCK;
    __m512i bytes = _mm512_xor_si512(_mm512_loadu_si512(row + b * QBLOCK),
                                     _mm512_set1_epi8((char)0x80));
    for (int m = 0; m < M; m++) {
        int64_t qb = (m0 + m) * nb + b;
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes,
                                        _mm512_loadu_si512(x->q + qb * QBLOCK));
        total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(x->scale[qb]),
                                   total[m]);
    }
}

/* int8 rows with one scale a row (per channel): the offset's share is then the x row's whole
 * activation sum times the row's scale, summed once a call (xsum) instead of a block at a
 * time, and the row scale applies after the loop; two accumulators a row, alternate blocks,
 * halve the chain of dependent multiply-adds. (rows_vnni's loop for them: 1.5x in cache, one
 * thread; from memory 1.01-1.13x at one x row, where the read binds, 1.00-1.17x at four
 * and 1.10x at eight, expert_rate --base in four runs.) */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void int8_rows_vnni_m(
        const qrows_t *x, int64_t m0, const int M, const uint8_t *w, int64_t N,
        const float *wscale, float *out, int64_t ldy) {
    int64_t K = x->K, nb = K / QBLOCK;
    float xsum[MAX_ROWS];
    for (int m = 0; m < M; m++) {
        const float *s32 = x->sum32 + 2 * (m0 + m) * nb;
        float sum = 0.0f;
        for (int64_t j = 0; j < 2 * nb; j++)
            sum += s32[j];
        xsum[m] = sum;
    }
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * K;
        __m512 even[MAX_ROWS], odd[MAX_ROWS];
        for (int m = 0; m < M; m++)
            even[m] = odd[m] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            int8_block_vnni(x, m0, M, row, b, even);
            int8_block_vnni(x, m0, M, row, b + 1, odd);
        }
        if (b < nb)
            int8_block_vnni(x, m0, M, row, b, even);
        for (int m = 0; m < M; m++) {
            float dot = _mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m]));
            out[m * ldy + n] = wscale[n] * (dot - 128.0f * xsum[m]);
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void int8_rows_vnni(const qrows_t *x, int64_t m0, int M, const uint8_t *w, int64_t N,
                           const float *wscale, float *out, int64_t ldy) {
    ROWS_CONSTANT(M, int8_rows_vnni_m, x, m0, w, N, wscale, out, ldy)
}

/* the stored weight at lane i of block b (packed: deinterleaved as the activations, pairs
 * 64), as an integer: int8 and int4 values, MXFP4's 2v */
static inline int plain_weight(const uint8_t *row, int64_t b, int i, int kind) {
    if (kind == WEIGHTS_INT8)
        return (int8_t)row[b * QBLOCK + i];
    uint8_t byte = row[b * QBLOCK / 2 + i % 32];
    int code = i < QBLOCK / 2 ? byte & 15 : byte >> 4;
    return kind == WEIGHTS_INT4 ? code - 8 : MXFP4_BYTES[code] - MXFP4_OFFSET;
}

static void row_q_plain(const qrows_t *x, int64_t m0, int M, const uint8_t *row, int kind,
                        const float *wscale, int64_t group, float *out, int64_t ldy) {
    int64_t K = x->K, span = group ? group : K;
    for (int m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t b = 0; b < K / QBLOCK; b++) {
            int64_t qb = (m0 + m) * (K / QBLOCK) + b;
            for (int i = 0; i < QBLOCK; i++) {
                /* lane i's value in the row: itself, or (packed) 2i / 2(i - 32) + 1 */
                int64_t k = b * QBLOCK + (kind == WEIGHTS_INT8 ? i : i < 32 ? 2 * i
                                          : 2 * (i - 32) + 1);
                sum += wscale[k / span] * x->scale[qb]
                       * (float)(plain_weight(row, b, i, kind) * x->q[qb * QBLOCK + i]);
            }
        }
        out[m * ldy] = kind == WEIGHTS_MXFP4 ? 0.5f * sum : sum;
    }
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
