/* The routed experts of one MoE layer for CPU decode, in one call: what the Python block
 * (mox/models/moe.py) runs as a router GEMV, a softmax, a top-k, the pager's lease and the
 * kernel's gather and scatter, each paying the interpreter's dispatch (~0.2 ms a layer at
 * batch 1, as long as the layer's experts take to read):
 *
 *     logits = h @ router^T (+ router_bias)                     rounded to bf16, as torch's
 *     weights, ids = top-k of softmax(logits) (or softmax of the top-k logits)
 *     slots = slot_of[ids]        every one resident, or the call returns and Python pages
 *     out = sum over the k of weight * expert(h)                float32, in slot order
 *     x_out = residual + out                                    rounded as torch's add
 *
 * The experts are moe_experts.c's; rows are summed per token in ascending slot order, as the
 * torch path's index_add over slot-sorted rows does. The routing's exp and sums may differ
 * from torch's in the last bit (tests hold it to a tolerance and greedy tokens equal).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "exported.h"
#include "layers.h"
#include "softmax.h"
#include "timeline.h"

/* ids [k] of the k largest of v [n], largest first (ties: the lower index, as
 * mox/kernels/routing.py's top_k) */
static void top_k(const float *v, int64_t n, int64_t k, int32_t *ids) {
    int64_t have = 0;
    for (int64_t e = 0; e < n; e++) {
        if (have == k && !(v[e] > v[ids[k - 1]]))
            continue;
        int64_t j = have < k ? have++ : k - 1;
        for (; j > 0 && v[e] > v[ids[j - 1]]; j--)
            ids[j] = ids[j - 1];
        ids[j] = (int32_t)e;
    }
}

/* one token's weights [k] and ids [k] from its bf16 logits [E]; `scores` [E] scratch */
static void route(const uint16_t *logits, int64_t E, int64_t k, int scoring, int renormalize,
                  float scaling, float *scores, float *weights, int32_t *ids) {
    for (int64_t e = 0; e < E; e++)
        scores[e] = bf16_to_f32(logits[e]);
    if (scoring == SCORE_SOFTMAX_TOPK)
        softmax_plain(scores, E);
    top_k(scores, E, k, ids);
    for (int64_t j = 0; j < k; j++)
        weights[j] = scores[ids[j]];
    if (scoring == SCORE_TOPK_SOFTMAX)
        softmax_plain(weights, k);
    if (renormalize) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++)
            sum += weights[j];
        for (int64_t j = 0; j < k; j++)
            weights[j] /= sum;
    }
    if (scaling != 1.0f)
        for (int64_t j = 0; j < k; j++)
            weights[j] *= scaling;
}

/* The routing alone, for the Python block (mox/models/moe.py's route), so both paths pick
 * and weigh experts by one definition: logits [T, E] bf16 -> weights [T, k] f32, ids [T, k].
 * Returns 0, -1 for arguments refused, -2 out of memory. */
int mox_route_bf16(const uint16_t *logits, int64_t T, int64_t E, int64_t k, int scoring,
                   int renormalize, float scaling, float *weights, int32_t *ids) {
    if (T < 0 || k < 1 || k > E || (scoring != SCORE_SOFTMAX_TOPK
                                    && scoring != SCORE_TOPK_SOFTMAX))
        return -1;
    float *scores = malloc(sizeof(float) * (size_t)E);
    if (scores == NULL)
        return -2;
    for (int64_t t = 0; t < T; t++)
        route(logits + t * E, E, k, scoring, renormalize, scaling, scores, weights + t * k,
              ids + t * k);
    free(scores);
    return 0;
}

