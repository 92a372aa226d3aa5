/* y = x W^T (+ bias) with W held as 4-bit codes, bf16 activations in and out, float32 accumulation,
 * for CPUs with AVX-512 BF16 dot products: the serving product of W4A16 checkpoints.
 *
 * PyTorch's int4pack kernel costs one pass over the weight per input row, so a step of 16 rows
 * reads and decodes the layer 16 times, and a dequantized dense copy costs the memory a 4-bit
 * checkpoint exists to save. Here the codes of 16 output channels are decoded once into bf16 and
 * used by up to ROWS input rows before the next ones are read:
 *
 * - Layout (`lmfoundry.runtime.cpu.native.int4_gemm.pack`): codes [N/16][K/2][16] bytes, byte j of pair p
 *   holding channel 16 b + j's unsigned codes for inputs 2p (low nibble) and 2p + 1 (high); a
 *   vector of 16 dwords is then one input pair of all 16 channels, which is what one bf16 dot
 *   product takes. Scales (and zeros, for asymmetric codes) are float32 [N/16][K/g][16].
 * - Decode: zero-extend 16 bytes to dwords, put the high nibble into the upper word (shift and one
 *   ternary logic op), and look the 32 nibbles up in a table of bf16 (code - 8): four instructions
 *   for 32 weights, then one dot product per row. Codes are small integers, exact in bf16.
 * - Arithmetic: per row and group, sum_k x_k (u_k - 8) in float32 (each product exact), then
 *   times the group's scale, plus zero * sum_k x_k for asymmetric codes; groups accumulate in k
 *   order. A row's result does not depend on how many rows share the call (the rows of a block
 *   never mix), so a token computes the same in a prompt chunk and alone in a decode step.
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build; on a CPU without
 * AVX-512 BF16 `lmf_int4_gemm_supported` returns 0 and the caller keeps PyTorch's kernel.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "weight_only.h"

#define ROWS 8   /* rows sharing one decode of the codes; 2 x ROWS accumulators live in registers */
#define CHUNK 64 /* rows of x a thread keeps in cache while it walks its tiles */

int lmf_int4_gemm_supported(void) { return 1; }

static inline __m512i code_table(void) { /* bf16 of (u - 8) at index u, u = 0..15 */
    uint16_t t[32];
    for (int u = 0; u < 32; u++) {
        const float v = (float)((u & 15) - 8);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        t[u] = (uint16_t)(bits >> 16); /* exact: small integers */
    }
    return _mm512_loadu_si512(t);
}

/* One tile of 16 output channels for `r` rows (1..ROWS, a constant after inlining). */
static inline __attribute__((always_inline)) void tile_rows(
    const uint16_t *x, int64_t x_stride, const uint8_t *codes, const float *scale, const float *zero,
    const float *xsum, int groups, int pairs_per_group, const __m512 add, uint16_t *y, int64_t y_stride,
    const int r, const __m512i table) {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    __m512 acc[ROWS];
    for (int i = 0; i < r; i++) acc[i] = add;
    for (int g = 0; g < groups; g++) {
        __m512 part[ROWS];
        for (int i = 0; i < r; i++) part[i] = _mm512_setzero_ps();
        const int p0 = g * pairs_per_group;
        for (int p = p0; p < p0 + pairs_per_group; p++) {
            const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (int64_t)p * 16)));
            const __m512i w16 = _mm512_ternarylogic_epi32(z, _mm512_slli_epi32(z, 12), nibbles, 0xA8);
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(w16, table);
            for (int i = 0; i < r; i++) {
                int32_t pair;
                memcpy(&pair, x + i * x_stride + 2 * p, 4);
                part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)_mm512_set1_epi32(pair), w);
            }
        }
        const __m512 s = _mm512_loadu_ps(scale + g * 16);
        for (int i = 0; i < r; i++) acc[i] = _mm512_fmadd_ps(part[i], s, acc[i]);
        if (zero) {
            const __m512 zz = _mm512_loadu_ps(zero + g * 16);
            for (int i = 0; i < r; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[i * groups + g]), zz, acc[i]);
        }
    }
    for (int i = 0; i < r; i++)
        _mm256_storeu_si256((__m256i *)(y + i * y_stride), (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

/* x: [M, K] bf16 (row stride x_stride), codes [N/16][K/2][16], scale/zero [N/16][K/g][16] float32
 * (zero NULL for symmetric codes), bias [N] bf16 or NULL, y: [M, N] bf16 (row stride y_stride),
 * xsum: a float32 workspace of M * K/g (used with zero). N % 16 == 0, K % g == 0, g % 2 == 0. */
void lmf_int4_gemm(const uint16_t *x, int64_t x_stride, const uint8_t *codes, const float *scale, const float *zero,
                   const uint16_t *bias, uint16_t *y, int64_t y_stride, float *xsum, int m, int n, int k, int group,
                   int threads) {
    const int nb = n / 16, groups = k / group, ppg = group / 2;
    const __m512i table = code_table();
    if (zero) row_group_sums(x, x_stride, m, k, group, xsum, threads);
    /* Each thread takes a contiguous share of the tiles and walks them chunk of rows by chunk of
     * rows: a chunk of x (CHUNK rows) stays in L2 while every tile of the share passes over it, and
     * a tile's codes stay in L1 across the chunk's row blocks. */
#pragma omp parallel num_threads(threads)
    {
        int b0, b1;
        tile_share(nb, &b0, &b1);
        for (int c0 = 0; c0 < m; c0 += CHUNK) {
            const int c1 = m - c0 < CHUNK ? m : c0 + CHUNK;
            for (int b = b0; b < b1; b++) {
                const uint8_t *tile = codes + (int64_t)b * (k / 2) * 16;
                const float *ts = scale + (int64_t)b * groups * 16, *tz = zero ? zero + (int64_t)b * groups * 16 : NULL;
                const __m512 add = bias16(bias, b);
                for (int r0 = c0; r0 < c1; r0 += ROWS) {
                    const int r = c1 - r0 < ROWS ? c1 - r0 : ROWS;
                    const uint16_t *xr = x + (int64_t)r0 * x_stride;
                    uint16_t *yr = y + (int64_t)r0 * y_stride + b * 16;
                    const float *xs = zero ? xsum + (int64_t)r0 * groups : NULL;
                    switch (r) { /* a constant row count per call: the accumulators stay in registers */
                    case 8: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 8, table); break;
                    case 7: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 7, table); break;
                    case 6: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 6, table); break;
                    case 5: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 5, table); break;
                    case 4: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 4, table); break;
                    case 3: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 3, table); break;
                    case 2: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 2, table); break;
                    default: tile_rows(xr, x_stride, tile, ts, tz, xs, groups, ppg, add, yr, y_stride, 1, table); break;
                    }
                }
            }
        }
    }
}

