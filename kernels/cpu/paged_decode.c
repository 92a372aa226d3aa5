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
 * output in float32 or bfloat16 (dtype codes below).
 *
 * Built on the serving machine with -march=native by lmfoundry.kernels.cpu.build, so the loops
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
        float top = -INFINITY;
        for (int i = 0; i < n; i++) top = sh[i] > top ? sh[i] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int i = 0; i < n; i++) {
            sh[i] = exp_nonpos(sh[i] - top);
            total += sh[i];
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
        attend_part(qc + (int64_t)rows[b] * q_row_stride * esize, q_head_stride, (const char *)k_cache,
                    (const char *)v_cache, tables + (int64_t)b * table_stride, block_size, hkv, d, g, t0, t1, scale,
                    dtype, esize, acc, m, l);
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
