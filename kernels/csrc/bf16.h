/* bf16 <-> float32 for the kernels' scalar paths, and the CPU check of their fast paths. */
#ifndef MOX_BF16_H
#define MOX_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {    /* round to nearest even, as torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40);   /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The vector path a kernel called with `fast` takes on this CPU (in bf16_gemv.c): AVX512-BF16
 * dot products, else AVX2 + FMA over weights widened to float32 in registers, else none. */
enum { ISA_PLAIN, ISA_AVX2, ISA_AVX512BF16 };
int mox_vector_isa(void);
int mox_has_avx512bf16(void);
int mox_has_amx(void);      /* AMX-BF16, granted to this process by Linux (amx_tiles.h) */

#endif
