/* Decode attention over the paged KV store, read in place: each new token attends to its own
 * sequence's keys, found through their flat KV slots, with no gathered or padded copy of them.
 *
 * out[t, hq, :] = sum_j p_j V[s_j, g, :],  p = softmax_j(scale * q[t, hq, :] . K[s_j, g, :])
 * where a key may come in two parts (MLA, absorbed: the latent and the rotated shared key,
 * cached apart): q[t, hq, :d] . K[s_j, g, :] + q[t, hq, d:] . K2[s_j, g, :]
 * over the slots s_j = slots[starts[t] .. starts[t] + lengths[t]) (the last `window` of them
 * when window > 0), g = hq / (h / h_kv) its KV head. q, K, V bf16; sums and out float32.
 * One task per (token, KV head): the group of query heads sharing that head reads each key
 * and value row once. Built with the other csrc/*.c into one library (mox/kernels/native.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exported.h"
#include "rows.h"

/* q . k over n values (q float32, k bf16) */
static float dot_plain(const float *q, const uint16_t *k, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++)
        s += q[i] * bf16_to_f32(k[i]);
    return s;
}

/* the same with 16 lanes: the compiler does not vectorize the plain loop's float sum (it
 * may not reorder it), which left the scores scalar: ~1 ms a layer at 32 sequences */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static float dot_avx512(const float *q, const uint16_t *k, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(k + i)));
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i),
                              _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), acc);
    }
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++)
        s += q[i] * bf16_to_f32(k[i]);
    return s;
}

/* the same with 8 lanes, for CPUs with AVX2 but not AVX-512 */
__attribute__((target("avx2,fma")))
static float dot_avx2(const float *q, const uint16_t *k, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), widen8(k + i), acc);
    float s = sum8(acc);
    for (; i < n; i++)
        s += q[i] * bf16_to_f32(k[i]);
    return s;
}

/* scores by `dot` (dot_avx512, dot_avx2 or dot_plain); the dv loops are elementwise, which
 * the vector builds below get vectorized by the compiler */
static inline __attribute__((always_inline)) int attend_one(
        const uint16_t *q, const uint16_t *keys, const uint16_t *keys2, const uint16_t *values,
        int64_t k_stride, int64_t k2_stride, int64_t v_stride, const int64_t *slots,
        int64_t length, int group, int64_t d, int64_t d2, int64_t dv, float scale, float *out,
        int64_t out_head_stride, float (*dot)(const float *, const uint16_t *, int64_t)) {
    int64_t dq = d + d2;
    float *qf = malloc(sizeof(float) * (size_t)(group * dq + group * length + dv));
    if (qf == NULL)
        return -1;
    float *scores = qf + group * dq, *row = scores + group * length;
    for (int64_t i = 0; i < group * dq; i++)
        qf[i] = bf16_to_f32(q[i]) * scale;
    for (int64_t j = 0; j < length; j++) {
        const uint16_t *k = keys + slots[j] * k_stride;
        const uint16_t *k2 = keys2 + slots[j] * k2_stride;
        for (int hq = 0; hq < group; hq++) {
            const float *qh = qf + hq * dq;
            scores[hq * length + j] = dot(qh, k, d) + (d2 ? dot(qh + d, k2, d2) : 0.0f);
        }
    }
    for (int hq = 0; hq < group; hq++) {
        float *p = scores + hq * length, top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < length; j++)
            top = p[j] > top ? p[j] : top;
        for (int64_t j = 0; j < length; j++)
            total += (p[j] = expf(p[j] - top));
        for (int64_t j = 0; j < length; j++)
            p[j] /= total;
        float *o = out + hq * out_head_stride;
        for (int64_t i = 0; i < dv; i++)
            o[i] = 0.0f;
        for (int64_t j = 0; j < length; j++) {
            const uint16_t *v = values + slots[j] * v_stride;
            for (int64_t i = 0; i < dv; i++)
                row[i] = bf16_to_f32(v[i]);
            for (int64_t i = 0; i < dv; i++)
                o[i] += p[j] * row[i];
        }
    }
    free(qf);
    return 0;
}

#define ATTEND_ALL(dot)                                                                   \
    int failed = 0;                                                                       \
    int group = (int)(h / h_kv);                                                          \
    _Pragma("omp parallel for schedule(static) reduction(|:failed)")                      \
    for (int64_t task = 0; task < num_tokens * h_kv; task++) {                            \
        int64_t t = task / h_kv, g = task % h_kv, start = starts[t], length = lengths[t];  \
        if (window > 0 && length > window) {                                              \
            start += length - window;                                                     \
            length = window;                                                              \
        }                                                                                 \
        failed |= attend_one(q + t * q_stride + g * group * (d + d2), keys + g * d,        \
                             keys2 + g * d2, values + g * dv, k_stride, k2_stride,        \
                             v_stride, slots + start, length, group, d, d2, dv, scale,    \
                             out + (t * h + g * group) * dv, dv, dot);                    \
    }                                                                                     \
    return failed ? -1 : 0;

/* the same loops three times: compiled for AVX-512 (16-lane scores; the compiler vectorizes
 * the dv loops with it), for AVX2 (8 lanes), and for any CPU */
#define DEFINE_ATTEND(name, attributes, dot)                                              \
    attributes static int name(const uint16_t *q, int64_t q_stride, const uint16_t *keys,  \
                               const uint16_t *keys2, const uint16_t *values,             \
                               int64_t k_stride, int64_t k2_stride, int64_t v_stride,     \
                               const int64_t *slots, const int64_t *starts,               \
                               const int64_t *lengths, int64_t num_tokens, int64_t h,      \
                               int64_t h_kv, int64_t d, int64_t d2, int64_t dv,            \
                               float scale, int64_t window, float *out) {                 \
        ATTEND_ALL(dot)                                                                   \
    }

DEFINE_ATTEND(attend_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))), dot_avx512)
DEFINE_ATTEND(attend_avx2, __attribute__((target("avx2,fma"))), dot_avx2)
DEFINE_ATTEND(attend_plain, , dot_plain)

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
