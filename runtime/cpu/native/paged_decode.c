/* Decode attention over the paged KV cache, read in place, for CPUs.
 *
 * One query token per sequence (a decode) attends to the first `lengths[i]` tokens of its
 * sequence, whose K/V live in blocks of the paged cache ([num_blocks, block_size, Hkv, D], a
 * token's slot is block * block_size + offset) named by its row of `tables`. Nothing is gathered:
 * each K/V row is read where it lies, so a prompt prefix shared by many sequences is read from
 * the same (cache-resident) blocks by each of them instead of being copied per sequence.
 *
 * Work: one item per (sequence, partition of the context). An item scores all query heads and
 * visits the KV heads inside each block of 16 tokens: a token's heads lie side by side, so its K
 * (then V) rows are read front to back, and each K/V row once per GQA group. Long contexts, or too
 * few sequences to keep every thread busy, are split into partitions whose partial softmaxes are
 * merged through their maxima and sums (flash-decoding). Arithmetic in float32; q, K/V and the
 * output in float32 or bfloat16 (dtype codes below). On CPUs with AVX512-BF16, bf16 attention
 * rounds the softmax weights P to bf16 for the PV product, as GPU flash attention does, so that one
 * dot-product instruction takes two tokens (attend_part_bf16; lmf_paged_decode_p_bf16 says when).
 * With AVX-512 tokens are scored and summed 16 at a time, with AVX2 and FMA 8 at a time (float32
 * FMAs, K/V widened from bf16 in registers), elsewhere one at a time in loops the compiler
 * vectorizes.
 *
 * Built on the serving machine with -march=native by lmfoundry.runtime.cpu.native.build, so the loops
 * vectorize for the CPU it runs on; OpenMP is torch's own runtime (the same libgomp.so.1).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define DTYPE_F32 0
#define DTYPE_BF16 1

static inline void load_row(const char *p, int dtype, int d, float *restrict out) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *h = (const uint16_t *)p;
#pragma omp simd
        for (int i = 0; i < d; i++) out[i] = bf16_to_f32(h[i]);
    } else {
        memcpy(out, p, (size_t)d * sizeof(float));
    }
}

static inline void store_row(char *p, int dtype, int d, const float *restrict x, float mul) {
    if (dtype == DTYPE_BF16) {
        uint16_t *h = (uint16_t *)p;
        for (int i = 0; i < d; i++) h[i] = f32_to_bf16(x[i] * mul);
    } else {
        float *f = (float *)p;
        for (int i = 0; i < d; i++) f[i] = x[i] * mul;
    }
}

#if defined(__AVX512F__)
#include "avx512_common.h"

/* The dot products of one query head (q_raw as stored, qf as float32) with 16 K rows; d % 32 == 0. */
static inline __m512 score16(const char *q_raw, const float *qf, const char *const rows[16], int d, int dtype) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    if (dtype == DTYPE_BF16) {
#if defined(__AVX512BF16__)
        for (int i = 0; i < d; i += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q_raw + 2 * i);
            for (int j = 0; j < 16; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(rows[j] + 2 * i));
        }
#else
        for (int i = 0; i < d; i += 16) {
            const __m512 qv = _mm512_loadu_ps(qf + i);
            for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, bf16x16_to_f32(rows[j] + 2 * i), acc[j]);
        }
#endif
    } else {
        for (int i = 0; i < d; i += 16) {
            const __m512 qv = _mm512_loadu_ps(qf + i);
            for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps((const float *)rows[j] + i), acc[j]);
        }
    }
    (void)q_raw;
    return reduce16(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2_common.h"

/* 8 K or V rows of one KV head (as stored) -> block[8][d] in float32: widened once, read by every
 * query head of the GQA group; d % 8 == 0. */
static inline void widen_rows8(const char *const rows[8], int d, int dtype, float *restrict block) {
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < d; i += 8)
            _mm256_storeu_ps(block + j * d + i, dtype == DTYPE_BF16 ? bf16x8_to_f32(rows[j] + 2 * i)
                                                                    : _mm256_loadu_ps((const float *)rows[j] + i));
}

