/* Scalar bfloat16 conversions and exp for the CPU kernels (plain C, so loops over them vectorize). */
#ifndef LMF_BF16_H
#define LMF_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x) for x <= 0 in float32 (relative error ~2e-7): x = n ln2 + r, |r| <= ln2/2, a degree-6
 * polynomial for exp(r), 2^n through the exponent bits. Plain arithmetic, so loops over it
 * vectorize (libm's expf would be called once per element). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    float n = (x * 1.44269504088896341f + magic) - magic;
    float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#endif
