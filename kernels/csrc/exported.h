/* The library's entry points that other C files call (attention_block.c runs a layer's
 * steps through them, moe_block.c its experts, bench/micro/moe_stream.c times them); their
 * definitions include this, so the compiler checks each against its declaration. */
#ifndef MOX_EXPORTED_H
#define MOX_EXPORTED_H

#include <stdint.h>

#include "moe_pools.h"

/* mox_gemv_bf16's outputs */
enum { OUT_F32, OUT_BF16, OUT_BF16_AS_F32 };

int mox_gemv_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *y,
                  int64_t ldy, int64_t M, int64_t N, int64_t K, int out, int fast);
int mox_rms_norm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *weight, uint16_t *out,
                      int64_t ldo, int64_t rows, int64_t dim, float eps);
int mox_rope_kv_bf16(uint16_t *q, int64_t ldq, uint16_t *k, int64_t ldk, const uint16_t *v,
                     int64_t ldv, const float *cos, const float *sin, int64_t ldc, int64_t T,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_dim,
                     int64_t rot, int interleaved, uint16_t *keys, uint16_t *values,
                     const int64_t *slots, int64_t store_rows);
int mox_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *keys,
                              const uint16_t *keys2, const uint16_t *values, int64_t k_stride,
                              int64_t k2_stride, int64_t v_stride, const int64_t *slots,
                              const int64_t *starts, const int64_t *lengths,
                              int64_t num_tokens, int64_t h, int64_t h_kv, int64_t d,
                              int64_t d2, int64_t dv, float scale, int64_t window, float *out,
                              int fast);
int mox_moe_experts_bf16(const uint16_t *rows, const uint16_t *w13, int64_t s13,
                         const uint16_t *w2, int64_t s2, const gating_t *gating,
                         const int64_t *slots, const int64_t *starts, const int64_t *counts,
                         int64_t num_active, const float *row_weights, int64_t H, int64_t I,
                         float *gate_up, uint16_t *act, float *down, int fast);
int mox_moe_experts(const uint16_t *rows, pool_t p13, pool_t p2, const gating_t *gating,
                    const int64_t *slots, const int64_t *starts, const int64_t *counts,
                    int64_t num_active, const float *row_weights, int64_t H, int64_t I,
                    float *gate_up, uint16_t *act, float *down, int fast);

#endif
