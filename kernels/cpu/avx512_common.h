/* AVX-512 helpers shared by the CPU kernels (included where __AVX512F__ is defined). */
#ifndef LMF_AVX512_COMMON_H
#define LMF_AVX512_COMMON_H
#include <immintrin.h>
#include <stdint.h>

/* Sixteen vectors of partial sums -> one vector of their sixteen totals (lane j: sum of v[j]):
 * three rounds of pairwise unpack-and-add, then two across 128-bit lanes; about three operations
 * per total instead of a horizontal reduction each. */
static inline __m512 reduce16(__m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

static inline __m512 bf16x16_to_f32(const void *p) { /* 16 bf16 -> float32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#endif
