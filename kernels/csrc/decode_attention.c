/* Decode attention over the paged KV store, read in place: each new token attends to its own
 * sequence's keys, found through their flat KV slots, with no gathered or padded copy of them.
 *
 * out[t, hq, :] = sum_j p_j V[s_j, g, :],  p = softmax_j(scale * q[t, hq, :] . K[s_j, g, :])
 * where a key may come in two parts (MLA, absorbed: the latent and the rotated shared key,
 * cached apart): q[t, hq, :d] . K[s_j, g, :] + q[t, hq, d:] . K2[s_j, g, :]
 * over the slots s_j = slots[starts[t] .. starts[t] + lengths[t]) (the last `window` of them
 * when window > 0), g = hq / (h / h_kv) its KV head. q, K, V bf16; sums and out float32.
 * A task takes a token's KV heads (all of them, or one where tokens are few): each key and value
 * row is read once and widened once for the query heads sharing it. Built with the other
 * csrc/*.c into one library (mox/kernels/native.py).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exported.h"
#include "rows.h"
#include "softmax.h"
#include "vexp.h"

/* The scores of one key against a group of query heads: scores[hq * stride] (+)=
 * qf[hq * dq ..] . k[0 .. n) for hq < group (q float32, k bf16; `add`: onto what is there,
 * for MLA's second key part); the vector paths take blocks of keys (block_dot_avx2,
 * block_dot_avx512). */
