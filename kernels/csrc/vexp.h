/* exp of 8 (AVX2) or 16 (AVX-512) floats at once: Cephes' single precision polynomial, the
 * argument clamped to float's range. glibc's scalar expf is a call per value: it dominated
 * decode attention's softmax over long contexts (decode_attention.c) and the experts' SiLU
 * (moe_experts.c). */
#ifndef MOX_VEXP_H
#define MOX_VEXP_H

#include <immintrin.h>

#define VEXP_POLY {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, \
                   1.6666665459e-1f, 5.0000001201e-1f}
#define DEFINE_VEXP(name, attributes, vec, ivec, set1, iset1, fma, mul, add, sub, maxf, minf, \
                    floorf_, cvt, shift, addi, cast)                                           \
    attributes static inline vec name(vec x) {                                                 \
        static const float poly[] = VEXP_POLY;                                                 \
        x = maxf(minf(x, set1(88.3762626647949f)), set1(-87.3365447504019f));                  \
        vec n = floorf_(fma(x, set1(1.44269504088896341f), set1(0.5f)));                      \
        x = sub(x, mul(n, set1(0.693359375f)));                                                \
        x = sub(x, mul(n, set1(-2.12194440e-4f)));                                             \
        vec y = set1(poly[0]);                                                                 \
        for (int i = 1; i < 6; i++)                                                            \
            y = fma(y, x, set1(poly[i]));                                                      \
        y = add(fma(y, mul(x, x), x), set1(1.0f));                                             \
        ivec e = shift(addi(cvt(n), iset1(127)), 23);                                          \
        return mul(y, cast(e));                                                                \
    }

__attribute__((target("avx512f")))
static inline __m512 floor16(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

DEFINE_VEXP(exp8_avx2, __attribute__((target("avx2,fma"))), __m256, __m256i, _mm256_set1_ps,
            _mm256_set1_epi32, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_sub_ps,
            _mm256_max_ps, _mm256_min_ps, _mm256_floor_ps, _mm256_cvtps_epi32, _mm256_slli_epi32,
            _mm256_add_epi32, _mm256_castsi256_ps)
DEFINE_VEXP(exp16_avx512, __attribute__((target("avx512f"))), __m512, __m512i, _mm512_set1_ps,
            _mm512_set1_epi32, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_sub_ps,
            _mm512_max_ps, _mm512_min_ps, floor16, _mm512_cvtps_epi32, _mm512_slli_epi32,
            _mm512_add_epi32, _mm512_castsi512_ps)

#endif