/* w [N, K] bf16 = (u - 8) * scale + zero from the same layout: the dense weight of a step too long for
 * the product above, where the CPU's own GEMM (oneDNN on AMX tiles) computes more rows a second. */
void lmf_int4_dequant(const uint8_t *codes, const float *scale, const float *zero, uint16_t *w, int n, int k,
                      int group, int threads) {
    const int nb = n / 16, groups = k / group, ppg = group / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < nb; b++) {
        const uint8_t *tile = codes + (int64_t)b * (k / 2) * 16;
        for (int g = 0; g < groups; g++) {
            const __m512 s = _mm512_loadu_ps(scale + ((int64_t)b * groups + g) * 16);
            const __m512 z = zero ? _mm512_loadu_ps(zero + ((int64_t)b * groups + g) * 16) : _mm512_setzero_ps();
            for (int p = g * ppg; p < (g + 1) * ppg; p++) {
                const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + (int64_t)p * 16)));
                const __m512 lo = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(c, _mm512_set1_epi32(15)),
                                                        _mm512_set1_epi32(8))), s, z);
                const __m512 hi = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(c, 4), _mm512_set1_epi32(8))), s, z);
                uint16_t l[16], h[16];
                _mm256_storeu_si256((__m256i *)l, (__m256i)_mm512_cvtneps_pbh(lo));
                _mm256_storeu_si256((__m256i *)h, (__m256i)_mm512_cvtneps_pbh(hi));
                for (int j = 0; j < 16; j++) {
                    uint16_t *row = w + (int64_t)(b * 16 + j) * k + 2 * p;
                    row[0] = l[j];
                    row[1] = h[j];
                }
            }
        }
    }
}
#else
int lmf_int4_gemm_supported(void) { return 0; }

void lmf_int4_dequant(const uint8_t *codes, const float *scale, const float *zero, uint16_t *w, int n, int k,
                      int group, int threads) {
    (void)codes, (void)scale, (void)zero, (void)w, (void)n, (void)k, (void)group, (void)threads;
}

void lmf_int4_gemm(const uint16_t *x, int64_t x_stride, const uint8_t *codes, const float *scale, const float *zero,
                   const uint16_t *bias, uint16_t *y, int64_t y_stride, float *xsum, int m, int n, int k, int group,
                   int threads) {
    (void)x, (void)x_stride, (void)codes, (void)scale, (void)zero, (void)bias, (void)y, (void)y_stride, (void)xsum,
        (void)m, (void)n, (void)k, (void)group, (void)threads;
}
#endif