static void group_dot_plain(const float *qf, int group, int64_t dq, const uint16_t *k,
                            int64_t n, float *scores, int64_t stride, int add) {
    for (int hq = 0; hq < group; hq++) {
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++)
            s += qf[hq * dq + i] * bf16_to_f32(k[i]);
        scores[hq * stride] = add ? scores[hq * stride] + s : s;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512 widen16(const uint16_t *k) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The scores of a block of up to KEY_BLOCK keys (rows at keys + slots[j] * k_stride) against
 * a group of query heads: scores[hq * stride + j] (+)= qf[hq * dq ..] . k_j[0 .. d). The
 * plain path takes the keys one by one. */
#define KEY_BLOCK 16
_Static_assert(KEY_BLOCK == 16, "a block of keys is one vector of 16 float sums (sum_each16)");
#define KEYS_ONE_BY_ONE(name, attributes, dot)                                                \
    attributes static void name(const float *qf, int group, int64_t dq, const uint16_t *keys, \
                                int64_t k_stride, const int64_t *slots, int n, int64_t d,     \
                                float *scores, int64_t stride, int add) {                     \
        for (int j = 0; j < n; j++)                                                           \
            dot(qf, group, dq, keys + slots[j] * k_stride, d, scores + j, stride, add);       \
    }
KEYS_ONE_BY_ONE(block_dot_plain, , group_dot_plain)

/* 8 lanes, eight keys at a time: each key's products for up to four heads summed in registers
 * (a vector a head), parked, and the eight keys' vectors reduced together by sum_each8, as the
 * AVX-512 path below does sixteen. Reduced key by key (sum8: a chain of dependent shuffles and
 * adds per key and head), decode attention read its keys at 4-8 GB/s (AMD EPYC Zen 3). */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void block_dot_avx2_heads(
        const float *q, int heads, int64_t dq, const uint16_t *keys, int64_t k_stride,
        const int64_t *slots, int n, int64_t d, float *scores, int64_t stride, int add) {
    int64_t whole = d & ~(int64_t)7;
    for (int j0 = 0; j0 < n; j0 += 8) {
        __m256 parked[4][8];
        for (int j = 0; j < 8; j++) {
            __m256 acc[4];
            for (int hq = 0; hq < heads; hq++)
                acc[hq] = _mm256_setzero_ps();
            if (j0 + j < n) {
                const uint16_t *k = keys + slots[j0 + j] * k_stride;
                for (int64_t i = 0; i < whole; i += 8) {
                    __m256 kv = widen8(k + i);
                    for (int hq = 0; hq < heads; hq++)
                        acc[hq] = _mm256_fmadd_ps(_mm256_loadu_ps(q + hq * dq + i), kv, acc[hq]);
                }
            }
            for (int hq = 0; hq < heads; hq++)
                parked[hq][j] = acc[hq];
        }
        int count = n - j0 < 8 ? n - j0 : 8;
        for (int hq = 0; hq < heads; hq++) {
            float sums[8];
            _mm256_storeu_ps(sums, sum_each8(parked[hq]));
            float *out = scores + hq * stride + j0;
            for (int j = 0; j < count; j++) {
                float s = sums[j];
                for (int64_t i = whole; i < d; i++)   /* the last d % 8 dims */
                    s += q[hq * dq + i] * bf16_to_f32(keys[slots[j0 + j] * k_stride + i]);
                out[j] = add ? out[j] + s : s;
            }
        }
    }
}

/* A group of query heads four at a time while four are left (a constant count, so the
 * accumulators stay in registers), then one by one */
#define HEADS_BY_FOUR(name, attributes, heads_dot)                                             \
    attributes static void name(const float *qf, int group, int64_t dq, const uint16_t *keys, \
                                int64_t k_stride, const int64_t *slots, int n, int64_t d,     \
                                float *scores, int64_t stride, int add) {                     \
        int h0 = 0;                                                                           \
        for (; h0 + 4 <= group; h0 += 4)                                                      \
            heads_dot(qf + h0 * dq, 4, dq, keys, k_stride, slots, n, d, scores + h0 * stride, \
                      stride, add);                                                           \
        for (; h0 < group; h0++)                                                              \
            heads_dot(qf + h0 * dq, 1, dq, keys, k_stride, slots, n, d, scores + h0 * stride, \
                      stride, add);                                                           \
    }
HEADS_BY_FOUR(block_dot_avx2, __attribute__((target("avx2,fma"))), block_dot_avx2_heads)

/* 16 lanes, a block of keys at a time: each key's products for up to four heads summed in
 * registers (a vector a head), parked, and the block's vectors reduced together by
 * sum_each16. Reducing each key's vector on its own (a chain of dependent shuffles and adds
 * per key and head) held decode attention to 11-17 GB/s with the keys in cache. */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __attribute__((always_inline)) void block_dot_avx512_heads(
        const float *q, int heads, int64_t dq, const uint16_t *keys, int64_t k_stride,
        const int64_t *slots, int n, int64_t d, float *scores, int64_t stride, int add) {
    __m512 parked[4][KEY_BLOCK];
    int64_t whole = d & ~(int64_t)15;
    for (int j = 0; j < KEY_BLOCK; j++) {
        __m512 acc[4];
        for (int hq = 0; hq < heads; hq++)
            acc[hq] = _mm512_setzero_ps();
        if (j < n) {
            const uint16_t *k = keys + slots[j] * k_stride;
            for (int64_t i = 0; i < whole; i += 16) {
                __m512 kv = widen16(k + i);
                for (int hq = 0; hq < heads; hq++)
                    acc[hq] = _mm512_fmadd_ps(_mm512_loadu_ps(q + hq * dq + i), kv, acc[hq]);
            }
        }
        for (int hq = 0; hq < heads; hq++)
            parked[hq][j] = acc[hq];
    }
    __mmask16 valid = (__mmask16)((1u << n) - 1);
    for (int hq = 0; hq < heads; hq++) {
        __m512 s = sum_each16(parked[hq]);
        if (whole < d) {            /* the last d % 16 dims, key by key */
            float tail[KEY_BLOCK] = {0};
            for (int j = 0; j < n; j++)
                for (int64_t i = whole; i < d; i++)
                    tail[j] += q[hq * dq + i] * bf16_to_f32(keys[slots[j] * k_stride + i]);
            s = _mm512_add_ps(s, _mm512_loadu_ps(tail));
        }
        float *out = scores + hq * stride;
        if (add)
            s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(valid, out));
        _mm512_mask_storeu_ps(out, valid, s);
    }
}

HEADS_BY_FOUR(block_dot_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))),
              block_dot_avx512_heads)

/* The softmax of a head's scores (softmax.h's softmax_plain for any CPU), 8 or 16 at a time
 * with vexp.h's exp. */

