/* The elementwise parts of a Llama decoder layer in bfloat16, one pass each, for CPUs: RMSNorm and
 * SiLU(gate) * up (and SiLU(gate) * up in float32 for the engine's deterministic mode).
 *
 * In PyTorch each is a chain of ops (RMSNorm: to float32, square, mean, rsqrt, scale, back to
 * bfloat16, times the gain; the MLP's activation: SiLU in place on gate_proj's output, times up,
 * then a copy, because gate is a strided view of the fused gate/up product and down_proj wants
 * contiguous rows). Every op of the chain is a pass over memory and a dispatch; at a decode step
 * the dispatches dominate, at a prefill chunk the passes do.
 *
 * The roundings are the reference's (`lmfoundry.model.reference.RMSNorm` and `MLP.hidden` in
 * bfloat16): the normalized row is rounded to bfloat16 before the gain multiplies it, SiLU's
 * output is rounded before the product with up, each product rounded once (round to nearest
 * even). Sums of squares run in float32 in another order than PyTorch's, and exp is a polynomial,
 * so a value at a rounding boundary can land one bfloat16 step away from the reference's.
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build: the loops are
 * plain C that the compiler vectorizes for this CPU; rows are shared over torch's OpenMP pool.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* out[r] = gain * bf16(x[r] / sqrt(mean(x[r]^2) + eps)) for rows r in [0, rows); bf16 in and out. */
void lmf_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *gain, uint16_t *out, int64_t out_stride,
                       int64_t rows, int dim, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * dim >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        uint16_t *orow = out + r * out_stride;
        float part[16] = {0};
        int i = 0;
        for (; i + 16 <= dim; i += 16)
#pragma omp simd
            for (int j = 0; j < 16; j++) {
                const float v = bf16_to_f32(xr[i + j]);
                part[j] += v * v;
            }
        float total = 0.0f;
        for (int j = 0; j < 16; j++) total += part[j];
        for (; i < dim; i++) total += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
        const float inv = 1.0f / sqrtf(total / (float)dim + eps);
#pragma omp simd
        for (int c = 0; c < dim; c++)
            orow[c] = f32_to_bf16(bf16_to_f32(gain[c]) * round_bf16(bf16_to_f32(xr[c]) * inv));
    }
}

#if defined(__AVX512F__)
#include "avx512_common.h"

/* silu(v) rounded to bf16, times u, rounded: 16 lanes */
static inline __m256i silu_mul16(__m512 v, __m512 u) {
    const __m512 e = exp_nonpos16(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)))); /* exp(-|v|) */
    /* 1 / (1 + e), 1 + e in [1, 2]: the 14-bit reciprocal estimate and one Newton step (within
     * about 2 float32 ulps; the product is rounded to bf16 next) instead of a division */
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    const __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e); /* v < 0: e / (1 + e) */
    return f32x16_to_bf16(_mm512_mul_ps(round_bf16x16(_mm512_mul_ps(v, sig)), u));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2_common.h"

/* silu(v) rounded to bf16, times u, rounded: 8 lanes, the scalar loop's arithmetic (one division) */
static inline __m128i silu_mul8(__m256 v, __m256 u) {
    const __m256 e = exp_nonpos8(_mm256_or_ps(v, _mm256_set1_ps(-0.0f))); /* exp(-|v|) */
    const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg); /* v < 0: e / (1 + e) */
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return f32x8_to_bf16(_mm256_mul_ps(round_bf16x8(_mm256_mul_ps(v, sig)), u));
}
#endif

/* out[r] = bf16(silu(gate[r])) * up[r], each product rounded to bf16, for rows r in [0, rows). */
void lmf_silu_mul_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                       uint16_t *out, int64_t out_stride, int64_t rows, int n, int threads) {
    const int64_t total = rows * n;
#pragma omp parallel for schedule(static) num_threads(threads) if (total >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate + r * gate_stride, *u = up + r * up_stride;
        uint16_t *o = out + r * out_stride;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i), silu_mul16(bf16x16_to_f32(g + i), bf16x16_to_f32(u + i)));
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(o + i), silu_mul8(bf16x8_to_f32(g + i), bf16x8_to_f32(u + i)));
#endif
        for (; i < n; i++) {
            const float v = bf16_to_f32(g[i]);
            const float e = exp_nonpos(-fabsf(v)); /* exp(-|v|): no overflow either side */
            const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = f32_to_bf16(round_bf16(v * sig) * bf16_to_f32(u[i]));
        }
    }
}

/* out[r] = silu(gate[r]) * up[r] in float32, for rows r in [0, rows): the float32 activation of the
 * engine's deterministic mode. Every element takes the same arithmetic (exp_nonpos, one division,
 * two products, no contraction) wherever it lies, so a row's result does not depend on the rows
 * around it; PyTorch's vectorized SiLU and its scalar remainder differ in the last bit, and which
 * elements fall in the remainder depends on how a step's rows are split among threads. */
void lmf_silu_mul_f32(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
                      int64_t out_stride, int64_t rows, int n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate + r * gate_stride, *u = up + r * up_stride;
        float *o = out + r * out_stride;
        for (int i = 0; i < n; i++) {
            const float v = g[i];
            const float e = exp_nonpos(-fabsf(v)); /* exp(-|v|): no overflow either side */
            const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = v * sig * u[i];
        }
    }
}
