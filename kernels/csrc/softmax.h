/* The softmax that decode attention's plain path and the MoE routing (moe_block.c) share. */
#ifndef MOX_SOFTMAX_H
#define MOX_SOFTMAX_H

#include <math.h>
#include <stdint.h>

/* p [n] = exp(p - max p) / their sum, in place */
static inline void softmax_plain(float *p, int64_t n) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < n; j++)
        top = p[j] > top ? p[j] : top;
    for (int64_t j = 0; j < n; j++)
        total += (p[j] = expf(p[j] - top));
    for (int64_t j = 0; j < n; j++)
        p[j] /= total;
}

#endif