#define SOFTMAX_VEC(name, attributes, vec, lanes, set1, exp, div, add, sub, maxf, load, store,  \
                    reduce_max, reduce_add)                                                     \
    attributes static void name(float *p, int64_t n) {                                          \
        float top = -INFINITY, total = 0.0f;                                                    \
        int64_t j = 0;                                                                          \
        vec tops = set1(-INFINITY), sums = set1(0.0f);                                          \
        for (; j + lanes <= n; j += lanes)                                                      \
            tops = maxf(tops, load(p + j));                                                     \
        top = reduce_max(tops);                                                                 \
        for (; j < n; j++)                                                                      \
            top = p[j] > top ? p[j] : top;                                                      \
        for (j = 0; j + lanes <= n; j += lanes) {                                               \
            vec e = exp(sub(load(p + j), set1(top)));                                           \
            store(p + j, e);                                                                    \
            sums = add(sums, e);                                                                \
        }                                                                                       \
        float tail[lanes];                                                                      \
        int64_t rest = n - j;                                                                   \
        for (int64_t i = 0; i < lanes; i++)                                                     \
            tail[i] = i < rest ? p[j + i] - top : -INFINITY;                                    \
        store(tail, exp(load(tail)));                                                           \
        for (int64_t i = 0; i < rest; i++)                                                      \
            p[j + i] = tail[i];                                                                 \
        total = reduce_add(sums);                                                               \
        for (int64_t i = 0; i < rest; i++)                                                      \
            total += tail[i];                                                                   \
        vec totals = set1(total);                                                               \
        for (j = 0; j + lanes <= n; j += lanes)                                                 \
            store(p + j, div(load(p + j), totals));                                             \
        for (; j < n; j++)                                                                      \
            p[j] /= total;                                                                      \
    }

__attribute__((target("avx2,fma")))
static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

SOFTMAX_VEC(softmax_avx2, __attribute__((target("avx2,fma"))), __m256, 8, _mm256_set1_ps,
            exp8_avx2, _mm256_div_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_max_ps,
            _mm256_loadu_ps, _mm256_storeu_ps, max8, sum8)
SOFTMAX_VEC(softmax_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))), __m512, 16,
            _mm512_set1_ps, exp16_avx512, _mm512_div_ps, _mm512_add_ps, _mm512_sub_ps,
            _mm512_max_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_reduce_max_ps,
            _mm512_reduce_add_ps)

/* out[hq, :] = sum_j p[hq * length + j] * V[slots[j], :dv] for the hq < group query heads
 * sharing one KV head (`values`: that head's part of the store's first row), each sum over
 * the keys in order. The plain path widens a value row once and adds it into every head. */
static void group_values_plain(const float *p, int group, int64_t length, const int64_t *slots,
                               const uint16_t *values, int64_t v_stride, int64_t dv,
                               float *out) {
    for (int64_t i = 0; i < group * dv; i++)
        out[i] = 0.0f;
    for (int64_t j = 0; j < length; j++) {
        const uint16_t *v = values + slots[j] * v_stride;
        for (int hq = 0; hq < group; hq++)
            for (int64_t i = 0; i < dv; i++)
                out[hq * dv + i] += p[hq * length + j] * bf16_to_f32(v[i]);
    }
}

/* The vector paths keep `width` vectors of values of up to four heads in registers over all
 * the keys (the sums in memory cost a load and a store per FMA): passes of `width` vectors
 * (as wide as the registers allow: a pass reads the key slots and the weights again), then
 * of one, and the last dv % lanes dims take the plain loop. */
#define GROUP_VALUES(name, attributes, vec, lanes, width, zero, widen, fma, set1, store)       \
    attributes static inline __attribute__((always_inline)) void name##_heads(              \
            const float *p, int heads, int vectors, int64_t length, const int64_t *slots,   \
            const uint16_t *values, int64_t v_stride, int64_t dv, float *out) {             \
        vec acc[4][width];                                                                  \
        for (int hq = 0; hq < heads; hq++)                                                  \
            for (int c = 0; c < vectors; c++)                                               \
                acc[hq][c] = zero();                                                        \
        for (int64_t j = 0; j < length; j++) {                                              \
            const uint16_t *v = values + slots[j] * v_stride;                               \
            vec w[width];                                                                   \
            for (int c = 0; c < vectors; c++)                                               \
                w[c] = widen(v + c * lanes);                                                \
            for (int hq = 0; hq < heads; hq++) {                                            \
                vec pj = set1(p[hq * length + j]);                                          \
                for (int c = 0; c < vectors; c++)                                           \
                    acc[hq][c] = fma(pj, w[c], acc[hq][c]);                                 \
            }                                                                               \
        }                                                                                   \
        for (int hq = 0; hq < heads; hq++)                                                  \
            for (int c = 0; c < vectors; c++)                                               \
                store(out + hq * dv + c * lanes, acc[hq][c]);                               \
    }                                                                                       \
    attributes static inline __attribute__((always_inline)) void name##_pass(               \
            const float *p, int group, int vectors, int64_t length, const int64_t *slots,   \
            const uint16_t *values, int64_t v_stride, int64_t dv, float *out) {             \
        int h0 = 0;                                                                         \
        for (; h0 + 4 <= group; h0 += 4)                                                    \
            name##_heads(p + h0 * length, 4, vectors, length, slots, values, v_stride, dv,  \
                         out + h0 * dv);                                                    \
        for (; h0 < group; h0++)                                                            \
            name##_heads(p + h0 * length, 1, vectors, length, slots, values, v_stride, dv,  \
                         out + h0 * dv);                                                    \
    }                                                                                       \
    attributes static void name(const float *p, int group, int64_t length,                  \
                                const int64_t *slots, const uint16_t *values,               \
                                int64_t v_stride, int64_t dv, float *out) {                 \
        int64_t i = 0;                                                                      \
        for (; i + width * lanes <= dv; i += width * lanes)                                 \
            name##_pass(p, group, width, length, slots, values + i, v_stride, dv, out + i); \
        for (; i + lanes <= dv; i += lanes)                                                 \
            name##_pass(p, group, 1, length, slots, values + i, v_stride, dv, out + i);     \
        for (int hq = 0; i < dv && hq < group; hq++)                                        \
            for (int64_t c = i; c < dv; c++) {                                              \
                float sum = 0.0f;                                                           \
                for (int64_t j = 0; j < length; j++)                                        \
                    sum += p[hq * length + j] * bf16_to_f32(values[slots[j] * v_stride + c]); \
                out[hq * dv + c] = sum;                                                     \
            }                                                                               \
    }