/* The dot products of one query head (qf, float32) with the 8 rows of a widened K block. */
static inline __m256 score8(const float *qf, const float *kblock, int d) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qf + i);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kblock + j * d + i), acc[j]);
    }
    return reduce8(acc);
}

/* ah[0..d) += sum over the block's 8 tokens of p[j] * vblock[j][0..d), token after token for each
 * element (as the scalar loop adds them). 64 dimensions at a time stay in eight registers, so
 * each weight is broadcast once per 64 outputs and eight FMA chains run side by side. */
static inline void pv8(const float *p, const float *vblock, int d, float *restrict ah) {
    int i = 0;
    for (; i + 64 <= d; i += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_loadu_ps(ah + i + 8 * c);
        for (int j = 0; j < 8; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vblock + j * d + i + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(ah + i + 8 * c, a[c]);
    }
    for (; i < d; i += 8) {
        __m256 a = _mm256_loadu_ps(ah + i);
        for (int j = 0; j < 8; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vblock + j * d + i), a);
        _mm256_storeu_ps(ah + i, a);
    }
}
#endif

/* One item: every query head of one sequence over context tokens [t0, t1). The K/V heads are
 * visited inside each block of 16 tokens, so a block's rows (all heads of a token lie side by
 * side) are read front to back while in cache. Leaves the unnormalized output in acc[hq][d], the
 * row maxima in m[hq] and sums in l[hq]. */
static void attend_part(const char *q, int64_t q_head_stride, const char *k_cache, const char *v_cache,
                        const int32_t *table, int block_size, int hkv, int d, int g, int t0, int t1, float scale,
                        int dtype, int esize, float *restrict acc, float *restrict m, float *restrict l) {
    const int n = t1 - t0, hq = hkv * g;
    float qf[hq * d];
    float row[d];
    float s[hq * n];
    /* the query heads, as float32 and (for the bf16 dot-product path) packed as stored */
    char q_raw[hq * d * esize];
    for (int h = 0; h < hq; h++) {
        const char *qh = q + (int64_t)h * q_head_stride * esize;
        memcpy(q_raw + h * d * esize, qh, (size_t)d * esize);
        load_row(qh, dtype, d, qf + h * d);
    }
    const int64_t token_stride = (int64_t)hkv * d * esize, head_bytes = (int64_t)d * esize;
    int t = t0;
#if defined(__AVX512F__)
    if (d % 32 == 0)
        for (; t + 16 <= t1; t += 16) {
            int64_t at[16];
            for (int j = 0; j < 16; j++) {
                at[j] = ((int64_t)table[(t + j) / block_size] * block_size + (t + j) % block_size) * token_stride;
                for (int64_t line = 0; line < token_stride; line += 64) /* V for the second pass, while K is scored */
                    _mm_prefetch(v_cache + at[j] + line, _MM_HINT_T1);
            }
            for (int kvh = 0; kvh < hkv; kvh++) {
                const char *rows[16];
                for (int j = 0; j < 16; j++) rows[j] = k_cache + at[j] + kvh * head_bytes;
                for (int h = kvh * g; h < (kvh + 1) * g; h++)
                    _mm512_storeu_ps(s + h * n + (t - t0),
                                     _mm512_mul_ps(score16(q_raw + h * d * esize, qf + h * d, rows, d, dtype),
                                                   _mm512_set1_ps(scale)));
            }
        }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0 && d <= 256) {
        float kblock[8 * d];
        for (; t + 8 <= t1; t += 8) {
            int64_t at[8];
            for (int j = 0; j < 8; j++) {
                at[j] = ((int64_t)table[(t + j) / block_size] * block_size + (t + j) % block_size) * token_stride;
                for (int64_t line = 0; line < token_stride; line += 64) /* V for the second pass, while K is scored */
                    _mm_prefetch(v_cache + at[j] + line, _MM_HINT_T1);
            }
            for (int kvh = 0; kvh < hkv; kvh++) {
                const char *rows[8];
                for (int j = 0; j < 8; j++) rows[j] = k_cache + at[j] + kvh * head_bytes;
                widen_rows8(rows, d, dtype, kblock);
                for (int h = kvh * g; h < (kvh + 1) * g; h++)
                    _mm256_storeu_ps(s + h * n + (t - t0),
                                     _mm256_mul_ps(score8(qf + h * d, kblock, d), _mm256_set1_ps(scale)));
            }
        }
    }
