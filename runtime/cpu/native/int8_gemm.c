/* y = x W^T (+ bias) with W held as int8 codes and one scale per output channel (W8A16), bf16
 * activations in and out, float32 accumulation, for CPUs with AVX-512 BF16 dot products.
 *
 * PyTorch's int8pack kernel, like its int4 one, reads the weight once per input row. Here, as in
 * int4_gemm.c, the codes of 16 output channels are widened to bf16 once per block of up to ROWS
 * input rows:
 *
 * - Layout (`lmfoundry.runtime.cpu.native.int8_gemm.pack`): codes [N/16][K/2][32] bytes, the 32 bytes of
 *   pair p being channel j's codes for inputs 2p and 2p + 1, j = 0..15; scales (and zero x scale,
 *   for asymmetric codes) float32 [N/16][16].
 * - Widen: sign-extend each half to 16 dwords, convert to float32 (exact), and pack both into 32
 *   bf16 (exact: |code| <= 128 needs 8 significant bits): five instructions for 32 weights, then
 *   one dot product per row; the channel's scale multiplies the whole sum once.
 * - Each row computes the same whatever the number of rows in the call.
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build; on a CPU without
 * AVX-512 BF16 `lmf_int8_gemm_supported` returns 0 and the caller keeps PyTorch's kernel.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "weight_only.h"

#define ROWS 8   /* rows sharing one widening of the codes */
#define CHUNK 64 /* rows of x a thread keeps in cache while it walks its tiles */

int lmf_int8_gemm_supported(void) { return 1; }

static inline __attribute__((always_inline)) void tile_rows(const uint16_t *x, int64_t x_stride,
                                                            const int8_t *codes, const float *scale,
                                                            const float *zero_scaled, const float *xsum, int pairs,
                                                            const __m512 add, uint16_t *y, int64_t y_stride,
                                                            const int r) {
    __m512 acc[ROWS];
    for (int i = 0; i < r; i++) acc[i] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const int8_t *c = codes + (int64_t)p * 32;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
        const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo); /* words 0..15 from lo, 16..31 from hi */
        for (int i = 0; i < r; i++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * p, 4);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    const __m512 s = _mm512_loadu_ps(scale);
    for (int i = 0; i < r; i++) {
        __m512 v = _mm512_fmadd_ps(acc[i], s, add);
        if (zero_scaled) v = _mm512_fnmadd_ps(_mm512_set1_ps(xsum[i]), _mm512_loadu_ps(zero_scaled), v);
        _mm256_storeu_si256((__m256i *)(y + i * y_stride), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* x: [M, K] bf16 (row stride x_stride), codes [N/16][K/2][32], scale and zero_scaled [N/16][16]
 * float32 (zero_scaled NULL for symmetric codes: w = code * scale - zero_scaled), bias [N] bf16 or
 * NULL, y: [M, N] bf16, xsum: a float32 workspace of M (used with zero_scaled). N % 16 == 0, K % 2 == 0. */
void lmf_int8_gemm(const uint16_t *x, int64_t x_stride, const int8_t *codes, const float *scale,
                   const float *zero_scaled, const uint16_t *bias, uint16_t *y, int64_t y_stride, float *xsum, int m,
                   int n, int k, int threads) {
    const int nb = n / 16, pairs = k / 2;
    if (zero_scaled) row_group_sums(x, x_stride, m, k, k, xsum, threads);
#pragma omp parallel num_threads(threads)
    {
        int b0, b1;
        tile_share(nb, &b0, &b1);
        for (int c0 = 0; c0 < m; c0 += CHUNK) {
            const int c1 = m - c0 < CHUNK ? m : c0 + CHUNK;
            for (int b = b0; b < b1; b++) {
                const int8_t *tile = codes + (int64_t)b * pairs * 32;
                const float *ts = scale + b * 16, *tz = zero_scaled ? zero_scaled + b * 16 : NULL;
                const __m512 add = bias16(bias, b);
                for (int r0 = c0; r0 < c1; r0 += ROWS) {
                    const int r = c1 - r0 < ROWS ? c1 - r0 : ROWS;
                    const uint16_t *xr = x + (int64_t)r0 * x_stride;
                    uint16_t *yr = y + (int64_t)r0 * y_stride + b * 16;
                    const float *xs = zero_scaled ? xsum + r0 : NULL;
                    switch (r) { /* a constant row count per call: the accumulators stay in registers */
                    case 8: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 8); break;
                    case 7: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 7); break;
                    case 6: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 6); break;
                    case 5: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 5); break;
                    case 4: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 4); break;
                    case 3: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 3); break;
                    case 2: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 2); break;
                    default: tile_rows(xr, x_stride, tile, ts, tz, xs, pairs, add, yr, y_stride, 1); break;
                    }
                }
            }
        }
    }
}
#else
int lmf_int8_gemm_supported(void) { return 0; }

void lmf_int8_gemm(const uint16_t *x, int64_t x_stride, const int8_t *codes, const float *scale,
                   const float *zero_scaled, const uint16_t *bias, uint16_t *y, int64_t y_stride, float *xsum, int m,
                   int n, int k, int threads) {
    (void)x, (void)x_stride, (void)codes, (void)scale, (void)zero_scaled, (void)bias, (void)y, (void)y_stride,
        (void)xsum, (void)m, (void)n, (void)k, (void)threads;
}
#endif
