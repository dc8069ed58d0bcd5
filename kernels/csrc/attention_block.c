/* The attention half of one decoder layer for CPU decode, in one call: what the Python layer
 * (mox/models/decoder.py, attention.py) runs as a dozen kernel and torch calls, each paying
 * the interpreter's dispatch (~0.7 ms a layer at batch 1, more than its weights take to read):
 *
 *     h = rms_norm(x, input_norm)
 *     q, k, v = split(h @ qkv^T (+ qkv_bias))           q/k normed over the full width or per
 *     q, k = rope(q, k); store k, v at slot_mapping       head where the model does
 *     a = attend(q, the sequence's keys and values in place)
 *     x_out = x + (a @ o^T (+ o_bias));  h_out = rms_norm(x_out, post_norm)
 *
 * Every step is the same C function the Python path calls, on the same bf16 intermediates
 * rounded at the same points (bias and residual adds as torch rounds them: float32 sum,
 * nearest even), so the two paths give identical bits. bf16 throughout; decode only (each
 * token's keys one run of flat slots: `starts`, `lengths`).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exported.h"
#include "timeline.h"
#include "layers.h"

/* out [T, n] = y + b (b's row stride b_ld: 0 for a bias), rounded to bf16 as torch's add */
static void add_rows(const uint16_t *y, int64_t ld, const uint16_t *b, int64_t b_ld, int64_t T,
                     int64_t n, uint16_t *out, int64_t out_ld) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++)
            out[t * out_ld + i] = f32_to_bf16(bf16_to_f32(y[t * ld + i])
                                              + bf16_to_f32(b[t * b_ld + i]));
}

/* x, x_out, h_out [T, H] bf16 (contiguous; x_out may be x); cos, sin [T, ldc] float32 (the
 * first rotary_dim of each row used); the layer's store keys, values [store_rows, h_kv, d];
 * slot_mapping [T]: where each new token's k, v go; token t attends to the slots
 * kv_slots[starts[t] .. starts[t] + lengths[t]) of the num_keys given. Returns 0, -1 for
 * arguments a step refused (a key run or slot out of bounds among them: checked before any
 * step runs), -2 out of memory. */
int mox_attention_block_bf16(const attention_layer_t *L, const uint16_t *x, int64_t T,
                             const float *cos, const float *sin, int64_t ldc, uint16_t *keys,
                             uint16_t *values, int64_t store_rows, const int64_t *slot_mapping,
                             const int64_t *kv_slots, int64_t num_keys, const int64_t *starts,
                             const int64_t *lengths, uint16_t *x_out, uint16_t *h_out) {
    for (int64_t t = 0; t < T; t++)
        if (starts[t] < 0 || lengths[t] < 1 || starts[t] + lengths[t] > num_keys)
            return -1;
    for (int64_t j = 0; j < num_keys; j++)
        if (kv_slots[j] < 0 || kv_slots[j] >= store_rows)
            return -1;
    int64_t H = L->hidden, d = L->head_dim, qw = L->heads * d, kw = L->kv_heads * d;
    int64_t width = qw + 2 * kw;
    /* the intermediates in one allocation: the float scores first (aligned), then the bf16
     * rows h, qkv, normed q/k, the attended rows and their projection */
    float *scores = malloc(sizeof(float) * (size_t)(T * qw)
                           + sizeof(uint16_t) * (size_t)(T * (2 * H + width + 2 * qw + kw)));
    if (!scores)
        return -2;
    uint16_t *h = (uint16_t *)(scores + T * qw), *qkv = h + T * H, *normed = qkv + T * width;
    uint16_t *attended = normed + T * (qw + kw), *projected = attended + T * qw;
    int status;
    TIMELINE_START;
    if ((status = mox_rms_norm_bf16(x, H, L->input_norm, h, H, T, H, L->eps)) != 0
        || (status = mox_gemv_bf16(h, H, L->qkv, H, qkv, width, T, width, H, OUT_BF16,
                                   1)) != 0)
        goto done;
    if (L->qkv_bias)
        add_rows(qkv, width, L->qkv_bias, 0, T, width, qkv, width);
    uint16_t *q = qkv, *k = qkv + qw, *v = qkv + qw + kw;
    TIMELINE_MARK(PHASE_QKV);
    int64_t ldq = width, ldk = width;
    if (L->qk_norm == QK_NORM_FULL) {           /* into compact rows, as torch returns them */
        if ((status = mox_rms_norm_bf16(q, width, L->q_norm, normed, qw, T, qw, L->eps)) != 0
            || (status = mox_rms_norm_bf16(k, width, L->k_norm, normed + T * qw, kw, T, kw,
                                           L->eps)) != 0)
            goto done;
        q = normed, ldq = qw, k = normed + T * qw, ldk = kw;
    } else if (L->qk_norm == QK_NORM_PER_HEAD) {  /* in place, one head a row */
        for (int64_t t = 0; t < T; t++)
            if ((status = mox_rms_norm_bf16(q + t * ldq, d, L->q_norm, q + t * ldq, d, L->heads,
                                            d, L->eps)) != 0
                || (status = mox_rms_norm_bf16(k + t * ldk, d, L->k_norm, k + t * ldk, d,
                                               L->kv_heads, d, L->eps)) != 0)
                goto done;
    }
    TIMELINE_MARK(PHASE_QK_NORM);
    if ((status = mox_rope_kv_bf16(q, ldq, k, ldk, v, width, cos, sin, ldc, T, L->heads,
                                   L->kv_heads, d, d, L->rotary_dim, L->interleaved, keys,
                                   values, slot_mapping, store_rows)) != 0)
        goto done;
    TIMELINE_MARK(PHASE_ROPE);
    if ((status = mox_decode_attention_bf16(q, ldq, keys, keys, values, kw, kw, kw, kv_slots,
                                               starts, lengths, T, L->heads, L->kv_heads, d, 0,
                                               d, L->scale, L->window, scores, 1)) != 0)
        goto done;
    TIMELINE_MARK(PHASE_ATTEND);
    for (int64_t i = 0; i < T * qw; i++)
        attended[i] = f32_to_bf16(scores[i]);
    if ((status = mox_gemv_bf16(attended, qw, L->o, qw, projected, H, T, H, qw, OUT_BF16,
                                1)) != 0)
        goto done;
    if (L->o_bias)
        add_rows(projected, H, L->o_bias, 0, T, H, projected, H);
    add_rows(x, H, projected, H, T, H, x_out, H);                  /* the residual */
    status = mox_rms_norm_bf16(x_out, H, L->post_norm, h_out, H, T, H, L->eps);
    TIMELINE_MARK(PHASE_OUT);
done:
    free(scores);
    return status;
}