#endif
    for (; t < t1; t++) {
        const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride;
        for (int kvh = 0; kvh < hkv; kvh++) {
            load_row(k_cache + at + kvh * head_bytes, dtype, d, row);
            for (int h = kvh * g; h < (kvh + 1) * g; h++) {
                const float *qh = qf + h * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int i = 0; i < d; i++) dot += qh[i] * row[i];
                s[h * n + (t - t0)] = dot * scale;
            }
        }
    }
    for (int h = 0; h < hq; h++) {
        float *sh = s + h * n;
        float top = -INFINITY, total = 0.0f;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        /* eight scores at a time (the compiler leaves the scalar loops below unvectorized) */
        __m256 vtop = _mm256_set1_ps(-INFINITY), vtotal = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(sh + i));
        top = hmax8(vtop);
        for (; i < n; i++) top = sh[i] > top ? sh[i] : top;
        const __m256 vmax = _mm256_set1_ps(top);
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), vmax));
            _mm256_storeu_ps(sh + i, e);
            vtotal = _mm256_add_ps(vtotal, e);
        }
        total = hsum8(vtotal);
#else
        for (; i < n; i++) top = sh[i] > top ? sh[i] : top;
        i = 0;
#endif
#pragma omp simd reduction(+ : total)
        for (int j = i; j < n; j++) {
            sh[j] = exp_nonpos(sh[j] - top);
            total += sh[j];
        }
        m[h] = top;
        l[h] = total;
    }
    memset(acc, 0, sizeof(float) * (size_t)hq * d);
    t = t0;
#if defined(__AVX512F__)
    /* 16 V rows of a head at a time, converted into a float block, then each query head's output
     * chunk takes 16 FMAs between one load and one store. */
    if (d % 16 == 0 && d <= 256) {
        float vblock[16 * d];
        for (; t + 16 <= t1; t += 16) {
            int64_t at[16];
            for (int j = 0; j < 16; j++)
                at[j] = ((int64_t)table[(t + j) / block_size] * block_size + (t + j) % block_size) * token_stride;
            for (int kvh = 0; kvh < hkv; kvh++) {
                for (int j = 0; j < 16; j++) {
                    const char *r = v_cache + at[j] + kvh * head_bytes;
                    for (int i = 0; i < d; i += 16)
                        _mm512_storeu_ps(vblock + j * d + i, dtype == DTYPE_BF16 ? bf16x16_to_f32(r + 2 * i)
                                                                                 : _mm512_loadu_ps((const float *)r + i));
                }
                for (int h = kvh * g; h < (kvh + 1) * g; h++) {
                    const float *p = s + h * n + (t - t0);
                    for (int i = 0; i < d; i += 16) {
                        __m512 a = _mm512_loadu_ps(acc + h * d + i);
                        for (int j = 0; j < 16; j++)
                            a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(vblock + j * d + i), a);
                        _mm512_storeu_ps(acc + h * d + i, a);
                    }
                }
            }
        }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* as above, 8 V rows at a time */
    if (d % 8 == 0 && d <= 256) {
        float vblock[8 * d];
        for (; t + 8 <= t1; t += 8) {
            int64_t at[8];
            for (int j = 0; j < 8; j++)
                at[j] = ((int64_t)table[(t + j) / block_size] * block_size + (t + j) % block_size) * token_stride;
            for (int kvh = 0; kvh < hkv; kvh++) {
                const char *rows[8];
                for (int j = 0; j < 8; j++) rows[j] = v_cache + at[j] + kvh * head_bytes;
                widen_rows8(rows, d, dtype, vblock);
                for (int h = kvh * g; h < (kvh + 1) * g; h++) pv8(s + h * n + (t - t0), vblock, d, acc + h * d);
            }
        }
    }
