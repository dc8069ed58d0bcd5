/* How the MoE kernel (moe_experts.c) reads a layer's slot pools and what sits between an
 * expert's two GEMMs; moe_block.c hands them on. */
#ifndef MOX_MOE_POOLS_H
#define MOX_MOE_POOLS_H

#include <stdint.h>

/* A slot pool as the MoE kernel reads it: slot s's rows [N, K] at w + s * stride elements
 * (bytes for quantized pools); scales at scale + s * scale_stride, one per `block_rows` rows
 * of each part of `part_rows` (w13: gate's, then up's) and `group` inputs (0: the row). */
typedef struct {
    const void *w;
    int64_t stride;
    int kind;
    const float *scale;
    int64_t scale_stride;
    int64_t group;
    int64_t block_rows;
    int64_t part_rows;
} pool_t;

/* What sits between and after an expert's two GEMMs beyond SiLU: per-slot bf16 biases (added
 * before the activation and before the routing weight) and GPT-OSS's clamped SwiGLU, as
 * mox/kernels/activation.py defines it. NULL: SiLU, no biases. */
typedef struct {
    const uint16_t *b13;          /* [S, 2I] at b13 + s * b13_stride, or NULL */
    int64_t b13_stride;
    const uint16_t *b2;           /* [S, H], or NULL */
    int64_t b2_stride;
    int clamped;                  /* 1: clamped SwiGLU (alpha, limit); 0: SiLU */
    float alpha, limit;
} gating_t;

#endif
