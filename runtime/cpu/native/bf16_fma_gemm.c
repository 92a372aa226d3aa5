/* y = x W^T (+ bias) for tens of rows of x, bf16 in and out, float32 arithmetic, for CPUs with
 * AVX2 and FMA but no bf16 instructions (AVX2-only x86 servers and VMs).
 *
 * Where the CPU has no bf16 arithmetic, oneDNN emulates its bf16 GEMM and runs it several times
 * slower than its float32 one; yet a bf16 weight is still half the bytes to stream, and widening
 * a bf16 value to float32 is exact (a 16-bit shift). So the weight stays bf16 and is widened in
 * registers; every product and sum is float32 (fused multiply-add), and the output is rounded to
 * bf16 once, after the bias: the arithmetic of a bf16 GEMM with float32 accumulation.
 * `lmf_f32_fma_gemm` is the same product on float32 weights, inputs and outputs: because every
 * output is one FMA chain in k order whatever the number of rows, it is the float32 linear of the
 * engine's deterministic (batch-invariant) mode, on any CPU with AVX2 and FMA.
 *
 * Layout: the weight is stored as panels of 16 output channels, [N/16][K][16] (the last one
 * padded with zero channels where N is not a multiple of 16), so each input k
 * reads one 32-byte line of 16 weights: two float32 vectors of 8 outputs. Up to six input rows
 * share each weight load (their value of x[r][k] is broadcast), so a decode batch streams the
 * weight once per panel from memory and re-reads it from cache for the next six rows: the
 * product is bound by the memory at a few rows and by the FMA units at tens of rows. Threads take
 * panels in shrinking runs (a guided schedule): long contiguous runs first, so a few-row product
 * streams the weight front to back as a static split would, then single panels, so that a thread
 * woken late by the OpenMP pool, or sharing its core, leaves its panels to the others instead of
 * holding the whole product at the barrier (one panel at a time from the start cost a one-row
 * product a third more time: the threads' reads interleaved across the weight).
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build; without AVX2
 * and FMA `lmf_bf16_fma_gemm_supported` returns 0 and the caller keeps PyTorch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_common.h"

int lmf_bf16_fma_gemm_supported(void) { return 1; }

#define ROW_BLOCK_BYTES (256 * 1024)

/* the first `valid` (<= 16) of a panel's outputs, bias added, rounded to bf16 (or kept in float32) */
static inline void store_panel(const float acc_lo[8], const float acc_hi[8], const float *add, int valid, void *y,
                               const int f32) {
    float v[16];
    for (int j = 0; j < 8; j++) v[j] = acc_lo[j] + add[j], v[8 + j] = acc_hi[j] + add[8 + j];
    if (f32)
        memcpy(y, v, sizeof(float) * (size_t)valid);
    else
        for (int j = 0; j < valid; j++) ((uint16_t *)y)[j] = f32_to_bf16(v[j]);
}

/* R (1..6) rows of float32 x against one panel [K][16] (bf16 weights widened in registers, or
 * float32 weights with f32): y[r][0..15], rounded to bf16 (kept in float32 with f32). Every output
 * is one FMA chain over k in order, whatever R and wherever the row sits in its group: a token's
 * product is bit for bit the same in a prompt chunk and alone in a decode step, so a prefix-cached
 * request computes what the cold one did (greedy text included). One row still outruns the memory
 * with two chains per panel; from three rows the rows' chains hide the FMA latency. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_stride, const void *panel,
                                                             int k, const int R, const float *add, int valid,
                                                             void *y, int64_t y_stride, const int f32) {
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int c = 0; c < k; c++) {
        const __m256 w0 = f32 ? _mm256_loadu_ps((const float *)panel + c * 16)
                              : bf16x8_to_f32((const uint16_t *)panel + c * 16);
        const __m256 w1 = f32 ? _mm256_loadu_ps((const float *)panel + c * 16 + 8)
                              : bf16x8_to_f32((const uint16_t *)panel + c * 16 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xa = _mm256_broadcast_ss(x + r * x_stride + c);
            lo[r] = _mm256_fmadd_ps(xa, w0, lo[r]);
            hi[r] = _mm256_fmadd_ps(xa, w1, hi[r]);
        }
    }
    const int64_t row_bytes = y_stride * (f32 ? 4 : 2);
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        float a[8], b[8];
        _mm256_storeu_ps(a, lo[r]);
        _mm256_storeu_ps(b, hi[r]);
        store_panel(a, b, add, valid, (char *)y + r * row_bytes, f32);
    }
}

/* The product for either element type (f32: x, panels, bias and y in float32, else bf16); see
 * lmf_bf16_fma_gemm. A float32 x is read in place; a bf16 x is widened once into a copy. */
