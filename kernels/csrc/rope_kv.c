/* Rotary embedding of a decode step's queries and keys, and the new keys and values written
 * into the paged KV store, in one call per layer instead of ~25 small torch ops.
 *
 * The arithmetic is the reference's (mox/models/rotary.py) step for step in float32: each
 * rotated value is x * cos + x' * sin, products rounded before the sum (built without FMA
 * contraction: the library builds with -ffp-contract=off), then rounded to bf16 once,
 * so tokens match the torch path bit for bit. Halves (Llama: x' is the other half, the
 * first negated) or interleaved pairs (DeepSeek: evens then odds in the output, as the
 * reference lists them); dims past `rot` pass through.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exported.h"

#define MAX_ROTARY 1024

/* one head's row of `dim` values rotated in place by a token's cos/sin [rot] */
static void rotate_row(uint16_t *x, const float *cos, const float *sin, int64_t rot,
                       int interleaved) {
    int64_t half = rot / 2;
    float in[MAX_ROTARY], out[MAX_ROTARY];
    for (int64_t i = 0; i < rot; i++)
        in[i] = bf16_to_f32(x[i]);
    for (int64_t i = 0; i < half; i++) {
        float a, b;                           /* the pair (a, b) rotated by angle i */
        if (interleaved) {
            a = in[2 * i];
            b = in[2 * i + 1];
        } else {
            a = in[i];
            b = in[half + i];
        }
        /* the reference's table entries: halves read cos[half + i] for the second half (the
         * table repeats each angle per half), pairs the first half's */
        int64_t second = interleaved ? i : half + i;
        float ac = a * cos[i], bs = b * sin[i];
        float bc = b * cos[second], as = a * sin[second];
        out[i] = ac - bs;
        out[half + i] = bc + as;
    }
    for (int64_t i = 0; i < rot; i++)
        x[i] = f32_to_bf16(out[i]);
}

/* q [T, h, d] (token stride ldq), k [T, h_kv, d] (ldk): rotated in place by cos/sin [T, rot]
 * (ldc); then key row t -> keys + slots[t] * h_kv * d, value row (v [T, h_kv, dv], ldv) ->
 * values + slots[t] * h_kv * dv, of a store of `store_rows` slots. Returns 0, or -1 for a
 * shape it does not take or a slot outside the store (nothing written then). */
int mox_rope_kv_bf16(uint16_t *q, int64_t ldq, uint16_t *k, int64_t ldk, const uint16_t *v,
                     int64_t ldv, const float *cos, const float *sin, int64_t ldc, int64_t T,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                     int64_t rot, int interleaved, uint16_t *keys, uint16_t *values,
                     const int64_t *slots, int64_t store_rows) {
    if (T < 1 || rot < 2 || rot % 2 || rot > dim || rot > MAX_ROTARY)
        return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= store_rows)
            return -1;
    #pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * ldc, *s = sin + t * ldc;
        for (int64_t n = 0; n < heads; n++)
            rotate_row(q + t * ldq + n * dim, c, s, rot, interleaved);
        for (int64_t n = 0; n < kv_heads; n++)
            rotate_row(k + t * ldk + n * dim, c, s, rot, interleaved);
        memcpy(keys + slots[t] * kv_heads * dim, k + t * ldk,
               sizeof(uint16_t) * (size_t)(kv_heads * dim));
        memcpy(values + slots[t] * kv_heads * value_dim, v + t * ldv,
               sizeof(uint16_t) * (size_t)(kv_heads * value_dim));
    }
    return 0;
}
