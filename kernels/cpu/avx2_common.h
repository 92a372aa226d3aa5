/* AVX2 helpers shared by the CPU kernels (included where __AVX2__ and __FMA__ are defined). */
#ifndef LMF_AVX2_COMMON_H
#define LMF_AVX2_COMMON_H
#include <immintrin.h>
#include <stdint.h>

static inline __m256 bf16x8_to_f32(const void *p) { /* 8 bf16 -> float32, exactly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Eight vectors of partial sums -> one vector of their eight totals (lane j: sum of v[j]): two
 * rounds of horizontal pair-adds and one across the 128-bit halves. */
static inline __m256 reduce8(const __m256 v[8]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#endif