#endif
    for (; t < t1; t++) {
        const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride;
        for (int kvh = 0; kvh < hkv; kvh++) {
            load_row(v_cache + at + kvh * head_bytes, dtype, d, row);
            for (int h = kvh * g; h < (kvh + 1) * g; h++) {
                const float p = s[h * n + (t - t0)];
                float *ah = acc + h * d;
#pragma omp simd
                for (int i = 0; i < d; i++) ah[i] += p * row[i];
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_P_BF16 1
#define MAX_G 8 /* query heads of a group whose PV accumulators stay in registers at once */
#define PREFETCH_TOKENS 16 /* how far ahead the PV loop asks for V rows (blocks lie anywhere in the cache) */

/* Byte offsets of tokens [t0, t1) in the caches: one division per block, not per token. */
static inline void token_offsets(const int32_t *table, int block_size, int t0, int t1, int64_t token_stride,
                                 int64_t *restrict at) {
    for (int t = t0; t < t1;) {
        const int blk = t / block_size, off = t % block_size;
        const int stop = (blk + 1) * block_size < t1 ? (blk + 1) * block_size : t1;
        const int64_t base = ((int64_t)table[blk] * block_size + off) * token_stride;
        for (int i = 0; i < stop - t; i++) at[t - t0 + i] = base + i * token_stride;
        t = stop;
    }
}

/* acc[h][c0 .. c0+32) += sum over tokens of P[h][t] * V[t][kvh][c0 .. c0+32) for the heads
 * h0 .. h0+G of one KV head. Tokens go in pairs: unpacking two V rows' 16-bit words interleaves
 * them within each 128-bit lane, and one dpbf16 against the broadcast pair (P[t], P[t+1]) adds both
 * tokens' products in fp32. The unpack permutes dimensions (lane i of `lo` holds dimension
 * 8*(i/4) + i%4, of `hi` that + 4); the permutation is undone once, at the store. G is a constant
 * at every call, so the 2G accumulators live in registers for the whole item. */
static inline __attribute__((always_inline)) void pv_chunk(const char *v_cache, const int64_t *at, int npairs,
                                                           int64_t head_off, const uint16_t *pb, int npad, int h0,
                                                           int G, float *restrict acc, int d, int c0) {
    __m512 lo[MAX_G], hi[MAX_G];
    for (int h = 0; h < G; h++) lo[h] = hi[h] = _mm512_setzero_ps();
    for (int k = 0; k < npairs; k++) {
        _mm_prefetch(v_cache + at[2 * k + PREFETCH_TOKENS] + head_off, _MM_HINT_T0); /* at[] is padded for it */
        _mm_prefetch(v_cache + at[2 * k + 1 + PREFETCH_TOKENS] + head_off, _MM_HINT_T0);
        const __m512i a = _mm512_loadu_si512(v_cache + at[2 * k] + head_off);
        const __m512i b = _mm512_loadu_si512(v_cache + at[2 * k + 1] + head_off);
        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < G; h++) {
            int32_t pair;
            memcpy(&pair, pb + (int64_t)(h0 + h) * npad + 2 * k, 4);
            const __m512bh p = (__m512bh)_mm512_set1_epi32(pair);
            lo[h] = _mm512_dpbf16_ps(lo[h], vlo, p);
            hi[h] = _mm512_dpbf16_ps(hi[h], vhi, p);
        }
    }
    /* lane order back to dimensions: out[j] for j < 16 from lo/hi lanes 4*(j/8) + j%4 (+16: hi) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < G; h++) {
        _mm512_storeu_ps(acc + (int64_t)(h0 + h) * d + c0, _mm512_permutex2var_ps(lo[h], first, hi[h]));
        _mm512_storeu_ps(acc + (int64_t)(h0 + h) * d + c0 + 16, _mm512_permutex2var_ps(lo[h], second, hi[h]));
    }
}

/* attend_part for bf16 q/K/V and d % 32 == 0 on CPUs with AVX512-BF16: scores as there, then P
 * rounded to bf16 for the PV product (as GPU flash attention does; the normaliser sums the
 * rounded weights), whose dot products take two tokens per instruction. */
static void attend_part_bf16(const char *q, int64_t q_head_stride, const char *k_cache, const char *v_cache,
                             const int32_t *table, int block_size, int hkv, int d, int g, int t0, int t1,
                             float scale, float *restrict acc, float *restrict m, float *restrict l) {
    const int n = t1 - t0, hq = hkv * g, npad = (n + 15) & ~15;
    const int64_t token_stride = (int64_t)hkv * d * 2, head_bytes = (int64_t)d * 2;
    int64_t at[npad + PREFETCH_TOKENS];
    token_offsets(table, block_size, t0, t1, token_stride, at);
    for (int i = n; i < npad + PREFETCH_TOKENS; i++) at[i] = at[0]; /* padding reads a real row; its weight is 0 */
    float s[hq * npad];
    uint16_t pb[hq * npad];
    const __m512 vscale = _mm512_set1_ps(scale);
    const int l1_tile = 16 * token_stride <= 8192;
    for (int t = 0; t < npad; t += 16) {
        /* the next tile's tokens, every head (one run of bytes each, read by the loop below): into
         * L1 while a tile's rows fit beside the rest, into L2 for wide models */
        for (int j = 0; j < 16; j++)
            for (int line = 0; line < token_stride; line += 64)
                if (l1_tile)
                    _mm_prefetch(k_cache + at[t + 16 + j] + line, _MM_HINT_T0);
                else
                    _mm_prefetch(k_cache + at[t + 16 + j] + line, _MM_HINT_T1);
        for (int kvh = 0; kvh < hkv; kvh++) {
            const char *rows[16];
            for (int j = 0; j < 16; j++) rows[j] = k_cache + at[t + j] + kvh * head_bytes;
            for (int h = kvh * g; h < (kvh + 1) * g; h++) {
                const char *qh = q + (int64_t)h * q_head_stride * 2;
                _mm512_storeu_ps(s + h * npad + t, _mm512_mul_ps(score16(qh, 0, rows, d, DTYPE_BF16), vscale));
            }
        }
    }
    const __mmask16 tail = n % 16 ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xffff;
    for (int h = 0; h < hq; h++) {
        float *sh = s + h * npad;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int t = 0; t < npad; t += 16)
            top = _mm512_mask_max_ps(top, t + 16 <= n ? 0xffff : tail, top, _mm512_loadu_ps(sh + t));
        const float mx = _mm512_reduce_max_ps(top);
        __m512 total = _mm512_setzero_ps();
        for (int t = 0; t < npad; t += 16) { /* P rounded to bf16 once; the sum reads back what is stored */
            const __m256i bits = f32x16_to_bf16(exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sh + t), _mm512_set1_ps(mx))));
            _mm256_storeu_si256((__m256i *)(pb + h * npad + t), _mm256_maskz_mov_epi16(t + 16 <= n ? 0xffff : tail, bits));
            total = _mm512_add_ps(total, bf16x16_to_f32(pb + h * npad + t));
        }
        m[h] = mx;
        l[h] = _mm512_reduce_add_ps(total);
    }
    const int npairs = (n + 1) / 2;
    for (int kvh = 0; kvh < hkv; kvh++)
        for (int c0 = 0; c0 < d; c0 += 32)
            for (int h0 = kvh * g; h0 < (kvh + 1) * g; h0 += MAX_G) {
                const int64_t off = kvh * head_bytes + 2 * c0;
                switch ((kvh + 1) * g - h0 < MAX_G ? (kvh + 1) * g - h0 : MAX_G) {
                case 1: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 1, acc, d, c0); break;
                case 2: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 2, acc, d, c0); break;
                case 3: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 3, acc, d, c0); break;
                case 4: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 4, acc, d, c0); break;
                case 5: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 5, acc, d, c0); break;
                case 6: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 6, acc, d, c0); break;
                case 7: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, 7, acc, d, c0); break;
                default: pv_chunk(v_cache, at, npairs, off, pb, npad, h0, MAX_G, acc, d, c0); break;
                }
            }
}
#else
#define HAVE_P_BF16 0
#endif