static inline __attribute__((always_inline)) int fma_gemm(const void *x, int64_t x_stride, const void *panels,
                                                          const void *bias, void *y, int64_t y_stride, int m, int n,
                                                          int k, int threads, const int f32) {
    const int esize = f32 ? 4 : 2;
    float *copy = f32 ? NULL : malloc(sizeof(float) * (size_t)m * (size_t)k); /* x widened once */
    if (!f32 && copy == NULL) return -1;
    const float *xf = f32 ? (const float *)x : copy;
    const int64_t xs = f32 ? x_stride : k;
    const int nb = (n + 15) / 16;
    /* rows in blocks whose float32 copy stays in cache while every panel passes over it */
    const int fit = (int)(ROW_BLOCK_BYTES / (sizeof(float) * (size_t)k)) / 6 * 6;
    const int rows = fit > 6 ? fit : 6;
#define ROWS(R)                                                                                                      \
    panel_rows(xf + (int64_t)r * xs, xs, panel, k, R, add, valid, (char *)y + ((int64_t)r * y_stride + b * 16) * esize, \
               y_stride, f32)
    /* One parallel region: the threads widen x together (the only barrier before the end), then
     * take runs of panels (guided), row block after row block without waiting for each other. */
#pragma omp parallel num_threads(threads)
    {
        if (!f32) {
#pragma omp for schedule(static)
            for (int r = 0; r < m; r++) {
                const uint16_t *src = (const uint16_t *)x + (int64_t)r * x_stride;
                float *dst = copy + (int64_t)r * k;
                int c = 0;
                for (; c + 8 <= k; c += 8) _mm256_storeu_ps(dst + c, bf16x8_to_f32(src + c));
                for (; c < k; c++) dst[c] = bf16_to_f32(src[c]);
            }
        }
        for (int r0 = 0; r0 < m; r0 += rows) {
#pragma omp for schedule(guided) nowait
            for (int b = 0; b < nb; b++) {
                const char *panel = (const char *)panels + (int64_t)b * k * 16 * esize;
                const int valid = n - b * 16 < 16 ? n - b * 16 : 16;
                float add[16] = {0};
                if (bias)
                    for (int j = 0; j < valid; j++)
                        add[j] = f32 ? ((const float *)bias)[b * 16 + j] : bf16_to_f32(((const uint16_t *)bias)[b * 16 + j]);
                const int r1 = r0 + rows < m ? r0 + rows : m;
                int r = r0;
                for (; r + 6 <= r1; r += 6) ROWS(6);
                switch (r1 - r) {
                    case 5: ROWS(5); break;
                    case 4: ROWS(4); break;
                    case 3: ROWS(3); break;
                    case 2: ROWS(2); break;
                    case 1: ROWS(1); break;
                    default: break;
                }
            }
        }
    }
#undef ROWS
    free(copy);
    return 0;
}

/* x: [M, K] bf16 (row stride x_stride), panels: [ceil(N/16)][K][16] bf16 (the last panel's
 * channels past N are padding, never stored), bias: [N] bf16 or NULL, y: [M, N] bf16 (row stride
 * y_stride). Returns 0, or -1 when the float32 copy of x cannot be allocated. */
int lmf_bf16_fma_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                      int64_t y_stride, int m, int n, int k, int threads) {
    return fma_gemm(x, x_stride, panels, bias, y, y_stride, m, n, k, threads, 0);
}

/* The same product in float32 throughout (x, panels [ceil(N/16)][K][16], bias, y): the
 * batch-invariant float32 linear of the engine's deterministic mode (a BLAS GEMM picks its
 * blocking, and so its summation order, by the number of rows). Returns 0. */
int lmf_f32_fma_gemm(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                     int64_t y_stride, int m, int n, int k, int threads) {
    return fma_gemm(x, x_stride, panels, bias, y, y_stride, m, n, k, threads, 1);
}
#else
int lmf_bf16_fma_gemm_supported(void) { return 0; }

int lmf_bf16_fma_gemm(const uint16_t *x, int64_t x_stride, const uint16_t *panels, const uint16_t *bias, uint16_t *y,
                      int64_t y_stride, int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)threads;
    return -1;
}

int lmf_f32_fma_gemm(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y,
                     int64_t y_stride, int m, int n, int k, int threads) {
    (void)x, (void)x_stride, (void)panels, (void)bias, (void)y, (void)y_stride, (void)m, (void)n, (void)k,
        (void)threads;
    return -1;
}
#endif
