/* y = x W^T (+ bias) for a few rows of x, bf16 in and out, float32 accumulation, for CPUs with
 * AVX-512 BF16 dot products.
 *
 * A decode step multiplies one row per sequence by every weight of the model: the product is a
 * stream of the weights, and what it costs is how close that stream comes to the memory's rate.
 * The weight is stored blocked ([N/16][K/32][16][32]: 16 output rows by 32 inputs, one cache line
 * a row), so each thread reads its share of it front to back, one line after the next; 16 outputs
 * are accumulated side by side with one dot-product instruction per line and reduced together
 * at the end (three shuffle-adds per output instead of a horizontal sum each).
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build; on a CPU
 * without AVX-512 BF16 `lmf_bf16_gemv_supported` returns 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_common.h"

int lmf_bf16_gemv_supported(void) { return 1; }

/* x: [M, K] (row stride x_stride), blocked: [N/16][K/32][16][32], bias: [N] or NULL, y: [M, N]
 * (row stride y_stride); N % 16 == 0, K % 32 == 0 (checked by the caller). */
void lmf_bf16_gemv(const uint16_t *x, int64_t x_stride, const uint16_t *blocked, const uint16_t *bias, uint16_t *y,
                   int64_t y_stride, int m, int n, int k, int threads) {
    const int nb = n / 16, kb = k / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nb; b++) {
        const uint16_t *panel = blocked + (int64_t)b * kb * 512;
        const __m512 add = bias ? bf16x16_to_f32(bias + b * 16) : _mm512_setzero_ps();
        for (int r = 0; r < m; r++) {
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            const uint16_t *xr = x + r * x_stride;
            for (int c = 0; c < kb; c++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c * 32);
                const uint16_t *tile = panel + c * 512;
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(tile + j * 32));
            }
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(reduce16(acc), add));
            _mm256_storeu_si256((__m256i *)(y + r * y_stride + b * 16), (__m256i)out);
        }
    }
}
#else
int lmf_bf16_gemv_supported(void) { return 0; }

void lmf_bf16_gemv(const uint16_t *x, int64_t x_stride, const uint16_t *blocked, const uint16_t *bias, uint16_t *y,
                   int64_t y_stride, int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)blocked, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)threads;
}
#endif