static int compare_keys(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* h [T, H] bf16 (contiguous): the layer's normed input. slot_of [E]: the layer's residency
 * table (read live: the pager holds its pool, so a published slot keeps its expert; slots
 * from num_slots on are not in these pools and count as missing). Out: weights [T, k] f32,
 * ids [T, k] int32 always; where every routed expert is resident, x_out [T, H] =
 * residual + experts (residual NULL: the experts alone). Returns 0, 1 where an expert is not
 * resident (x_out untouched: Python pages the layer with these weights and ids), -1 for
 * arguments refused, -2 out of memory. */
int mox_moe_block_bf16(const moe_layer_t *L, const uint16_t *h, int64_t T,
                       const int32_t *slot_of, int64_t num_slots, pool_t p13, pool_t p2,
                       const gating_t *gating, float *weights, int32_t *ids,
                       const uint16_t *residual, uint16_t *x_out) {
    int64_t H = L->hidden, I = L->inter, E = L->experts, k = L->top_k, P = T * k;
    if (T < 1 || k < 1 || k > E || (L->scoring != SCORE_SOFTMAX_TOPK
                                    && L->scoring != SCORE_TOPK_SOFTMAX))
        return -1;
    /* one allocation: the pairs' sort keys, runs (slots, starts, counts), then float and
     * bf16 intermediates */
    size_t i64s = (size_t)(4 * P), f32s = (size_t)(E + P + P * 2 * I + P * H + T * H);
    size_t u16s = (size_t)(T * E + P * H + P * I);
    char *buf = malloc(8 * i64s + 4 * f32s + 2 * u16s);
    if (buf == NULL)
        return -2;
    int64_t *order = (int64_t *)buf, *slots = order + P, *starts = slots + P;
    int64_t *counts = starts + P;
    float *scores = (float *)(counts + P), *row_weights = scores + E;
    float *gate_up = row_weights + P, *down = gate_up + P * 2 * I, *sums = down + P * H;
    uint16_t *logits = (uint16_t *)(sums + T * H), *rows = logits + T * E, *act = rows + P * H;
    TIMELINE_START;
    int status = mox_gemv_bf16(h, H, L->router, H, logits, E, T, E, H, OUT_BF16, 1);
    if (status != 0)
        goto done;
    TIMELINE_MARK(PHASE_ROUTER);
    if (L->router_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = 0; e < E; e++)
                logits[t * E + e] = f32_to_bf16(bf16_to_f32(logits[t * E + e])
                                                + bf16_to_f32(L->router_bias[e]));
    for (int64_t t = 0; t < T; t++)
        route(logits + t * E, E, k, L->scoring, L->renormalize, L->scaling, scores,
              weights + t * k, ids + t * k);
    for (int64_t p = 0; p < P; p++) {
        int64_t s = slot_of[ids[p]];
        if (s < 0 || s >= num_slots) {
            status = 1;
            goto done;
        }
        order[p] = s << 32 | p;          /* sorted: by slot, then by pair (P < 2^32) */
    }
    qsort(order, (size_t)P, sizeof(int64_t), compare_keys);
    int64_t num_active = 0;
    for (int64_t r = 0; r < P; r++) {
        int64_t p = order[r] & 0xffffffff, s = order[r] >> 32;
        if (num_active == 0 || slots[num_active - 1] != s) {
            slots[num_active] = s;
            starts[num_active] = r;
            counts[num_active++] = 0;
        }
        counts[num_active - 1]++;
        row_weights[r] = weights[p];
        for (int64_t i = 0; i < H; i++)
            rows[r * H + i] = h[(p / k) * H + i];
    }
    TIMELINE_MARK(PHASE_ROUTE);
    status = mox_moe_experts(rows, p13, p2, gating, slots, starts, counts, num_active,
                             row_weights, H, I, gate_up, act, down, 1);
    if (status != 0)
        goto done;
    TIMELINE_MARK(PHASE_EXPERTS);
    for (int64_t i = 0; i < T * H; i++)
        sums[i] = 0.0f;
    for (int64_t r = 0; r < P; r++) {
        float *sum = sums + ((order[r] & 0xffffffff) / k) * H;
        for (int64_t i = 0; i < H; i++)
            sum[i] += down[r * H + i];
    }
    for (int64_t i = 0; i < T * H; i++) {
        uint16_t out = f32_to_bf16(sums[i]);
        x_out[i] = residual ? f32_to_bf16(bf16_to_f32(residual[i]) + bf16_to_f32(out)) : out;
    }
    TIMELINE_MARK(PHASE_COMBINE);
done:
    free(buf);
    return status;
}