GROUP_VALUES(group_values_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))),
             __m512, 16, 4, _mm512_setzero_ps, widen16, _mm512_fmadd_ps, _mm512_set1_ps,
             _mm512_storeu_ps)
GROUP_VALUES(group_values_avx2, __attribute__((target("avx2,fma"))), __m256, 8, 2,
             _mm256_setzero_ps, widen8, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps)

typedef void (*group_values_t)(const float *, int, int64_t, const int64_t *, const uint16_t *,
                               int64_t, int64_t, float *);
typedef void (*block_dot_t)(const float *, int, int64_t, const uint16_t *, int64_t,
                            const int64_t *, int, int64_t, float *, int64_t, int);

/* One token over its keys, for KV heads [g0, g0 + heads) with their groups of query heads
 * (q, out: the token's rows; keys, keys2, values: the store's first rows). Blocks of keys
 * run in the outer loop, so each slot's row of those heads is read from memory once, in
 * order, and widened once for a whole group; scores by `dot` (block_dot_avx512, _avx2 or
 * _plain), the weighted values by `weigh` (group_values_*). Each query head's sums are the
 * same whatever the heads a task takes. */
static inline __attribute__((always_inline)) int attend_token(
        const uint16_t *q, const uint16_t *keys, const uint16_t *keys2, const uint16_t *values,
        int64_t k_stride, int64_t k2_stride, int64_t v_stride, const int64_t *slots,
        int64_t length, int64_t g0, int64_t heads, int group, int64_t d, int64_t d2,
        int64_t dv, float scale, float *out, block_dot_t dot,
        void (*softmax)(float *, int64_t), group_values_t weigh) {
    int64_t dq = d + d2, width = heads * group;          /* query heads in the task */
    float *qf = malloc(sizeof(float) * (size_t)(width * dq + width * length));
    if (qf == NULL)
        return -1;
    float *scores = qf + width * dq;
    q += g0 * group * dq;
    out += g0 * group * dv;
    for (int64_t i = 0; i < width * dq; i++)
        qf[i] = bf16_to_f32(q[i]) * scale;
    for (int64_t j = 0; j < length; j += KEY_BLOCK) {
        int n = length - j < KEY_BLOCK ? (int)(length - j) : KEY_BLOCK;
        for (int64_t g = 0; g < heads; g++) {
            const float *qg = qf + g * group * dq;
            float *sg = scores + g * group * length + j;
            dot(qg, group, dq, keys + (g0 + g) * d, k_stride, slots + j, n, d, sg, length, 0);
            if (d2)
                dot(qg + d, group, dq, keys2 + (g0 + g) * d2, k2_stride, slots + j, n, d2, sg,
                    length, 1);
        }
    }
    for (int64_t hq = 0; hq < width; hq++)
        softmax(scores + hq * length, length);
    for (int64_t g = 0; g < heads; g++)
        weigh(scores + g * group * length, group, length, slots, values + (g0 + g) * dv,
              v_stride, dv, out + g * group * dv);
    free(qf);
    return 0;
}

