/* Batched LoRA products gathered per row (BGMV) for CPUs: each row of a step adds its own adapter's
 * delta to the base linear's output, the adapters stacked as `lmfoundry.kernels.lora` describes
 * (a [L, S, K]; bt [L, R, N] with the scale folded in; ends [P]: each part's last column + 1).
 *
 *   shrink: s[t, j] = sum_k x[t, k] a[rows[t], j, k]            float32, 0 for base rows (-1)
 *   expand: y[t, n] = round(y[t, n] + sum_r s[t, p(n) R + r] bt[rows[t], r, n])   base rows untouched
 *
 * float32 accumulation, one rounding to y's dtype; bfloat16 or float32 activations and stacks.
 *
 * At a decode step both are a few hundred rows of rank vectors against short rows of A and B, so
 * what they cost is instructions, not memory: the shrink takes one input row against a block of
 * W rank rows at once (W = 16 on AVX-512, 8 on AVX2), one accumulator vector a rank row (W
 * independent FMA chains, the input loaded once for all of them) reduced together at the end
 * (`reduce16` / `reduce8`; with AVX512-BF16, bf16 pairs go to `vdpbf16ps` as they are, two products a
 * lane, which flushes denormal products to zero); the expand accumulates a chunk of 64 output columns in four vectors
 * over the R rank rows, and adds it to y with one rounding. Elsewhere the plain loops below run.
 * Rows and blocks are shared over torch's OpenMP pool. Built on the serving machine by
 * lmfoundry.runtime.cpu.native.build.
 */
#include <stdint.h>

#include "bf16.h"

#define EXPAND_CHUNK 64 /* output columns one task accumulates */

static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* One vector path, written once over these: AVX-512 (16 lanes) or AVX2 + FMA (8 lanes). */
#if defined(__AVX512F__)
#include "avx512_common.h"
#define LANES 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VLOAD_F32(p) _mm512_loadu_ps(p)
#define VLOAD_BF16(p) bf16x16_to_f32(p)
#define VSTORE_F32(p, v) _mm512_storeu_ps(p, v)
#define VSTORE_BF16(p, v) _mm256_storeu_si256((__m256i *)(p), f32x16_to_bf16(v))
#define VREDUCE(acc) reduce16(acc) /* LANES vectors -> their LANES totals */
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2_common.h"
#define LANES 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VLOAD_F32(p) _mm256_loadu_ps(p)
#define VLOAD_BF16(p) bf16x8_to_f32(p)
#define VSTORE_F32(p, v) _mm256_storeu_ps(p, v)
#define VSTORE_BF16(p, v) _mm_storeu_si128((__m128i *)(p), f32x8_to_bf16(v))
#define VREDUCE(acc) reduce8(acc)
#endif

#if defined(LANES)
static inline __attribute__((always_inline)) vec vload(const void *p, int64_t i, int bf16) {
    return bf16 ? VLOAD_BF16((const uint16_t *)p + i) : VLOAD_F32((const float *)p + i);
}

/* out[q] = x . a_q for the `rows` (<= LANES) rank rows a_q = a + q k of one adapter */
static inline __attribute__((always_inline)) void dots(const void *x, int64_t xo, const void *a, int64_t ao, int k,
                                                       int rows, int bf16, float *out) {
    vec acc[LANES];
    for (int q = 0; q < LANES; q++) acc[q] = VZERO();
    int i = 0;
#if defined(__AVX512BF16__)
    if (bf16) /* AVX512-BF16: 32 products a row per instruction, the bf16 inputs as they are */
        for (; i + 32 <= k; i += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const uint16_t *)x + xo + i);
            for (int q = 0; q < LANES; q++) {
                const uint16_t *row = (const uint16_t *)a + ao + (int64_t)(q < rows ? q : rows - 1) * k + i;
                acc[q] = _mm512_dpbf16_ps(acc[q], xv, (__m512bh)_mm512_loadu_si512(row));
            }
        }
#endif
    for (; i + LANES <= k; i += LANES) {
        const vec xv = vload(x, xo + i, bf16);
        for (int q = 0; q < LANES; q++) /* rows past `rows` repeat the last one; their sums are dropped */
            acc[q] = VFMA(xv, vload(a, ao + (int64_t)(q < rows ? q : rows - 1) * k + i, bf16), acc[q]);
    }
    float sums[LANES];
    VSTORE_F32(sums, VREDUCE(acc));
    for (int q = 0; q < rows; q++) {
        float tail = 0.0f;
        for (int j = i; j < k; j++) tail += load(x, xo + j, bf16) * load(a, ao + (int64_t)q * k + j, bf16);
        out[q] = sums[q] + tail;
    }
}

/* y[0..w) += sum_q coef[q] b[q stride + 0..w), w <= EXPAND_CHUNK, accumulated in float32, rounded once */
static inline __attribute__((always_inline)) void axpys(const float *coef, const void *b, int64_t bo, int64_t stride,
                                                        int r, int w, void *y, int64_t yo, int bf16) {
    vec acc[EXPAND_CHUNK / LANES];
    const int full = w / LANES;
    for (int v = 0; v < EXPAND_CHUNK / LANES; v++) acc[v] = VZERO();
    for (int q = 0; q < r; q++) {
        const vec c = VSET1(coef[q]);
        for (int v = 0; v < full; v++) acc[v] = VFMA(c, vload(b, bo + q * stride + LANES * v, bf16), acc[v]);
    }
    float rest[LANES] = {0};
    for (int q = 0; q < r; q++)
        for (int i = LANES * full; i < w; i++) rest[i - LANES * full] += coef[q] * load(b, bo + q * stride + i, bf16);
    for (int v = 0; v < full; v++) {
        if (bf16) {
            uint16_t *yr = (uint16_t *)y + yo + LANES * v;
            VSTORE_BF16(yr, VADD(VLOAD_BF16(yr), acc[v]));
        } else {
            float *yr = (float *)y + yo + LANES * v;
            VSTORE_F32(yr, VADD(VLOAD_F32(yr), acc[v]));
        }
    }
    for (int i = LANES * full; i < w; i++) {
        if (bf16) {
            uint16_t *yr = (uint16_t *)y + yo + i;
            *yr = f32_to_bf16(bf16_to_f32(*yr) + rest[i - LANES * full]);
        } else {
            ((float *)y)[yo + i] += rest[i - LANES * full];
        }
    }
}

