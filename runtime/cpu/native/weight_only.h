/* Helpers shared by the weight-only C products (int4_gemm.c, int8_gemm.c); included where
 * __AVX512F__ and __AVX512BF16__ are defined. */
#ifndef LMF_WEIGHT_ONLY_H
#define LMF_WEIGHT_ONLY_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* out[i * (k / group) + g] = sum of row i's inputs of group g, in fp32 and in k order: the term an
 * asymmetric code's zero multiplies (group = k for one zero per channel). */
static void row_group_sums(const uint16_t *x, int64_t x_stride, int m, int k, int group, float *out, int threads) {
    const int groups = k / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int i = 0; i < m; i++)
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int c = g * group; c < (g + 1) * group; c++) {
                const uint32_t bits = (uint32_t)x[i * x_stride + c] << 16;
                float v;
                memcpy(&v, &bits, 4);
                s += v;
            }
            out[i * groups + g] = s;
        }
}

/* The bias of tile b's 16 channels as float32 (zeros without a bias). */
static inline __m512 bias16(const uint16_t *bias, int b) {
    if (!bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + b * 16))), 16));
}

/* This thread's contiguous share [b0, b1) of nb tiles (inside a parallel region). */
static inline void tile_share(int nb, int *b0, int *b1) {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    *b0 = (int)((int64_t)nb * t / nt);
    *b1 = (int)((int64_t)nb * (t + 1) / nt);
}

#endif