/* A task is a token's every KV head where tokens are many times the threads, else one
 * (token, KV head): whole tokens read each slot's row once, but too few of them leave a
 * thread with a token more than the others. Claimed dynamically: lengths differ. */
#define TOKENS_PER_THREAD 4

#define ATTEND_ALL(dot, softmax, weigh)                                                       \
    int failed = 0;                                                                       \
    int group = (int)(h / h_kv);                                                          \
    int64_t heads = num_tokens >= TOKENS_PER_THREAD * omp_get_max_threads() ? h_kv : 1;   \
    int64_t per_token = h_kv / heads;                                                     \
    _Pragma("omp parallel for schedule(dynamic, 1) reduction(|:failed)")                  \
    for (int64_t task = 0; task < num_tokens * per_token; task++) {                       \
        int64_t t = task / per_token, g0 = (task % per_token) * heads;                     \
        int64_t start = starts[t], length = lengths[t];                                   \
        if (window > 0 && length > window) {                                              \
            start += length - window;                                                     \
            length = window;                                                              \
        }                                                                                 \
        failed |= attend_token(q + t * q_stride, keys, keys2, values, k_stride, k2_stride, \
                               v_stride, slots + start, length, g0, heads, group, d, d2,  \
                               dv, scale, out + t * h * dv, dot, softmax, weigh);         \
    }                                                                                     \
    return failed ? -1 : 0;

/* the same loops three times: for AVX-512 (16 lanes), for AVX2 (8 lanes), and for any CPU */
#define DEFINE_ATTEND(name, attributes, dot, softmax, weigh)                               \
    attributes static int name(const uint16_t *q, int64_t q_stride, const uint16_t *keys,  \
                               const uint16_t *keys2, const uint16_t *values,             \
                               int64_t k_stride, int64_t k2_stride, int64_t v_stride,     \
                               const int64_t *slots, const int64_t *starts,               \
                               const int64_t *lengths, int64_t num_tokens, int64_t h,      \
                               int64_t h_kv, int64_t d, int64_t d2, int64_t dv,            \
                               float scale, int64_t window, float *out) {                 \
        ATTEND_ALL(dot, softmax, weigh)                                                   \
    }

DEFINE_ATTEND(attend_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))),
              block_dot_avx512, softmax_avx512, group_values_avx512)
DEFINE_ATTEND(attend_avx2, __attribute__((target("avx2,fma"))), block_dot_avx2, softmax_avx2,
              group_values_avx2)
DEFINE_ATTEND(attend_plain, , block_dot_plain, softmax_plain, group_values_plain)

/* q [T, h, d + d2] (token stride q_stride); keys [., h_kv, d], keys2 [., h_kv, d2] (d2 may be
 * 0, keys2 then unused) and values [., h_kv, dv]: the layer's store as flat slots (slot
 * strides k_stride, k2_stride, v_stride); out [T, h, dv] float32. Returns 0, or -1 (bad
 * arguments, or no memory). */
int mox_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *keys,
                              const uint16_t *keys2, const uint16_t *values, int64_t k_stride,
                              int64_t k2_stride, int64_t v_stride, const int64_t *slots,
                              const int64_t *starts, const int64_t *lengths,
                              int64_t num_tokens, int64_t h, int64_t h_kv, int64_t d,
                              int64_t d2, int64_t dv, float scale, int64_t window, float *out,
                              int fast) {
    if (h_kv < 1 || h % h_kv != 0 || d < 1 || d2 < 0 || dv < 1 || num_tokens < 1)
        return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        if (lengths[t] < 1)
            return -1;
    int isa = fast ? mox_vector_isa() : ISA_PLAIN;
    if (fast && isa == ISA_PLAIN)
        return -1;
    if (isa == ISA_AVX2)
        return attend_avx2(q, q_stride, keys, keys2, values, k_stride, k2_stride, v_stride,
                           slots, starts, lengths, num_tokens, h, h_kv, d, d2, dv, scale,
                           window, out);
    if (isa == ISA_AVX512BF16)
        return attend_avx512(q, q_stride, keys, keys2, values, k_stride, k2_stride, v_stride,
                             slots, starts, lengths, num_tokens, h, h_kv, d, d2, dv, scale,
                             window, out);
    return attend_plain(q, q_stride, keys, keys2, values, k_stride, k2_stride, v_stride, slots,
                        starts, lengths, num_tokens, h, h_kv, d, d2, dv, scale, window, out);
}