#else
#define LANES 8

static inline __attribute__((always_inline)) void dots(const void *x, int64_t xo, const void *a, int64_t ao, int k,
                                                       int rows, int bf16, float *out) {
    for (int q = 0; q < rows; q++) {
        float acc = 0.0f;
        for (int i = 0; i < k; i++) acc += load(x, xo + i, bf16) * load(a, ao + (int64_t)q * k + i, bf16);
        out[q] = acc;
    }
}

static inline __attribute__((always_inline)) void axpys(const float *coef, const void *b, int64_t bo, int64_t stride,
                                                        int r, int w, void *y, int64_t yo, int bf16) {
    float acc[EXPAND_CHUNK] = {0};
    for (int q = 0; q < r; q++)
        for (int i = 0; i < w; i++) acc[i] += coef[q] * load(b, bo + q * stride + i, bf16);
    for (int i = 0; i < w; i++) {
        if (bf16) {
            uint16_t *yr = (uint16_t *)y + yo + i;
            *yr = f32_to_bf16(bf16_to_f32(*yr) + acc[i]);
        } else {
            ((float *)y)[yo + i] += acc[i];
        }
    }
}
#endif

static inline __attribute__((always_inline)) void shrink(const void *x, int64_t x_stride, const void *a,
                                                         const int32_t *rows, float *s, int64_t s_stride,
                                                         int64_t t_rows, int k, int s_cols, int threads, int bf16) {
    const int blocks = (s_cols + LANES - 1) / LANES;
    const int64_t work = t_rows * (int64_t)s_cols * k;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (work >= 262144)
    for (int64_t t = 0; t < t_rows; t++) {
        for (int blk = 0; blk < blocks; blk++) {
            const int32_t slot = rows[t];
            const int j0 = blk * LANES, n = s_cols - j0 < LANES ? s_cols - j0 : LANES;
            float *out = s + t * s_stride + j0;
            if (slot < 0) {
                for (int j = 0; j < n; j++) out[j] = 0.0f;
            } else {
                dots(x, t * x_stride, a, ((int64_t)slot * s_cols + j0) * k, k, n, bf16, out);
            }
        }
    }
}

static inline __attribute__((always_inline)) void expand(const float *s, int64_t s_stride, const void *bt,
                                                         const int32_t *rows, const int32_t *ends, int parts, int r,
                                                         int n, void *y, int64_t y_stride, int64_t t_rows,
                                                         int threads, int bf16) {
    /* tasks: (row, column chunk of one part); chunk c of part p starts at begin[p] + (c - first[p]) CHUNK */
    int begin[4] = {0}, first[5] = {0};
    for (int p = 0; p < parts; p++) {
        begin[p] = p ? ends[p - 1] : 0;
        first[p + 1] = first[p] + (ends[p] - begin[p] + EXPAND_CHUNK - 1) / EXPAND_CHUNK;
    }
    const int chunks = first[parts];
    const int64_t work = t_rows * (int64_t)n * r;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (work >= 262144)
    for (int64_t t = 0; t < t_rows; t++) {
        for (int c = 0; c < chunks; c++) {
            const int32_t slot = rows[t];
            if (slot < 0) continue;
            int p = 0;
            while (c >= first[p + 1]) p++;
            const int n0 = begin[p] + (c - first[p]) * EXPAND_CHUNK;
            const int w = ends[p] - n0 < EXPAND_CHUNK ? ends[p] - n0 : EXPAND_CHUNK;
            axpys(s + t * s_stride + (int64_t)p * r, bt, (int64_t)slot * r * n + n0, n, r, w, y, t * y_stride + n0,
                  bf16);
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

/* shrink then expand in one call (the serving path: one call a linear site); s [t_rows, s_cols]
 * float32 is the caller's scratch */
void lmf_lora_apply_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *a, const uint16_t *bt,
                         const int32_t *rows, const int32_t *ends, int parts, int r, int k, int n, float *s,
                         uint16_t *y, int64_t y_stride, int64_t t_rows, int threads) {
    shrink(x, x_stride, a, rows, s, (int64_t)parts * r, t_rows, k, parts * r, threads, 1);
    expand(s, (int64_t)parts * r, bt, rows, ends, parts, r, n, y, y_stride, t_rows, threads, 1);
}

void lmf_lora_apply_f32(const float *x, int64_t x_stride, const float *a, const float *bt, const int32_t *rows,
                        const int32_t *ends, int parts, int r, int k, int n, float *s, float *y, int64_t y_stride,
                        int64_t t_rows, int threads) {
    shrink(x, x_stride, a, rows, s, (int64_t)parts * r, t_rows, k, parts * r, threads, 0);
    expand(s, (int64_t)parts * r, bt, rows, ends, parts, r, n, y, y_stride, t_rows, threads, 0);
}
