/* A decoder layer's two halves as the native blocks take them (attention_block.c, moe_block.c)
 * and the blocks themselves, so decode_layers.c can chain them. Python builds the structs once
 * per layer (mox/kernels/native_attention.py's AttentionLayer, native_moe.py's MoELayer). */
#ifndef MOX_LAYERS_H
#define MOX_LAYERS_H

#include <stdint.h>

#include "moe_pools.h"

enum { QK_NORM_NONE, QK_NORM_FULL, QK_NORM_PER_HEAD };

/* One layer's attention weights and shapes: fixed for the model's life. */
typedef struct {
    const uint16_t *input_norm, *post_norm;     /* [H] */
    const uint16_t *qkv, *qkv_bias;             /* [(h + 2 h_kv) d, H]; [(h + 2 h_kv) d] or NULL */
    const uint16_t *q_norm, *k_norm;            /* [h d] and [h_kv d] (full), [d] (per head) */
    const uint16_t *o, *o_bias;                 /* [H, h d]; [H] or NULL */
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, window;   /* window 0: none */
    int qk_norm, interleaved;
    float eps, scale;
} attention_layer_t;

/* softmax over every expert then the top k (Mixtral, Qwen, OLMoE), or the top k logits then
 * their softmax (GPT-OSS) */
enum { SCORE_SOFTMAX_TOPK, SCORE_TOPK_SOFTMAX };

/* One MoE layer's router and shapes. */
typedef struct {
    const uint16_t *router, *router_bias;       /* [E, H]; [E] or NULL */
    int64_t hidden, inter, experts, top_k;
    int scoring, renormalize;
    float scaling;                              /* routed_scaling_factor */
} moe_layer_t;

int mox_attention_block_bf16(const attention_layer_t *L, const uint16_t *x, int64_t T,
                             const float *cos, const float *sin, int64_t ldc, uint16_t *keys,
                             uint16_t *values, int64_t store_rows, const int64_t *slot_mapping,
                             const int64_t *kv_slots, int64_t num_keys, const int64_t *starts,
                             const int64_t *lengths, uint16_t *x_out, uint16_t *h_out);
int mox_moe_block_bf16(const moe_layer_t *L, const uint16_t *h, int64_t T,
                       const int32_t *slot_of, int64_t num_slots, pool_t p13, pool_t p2,
                       const gating_t *gating, float *weights, int32_t *ids,
                       const uint16_t *residual, uint16_t *x_out);

#endif
