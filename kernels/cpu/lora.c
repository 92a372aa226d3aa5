/* Batched LoRA products gathered per row (BGMV) for CPUs: each row of a step adds its own adapter's
 * delta to the base linear's output, the adapters stacked as `lmfoundry.kernels.lora` describes
 * (a [L, S, K]; bt [L, R, N] with the scale folded in; ends [P]: each part's last column + 1).
 *
 *   shrink: s[t, j] = sum_k x[t, k] a[rows[t], j, k]            float32, 0 for base rows (-1)
 *   expand: y[t, n] = round(y[t, n] + sum_r s[t, p(n) R + r] bt[rows[t], r, n])   base rows untouched
 *
 * float32 accumulation, one rounding to y's dtype; bfloat16 or float32 activations and stacks.
 * The loops are plain C that -march=native vectorizes (the reductions are marked simd, which lets
 * the compiler reorder the sums); rows and column chunks are shared over torch's OpenMP pool.
 * Built on the serving machine by lmfoundry.kernels.cpu.build.
 */
#include <stdint.h>

#include "bf16.h"

#define EXPAND_CHUNK 64 /* output columns one task accumulates */

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void shrink(const void *x, int64_t x_stride, const void *a,
                                                         const int32_t *rows, float *s, int64_t s_stride,
                                                         int64_t t_rows, int k, int s_cols, int threads, int bf16) {
    const int64_t work = t_rows * (int64_t)s_cols * k;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (work >= 65536)
    for (int64_t t = 0; t < t_rows; t++) {
        for (int j = 0; j < s_cols; j++) {
            const int32_t slot = rows[t];
            if (slot < 0) {
                s[t * s_stride + j] = 0.0f;
                continue;
            }
            const int64_t xo = t * x_stride, ao = ((int64_t)slot * s_cols + j) * k;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < k; i++) acc += load(x, xo + i, bf16) * load(a, ao + i, bf16);
            s[t * s_stride + j] = acc;
        }
    }
}

static inline __attribute__((always_inline)) void expand(const float *s, int64_t s_stride, const void *bt,
                                                         const int32_t *rows, const int32_t *ends, int parts, int r,
                                                         int n, void *y, int64_t y_stride, int64_t t_rows,
                                                         int threads, int bf16) {
    const int chunks = (n + EXPAND_CHUNK - 1) / EXPAND_CHUNK;
    const int64_t work = t_rows * (int64_t)n * r;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (work >= 65536)
    for (int64_t t = 0; t < t_rows; t++) {
        for (int c = 0; c < chunks; c++) {
            const int32_t slot = rows[t];
            if (slot < 0) continue;
            const int n0 = c * EXPAND_CHUNK, n1 = n0 + EXPAND_CHUNK < n ? n0 + EXPAND_CHUNK : n;
            float acc[EXPAND_CHUNK] = {0};
            for (int p = 0, lo = 0; p < parts; lo = ends[p], p++) { /* the chunk's columns of each part */
                const int a = lo > n0 ? lo : n0, b = ends[p] < n1 ? ends[p] : n1;
                if (a >= b) continue;
                const float *sr = s + t * s_stride + (int64_t)p * r;
                for (int q = 0; q < r; q++) {
                    const float coef = sr[q];
                    const int64_t bo = ((int64_t)slot * r + q) * n;
#pragma omp simd
                    for (int i = a; i < b; i++) acc[i - n0] += coef * load(bt, bo + i, bf16);
                }
            }
            if (bf16) {
                uint16_t *yr = (uint16_t *)y + t * y_stride + n0;
#pragma omp simd
                for (int i = 0; i < n1 - n0; i++) yr[i] = f32_to_bf16(bf16_to_f32(yr[i]) + acc[i]);
            } else {
                float *yr = (float *)y + t * y_stride + n0;
#pragma omp simd
                for (int i = 0; i < n1 - n0; i++) yr[i] += acc[i];
            }
        }
    }
}

void lmf_lora_shrink_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *a, const int32_t *rows, float *s,
                          int64_t s_stride, int64_t t_rows, int k, int s_cols, int threads) {
    shrink(x, x_stride, a, rows, s, s_stride, t_rows, k, s_cols, threads, 1);
}

void lmf_lora_shrink_f32(const float *x, int64_t x_stride, const float *a, const int32_t *rows, float *s,
                         int64_t s_stride, int64_t t_rows, int k, int s_cols, int threads) {
    shrink(x, x_stride, a, rows, s, s_stride, t_rows, k, s_cols, threads, 0);
}

void lmf_lora_expand_bf16(const float *s, int64_t s_stride, const uint16_t *bt, const int32_t *rows,
                          const int32_t *ends, int parts, int r, int n, uint16_t *y, int64_t y_stride,
                          int64_t t_rows, int threads) {
    expand(s, s_stride, bt, rows, ends, parts, r, n, y, y_stride, t_rows, threads, 1);
}

void lmf_lora_expand_f32(const float *s, int64_t s_stride, const float *bt, const int32_t *rows, const int32_t *ends,
                         int parts, int r, int n, float *y, int64_t y_stride, int64_t t_rows, int threads) {
    expand(s, s_stride, bt, rows, ends, parts, r, n, y, y_stride, t_rows, threads, 0);
}