/* 1 where bf16 attention with this head size rounds P to bf16 for the PV product (the AVX512-BF16
 * path), else 0: the error bound the tests hold the kernel to depends on it. */
int lmf_paged_decode_p_bf16(int dtype, int d) { return HAVE_P_BF16 && dtype == DTYPE_BF16 && d % 32 == 0; }

/* out[rows[b]] = attention of q[rows[b]] over the first lengths[b] tokens of tables[b], for b in
 * [0, batch). Contexts are cut into partitions of `part_len` tokens (a multiple of block_size);
 * with more than one, `work` holds every partition's (acc[hq][d], m[hq], l[hq]) for the merge and
 * must have room for batch * num_parts * hq * (d + 2) floats. Returns 0, or -1 for an
 * unsupported argument (nothing is written then). */
int lmf_paged_decode(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k_cache,
                     const void *v_cache, const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                     const int32_t *rows, void *out, int64_t out_row_stride, int batch, int hq, int hkv, int d,
                     int block_size, int part_len, int num_parts, float scale, int dtype, float *work,
                     int threads) {
    if (hkv <= 0 || hq % hkv != 0 || d <= 0 || d > 512 || block_size <= 0 || part_len <= 0 ||
        part_len % block_size != 0 || num_parts <= 0 || (dtype != DTYPE_F32 && dtype != DTYPE_BF16) ||
        (num_parts > 1 && work == 0))
        return -1;
    const int g = hq / hkv;
    const int esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int item_floats = hq * (d + 2);
    const char *qc = (const char *)q;
    char *oc = (char *)out;
    const int64_t items = (int64_t)batch * num_parts;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        const int b = (int)(it / num_parts);
        const int part = (int)(it % num_parts);
        const int len = lengths[b];
        const int t0 = part * part_len;
        const int t1 = t0 + part_len < len ? t0 + part_len : len;
        float local[num_parts == 1 ? item_floats : 1];
        float *acc = num_parts == 1 ? local : work + it * item_floats;
        float *m = acc + hq * d, *l = m + hq;
        if (t0 >= t1) { /* an empty partition (a shorter sequence): nothing to merge */
            for (int h = 0; h < hq; h++) {
                m[h] = -INFINITY;
                l[h] = 0.0f;
            }
            continue;
        }
        const char *qb = qc + (int64_t)rows[b] * q_row_stride * esize;
        const int32_t *table = tables + (int64_t)b * table_stride;
#if HAVE_P_BF16
        if (lmf_paged_decode_p_bf16(dtype, d))
            attend_part_bf16(qb, q_head_stride, (const char *)k_cache, (const char *)v_cache, table, block_size, hkv,
                             d, g, t0, t1, scale, acc, m, l);
        else
#endif
            attend_part(qb, q_head_stride, (const char *)k_cache, (const char *)v_cache, table, block_size, hkv, d,
                        g, t0, t1, scale, dtype, esize, acc, m, l);
        if (num_parts == 1)
            for (int h = 0; h < hq; h++)
                store_row(oc + ((int64_t)rows[b] * out_row_stride + (int64_t)h * d) * esize, dtype, d, acc + h * d,
                          1.0f / l[h]);
    }
    if (num_parts == 1) return 0;

#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t bh = 0; bh < (int64_t)batch * hq; bh++) {
        const int b = (int)(bh / hq), h = (int)(bh % hq);
        const float *base = work + (int64_t)b * num_parts * item_floats;
        float top = -INFINITY;
        for (int p = 0; p < num_parts; p++) {
            const float mp = base[p * item_floats + hq * d + h];
            top = mp > top ? mp : top;
        }
        float merged[d];
        float total = 0.0f;
        memset(merged, 0, sizeof(float) * (size_t)d);
        for (int p = 0; p < num_parts; p++) {
            const float *part = base + p * item_floats;
            const float lp = part[hq * d + hq + h];
            if (lp == 0.0f) continue;
            const float w = exp_nonpos(part[hq * d + h] - top);
            total += w * lp;
            for (int i = 0; i < d; i++) merged[i] += w * part[h * d + i];
        }
        store_row(oc + ((int64_t)rows[b] * out_row_stride + (int64_t)h * d) * esize, dtype, d, merged,
                  1.0f / total);
    }
    return 0;
}
