/* exp of 8 (AVX2) or 16 (AVX-512) floats at once: Cephes' single precision polynomial, the
 * argument clamped to float's range. glibc's scalar expf is a call per value: it dominated
 * decode attention's softmax over long contexts (decode_attention.c) and the experts' SiLU
 * (moe_experts.c). */
#ifndef MOX_VEXP_H
#define MOX_VEXP_H

#include <immintrin.h>

#define VEXP_POLY {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, \
                   1.6666665459e-1f, 5.0000001201e-1f}
/* Arguments above 89 are taken as 89, whose exp overflows to inf as expf's does from 88.72 on
 * (2^n applied in two halves, so n = 128 does not wrap the exponent field); below -87.34 as
 * -87.34 (1.2e-38, where expf is subnormal or 0); NaN stays NaN (min and max return their
 * second operand where one is NaN). Within 1 ulp of expf from -87.34 to 88.72. */
#define DEFINE_VEXP(name, attributes, vec, ivec, set1, iset1, fma, mul, add, sub, maxf, minf, \
                    floorf_, cvt, shift, addi, subi, srai, cast)                               \
    attributes static inline vec name(vec x) {                                                 \
        static const float poly[] = VEXP_POLY;                                                 \
        x = maxf(set1(-87.3365447504019f), minf(set1(89.0f), x));                              \
        vec n = floorf_(fma(x, set1(1.44269504088896341f), set1(0.5f)));                      \
        x = sub(x, mul(n, set1(0.693359375f)));                                                \
        x = sub(x, mul(n, set1(-2.12194440e-4f)));                                             \
        vec y = set1(poly[0]);                                                                 \
        for (int i = 1; i < 6; i++)                                                            \
            y = fma(y, x, set1(poly[i]));                                                      \
        y = add(fma(y, mul(x, x), x), set1(1.0f));                                             \
        ivec half = srai(cvt(n), 1), rest = subi(cvt(n), half);                                \
        y = mul(y, cast(shift(addi(half, iset1(127)), 23)));                                   \
        return mul(y, cast(shift(addi(rest, iset1(127)), 23)));                                \
    }

__attribute__((target("avx512f")))
static inline __m512 floor16(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

DEFINE_VEXP(exp8_avx2, __attribute__((target("avx2,fma"))), __m256, __m256i, _mm256_set1_ps,
            _mm256_set1_epi32, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_sub_ps,
            _mm256_max_ps, _mm256_min_ps, _mm256_floor_ps, _mm256_cvtps_epi32, _mm256_slli_epi32,
            _mm256_add_epi32, _mm256_sub_epi32, _mm256_srai_epi32, _mm256_castsi256_ps)
DEFINE_VEXP(exp16_avx512, __attribute__((target("avx512f"))), __m512, __m512i, _mm512_set1_ps,
            _mm512_set1_epi32, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_sub_ps,
            _mm512_max_ps, _mm512_min_ps, floor16, _mm512_cvtps_epi32, _mm512_slli_epi32,
            _mm512_add_epi32, _mm512_sub_epi32, _mm512_srai_epi32, _mm512_castsi512_ps)

#endif
