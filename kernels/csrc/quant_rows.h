/* Quantized weight rows against activations quantized to int8 (the MoE kernel's inner loops
 * for int8, int4 and MXFP4 slot pools, moe_experts.c): activations in blocks of QBLOCK values
 * with one float scale each; VPDPBUSD multiplies 64 unsigned weight bytes by 64 signed
 * activation bytes, so weights are held as unsigned values with an offset (int8: w + 128,
 * int4: v + 8 as stored, MXFP4: 2v + 12 from its E2M1 codes), the offset's share subtracted
 * from the sums; without VNNI, AVX2 does the same in two steps (block_dot_avx2). int4 in
 * spans of 128 has its own loops (int4_span_rows.h); FP8 (E4M3) weights are not integers
 * (fp8_rows.h); the activations' quantizers are in quantize_blocks.h.
 */
#ifndef MOX_QUANT_ROWS_H
#define MOX_QUANT_ROWS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "quantize_blocks.h"
#include "rows.h"

#define PREFETCH_AHEAD_QUANT 1024 /* AVX2 row loops: prefetch 1 KiB ahead (see QUANT_ROWS) */

enum { WEIGHTS_BF16, WEIGHTS_INT8, WEIGHTS_INT4, WEIGHTS_MXFP4, WEIGHTS_FP8 };

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

#endif
