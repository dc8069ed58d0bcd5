/* A decode step's decoder layers for CPU decode, in one call: each layer's attention half
 * (attention_block.c) then its MoE half (moe_block.c), the residual stream handed from one to
 * the next here rather than through the interpreter, which cost ~0.25 ms a layer at batch 1
 * between and around the two blocks (a fifth of the step). The same calls on the same
 * buffers as the per-layer path (mox/models/decoder.py): identical bits.
 *
 * A layer whose tokens route to an expert that is not resident ends the call after its
 * routing; Python pages that layer's experts in waves, as for any layer, and calls again from
 * the next one. A call that runs the last layer also runs the model's tail where it is handed
 * one (the final norm and the lm_head, into float32 logits): at batch 1 the interpreter's
 * calls for those two cost ~0.2 ms of a ~10 ms step, their data evicted by the layers' reads.
 */
#include <stdint.h>
#include <string.h>

#include "exported.h"
#include "layers.h"
#include "timeline.h"

#ifdef MOX_TIMELINE
uint64_t mox_timeline[NUM_PHASES];
#endif

/* (built with MOX_TIMELINE) each phase's cycles since the last take into out [n], then 0;
 * returns the number of phases, or -1 in a build without the timeline */
int mox_timeline_take(uint64_t *out, int n) {
#ifdef MOX_TIMELINE
    for (int i = 0; i < n && i < NUM_PHASES; i++) {
        out[i] = mox_timeline[i];
        mox_timeline[i] = 0;
    }
    return NUM_PHASES;
#else
    (void)out;
    (void)n;
    return -1;
#endif
}

/* (built with MOX_TIMELINE) the TSC now, for Python to convert cycles to seconds; else 0 */
uint64_t mox_timeline_now(void) {
#ifdef MOX_TIMELINE
    return __rdtsc();
#else
    return 0;
#endif
}

/* The model's tail: the final norm [H] and the lm_head [V, H], bf16 (native_step.py's
 * StepTailStruct). */
typedef struct {
    const uint16_t *norm, *lm_head;
    int64_t vocab;
    float eps;
} step_tail_t;

/* One layer as the chain reads it (mox/kernels/native_step.py's StepLayerStruct): its halves'
 * structs, its KV store rows and its row of the pager's live residency table. */
typedef struct {
    const attention_layer_t *attention;
    const moe_layer_t *moe;
    uint16_t *keys, *values;                    /* [store_rows, h_kv, d] */
    const int32_t *slot_of;                     /* [E] */
} step_layer_t;

/* Layers [first, num_layers) on the stream x [T, H] bf16, in place. The attention arguments
 * (cos ... lengths) as mox_attention_block_bf16 takes them, the same for every layer; the
 * pools and gating as mox_moe_block_bf16 takes them (one pool for the model's layers).
 * weights [num_layers, T, k] f32 and ids [num_layers, T, k] int32 (k: every layer's top_k):
 * each layer's routing, for the layers reached. residual [T, H]: scratch. `tail` (or NULL):
 * once the last layer has run, logits [T, V] = lm_head . rms_norm(x), the products rounded
 * to bf16 as the per-layer path's bf16 linear rounds them (h holds the normed rows). Returns
 * num_layers when every layer ran, or the index of the layer that found an expert missing,
 * with x its stream after attention (the MoE half's residual) and h [T, H] its normed rows;
 * -1 for arguments refused, -2 out of memory, -3 the tail refused or out of memory (every
 * layer has run). After an error at a layer past `first`, the layers before it have run
 * (their keys and values stored, x their output): the step is lost. */
int64_t mox_decode_layers_bf16(const step_layer_t *layers, int64_t first, int64_t num_layers,
                               uint16_t *x, uint16_t *h, int64_t T, const float *cos,
                               const float *sin, int64_t ldc, int64_t store_rows,
                               const int64_t *slot_mapping, const int64_t *kv_slots,
                               int64_t num_keys, const int64_t *starts, const int64_t *lengths,
                               int64_t num_slots, pool_t p13, pool_t p2,
                               const gating_t *gating, float *weights, int32_t *ids,
                               uint16_t *residual, const step_tail_t *tail, float *logits) {
    if (first < 0 || first > num_layers || T < 1)
        return -1;
    TIMELINE_COUNT(PHASE_CALLS);
    for (int64_t i = first; i < num_layers; i++) {
        const step_layer_t *l = layers + i;
        int64_t routed = T * l->moe->top_k, H = l->attention->hidden;
        if (l->moe->hidden != H || l->moe->top_k != layers[0].moe->top_k)
            return -1;                           /* (weights and ids are [L, T, k]) */
        int status = mox_attention_block_bf16(l->attention, x, T, cos, sin, ldc, l->keys,
                                              l->values, store_rows, slot_mapping, kv_slots,
                                              num_keys, starts, lengths, residual, h);
        if (status == 0)
            status = mox_moe_block_bf16(l->moe, h, T, l->slot_of, num_slots, p13, p2, gating,
                                        weights + i * routed, ids + i * routed, residual, x);
        if (status == 1) {                       /* a miss: Python pages this layer */
            memcpy(x, residual, sizeof(uint16_t) * (size_t)(T * H));
            return i;
        }
        if (status != 0)
            return status;
    }
    if (tail) {
        TIMELINE_START;
        int64_t H = layers[0].attention->hidden;
        int status = mox_rms_norm_bf16(x, H, tail->norm, h, H, T, H, tail->eps);
        if (status == 0)
            status = mox_gemv_bf16(h, H, tail->lm_head, H, logits, tail->vocab, T,
                                   tail->vocab, H, OUT_BF16_AS_F32, 1);
        TIMELINE_MARK(PHASE_TAIL);
        if (status != 0)
            return -3;
    }
    return num_layers;
}
