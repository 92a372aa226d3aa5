/* Rotary position embedding of a step's q and k in bfloat16, one pass for both, for CPUs.
 *
 * The reference (`lmfoundry.model.reference.apply_rotary`) is a product and two in-place
 * multiply-adds on the halves of each head, per tensor: six PyTorch ops and their views for q and
 * k of every layer, which at a decode step cost more in dispatch than in arithmetic. Here each
 * head is rotated in one loop with the reference's roundings: out = bf16(x * cos), then
 * out[:h] = bf16(out[:h] - x[h:] * sin[:h]) and out[h:] = bf16(out[h:] + x[:h] * sin[h:]), the
 * products in float32 (exact for bf16 inputs), so the result is bit for bit the reference's.
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include "avx512_common.h"
#endif

/* heads [T, H, D] (row stride x_row, head stride x_head, elements) -> out [T, H, D] contiguous,
 * rotated by the position's cos/sin rows ([T, D], row stride cs_row). */
static void rotate(const uint16_t *x, int64_t x_row, int64_t x_head, int heads, uint16_t *out, const uint16_t *cos,
                   const uint16_t *sin, int64_t cs_row, int64_t rows, int d, int threads) {
    const int h = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * d >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (int hd = 0; hd < heads; hd++) {
            const uint16_t *xi = x + t * x_row + hd * x_head;
            uint16_t *o = out + (t * heads + hd) * (int64_t)d;
            int i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= h; i += 16) {
                const __m512 lo = bf16x16_to_f32(xi + i), hi = bf16x16_to_f32(xi + i + h);
                const __m512 lo_c = round_bf16x16(_mm512_mul_ps(lo, bf16x16_to_f32(c + i)));
                const __m512 hi_c = round_bf16x16(_mm512_mul_ps(hi, bf16x16_to_f32(c + i + h)));
                _mm256_storeu_si256((__m256i *)(o + i), f32x16_to_bf16(_mm512_sub_ps(lo_c, _mm512_mul_ps(hi, bf16x16_to_f32(s + i)))));
                _mm256_storeu_si256((__m256i *)(o + i + h),
                                    f32x16_to_bf16(_mm512_add_ps(hi_c, _mm512_mul_ps(lo, bf16x16_to_f32(s + i + h)))));
            }
#endif
            for (; i < h; i++) {
                const float lo = bf16_to_f32(xi[i]), hi = bf16_to_f32(xi[i + h]);
                const float lo_c = bf16_to_f32(f32_to_bf16(lo * bf16_to_f32(c[i])));
                const float hi_c = bf16_to_f32(f32_to_bf16(hi * bf16_to_f32(c[i + h])));
                o[i] = f32_to_bf16(lo_c - hi * bf16_to_f32(s[i]));
                o[i + h] = f32_to_bf16(hi_c + lo * bf16_to_f32(s[i + h]));
            }
        }
    }
}

void lmf_rope_qk_bf16(const uint16_t *q, int64_t q_row, int64_t q_head, int hq, const uint16_t *k, int64_t k_row,
                      int64_t k_head, int hk, uint16_t *q_out, uint16_t *k_out, const uint16_t *cos,
                      const uint16_t *sin, int64_t cs_row, int64_t rows, int d, int threads) {
    rotate(q, q_row, q_head, hq, q_out, cos, sin, cs_row, rows, d, threads);
    rotate(k, k_row, k_head, hk, k_out, cos, sin, cs_row, rows, d, threads);
}
