/* Causal attention of prompt chunks over the paged KV cache, read in place, for CPUs with AVX-512
 * BF16 or AVX2 and FMA (bfloat16 q, cache and output; float32 arithmetic).
 *
 * A chunk is `n` new tokens of one sequence at positions context .. context + n - 1; its K/V rows
 * (the cached context and the new tokens, written before this call) live in the blocks of its
 * table row ([num_blocks, block_size, Hkv, D] caches). Query row i attends keys 0 .. context + i.
 * Nothing is gathered: a prefix-cache hit is read where it lies.
 *
 * Why not SDPA: PyTorch's CPU flash kernel needs the keys as one strided tensor (a gather of every
 * cached block per layer), takes a boolean mask for a chunk with a context, and computes every
 * score of a causal prompt shorter than its key split, the masked half included.
 *
 * Work: one item per (chunk, block of query rows, KV head). An item holds the query vectors of its
 * rows for the GQA group of that KV head (up to MAX_QV of them) and walks the keys in tiles of 16,
 * up to its last row's position, with an online softmax (flash attention): a tile's K is laid out
 * as pairs of dimensions by key, so one AVX-512 BF16 dot-product instruction per pair gives a
 * query's 16 scores; its V is widened to float32 once and shared by every query vector of the item.
 * Items are taken longest first (the last rows of a causal chunk see the most keys). On CPUs with
 * AVX2 and FMA but no bf16 instructions the same walk runs in tiles of 8 keys with K and V widened
 * to float32 (the products are the same exact float32 values).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_QV 64 /* query vectors an item holds: rows x heads of one GQA group */
#define QG 4      /* query vectors scored and accumulated side by side */

typedef struct {
    int chunk, row0, rows, kvh, keys; /* keys: how many the item's last row attends */
} Item;

/* An item's online-softmax state before its first key (m = -inf, l = 0) and the last key each of
 * its query vectors attends (vector r * g + gi: row r's head gi; padding vectors -1: none). */
static inline void item_state(const Item *it, int g, int context, int qvp, float *m, float *l, int *limit) {
    for (int i = 0; i < qvp; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        limit[i] = -1;
    }
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) limit[r * g + gi] = context + it->row0 + r;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_common.h"
#define HAVE_PREFILL 1
#define TILE 16   /* keys a tile scores at once */

/* One item: query rows [row0, row0 + rows) of chunk `c` (relative to its first row), the query
 * heads of KV head kvh. Query vectors go four at a time, so each K/V load feeds four of them and
 * the dot-product and FMA chains run side by side instead of waiting on one accumulator. */
static void attend_item(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, int block_size, int hkv, int d, int g, const int32_t *table,
                        int start, int context, const Item *it, uint16_t *out, int64_t out_row_stride, float scale) {
    const int qv = it->rows * g, qvp = (qv + QG - 1) / QG * QG, pairs = d / 2, chunks = d / 16;
    uint32_t qpairs[qvp * pairs]; /* query vectors as bf16 pairs: [qv][d/2] (padding: zeros) */
    float acc[qvp * d];           /* unnormalized outputs [qv][d] */
    float m[qvp], l[qvp];
    int limit[qvp];               /* the last key each query vector attends (padding: -1) */
    uint32_t kt[pairs * TILE];    /* the tile's K: [d/2][16 keys] pairs */
    float vt[TILE * d];           /* the tile's V in float32: [16 keys][d] */
    memset(qpairs, 0, sizeof(qpairs));
    item_state(it, g, context, qvp, m, l, limit);
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) {
            const int i = r * g + gi;
            const uint16_t *src = q + (int64_t)(start + it->row0 + r) * q_row_stride + (int64_t)(it->kvh * g + gi) * q_head_stride;
            memcpy(qpairs + i * pairs, src, (size_t)d * 2);
        }
    memset(acc, 0, sizeof(float) * (size_t)qvp * d);
    const int64_t token = (int64_t)hkv * d; /* elements per cached token */
    for (int t0 = 0; t0 < it->keys; t0 += TILE) {
        const int kn = it->keys - t0 < TILE ? it->keys - t0 : TILE;
        for (int j = 0; j < TILE; j++) {
            if (j < kn) {
                const int t = t0 + j;
                const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token + (int64_t)it->kvh * d;
                const uint32_t *kr = (const uint32_t *)(k_cache + at);
                for (int p = 0; p < pairs; p++) kt[p * TILE + j] = kr[p];
                for (int c = 0; c < chunks; c++) _mm512_storeu_ps(vt + j * d + c * 16, bf16x16_to_f32(v_cache + at + c * 16));
            } else {
                for (int p = 0; p < pairs; p++) kt[p * TILE + j] = 0;
                memset(vt + j * d, 0, sizeof(float) * (size_t)d);
            }
        }
        for (int i0 = 0; i0 < qvp; i0 += QG) {
            int last[QG], any = 0;
            for (int u = 0; u < QG; u++) {
                last[u] = limit[i0 + u] - t0; /* lanes 0..last are keys query i0 + u attends */
                any |= last[u] >= 0;
            }
            if (!any) continue;
            __m512 s[QG][2];
            for (int u = 0; u < QG; u++) s[u][0] = s[u][1] = _mm512_setzero_ps();
            const uint32_t *q0 = qpairs + i0 * pairs;
            for (int p = 0; p < pairs; p += 2) {
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * TILE);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (p + 1) * TILE);
                for (int u = 0; u < QG; u++) {
                    s[u][0] = _mm512_dpbf16_ps(s[u][0], k0, (__m512bh)_mm512_set1_epi32((int)q0[u * pairs + p]));
                    s[u][1] = _mm512_dpbf16_ps(s[u][1], k1, (__m512bh)_mm512_set1_epi32((int)q0[u * pairs + p + 1]));
                }
            }
            float pw[QG][TILE];
            int jn_all = 0;
            for (int u = 0; u < QG; u++) {
                const int i = i0 + u;
                if (last[u] < 0) {
                    memset(pw[u], 0, sizeof(pw[u]));
                    continue;
                }
                const int jn = last[u] + 1 < kn ? last[u] + 1 : kn; /* live lanes: 0 .. jn - 1 */
                jn_all = jn > jn_all ? jn : jn_all;
                const __mmask16 live = (__mmask16)((1u << jn) - 1);
                const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY),
                                                       _mm512_mul_ps(_mm512_add_ps(s[u][0], s[u][1]), _mm512_set1_ps(scale)));
                const float top = _mm512_reduce_max_ps(sc);
                if (top > m[i]) {
                    const float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
                    l[i] *= corr;
                    float *ai = acc + i * d;
                    for (int c = 0; c < chunks; c++)
                        _mm512_storeu_ps(ai + c * 16, _mm512_mul_ps(_mm512_loadu_ps(ai + c * 16), _mm512_set1_ps(corr)));
                    m[i] = top;
                }
                const __m512 pr = _mm512_maskz_mov_ps(live, exp_nonpos16(_mm512_sub_ps(sc, _mm512_set1_ps(m[i]))));
                l[i] += _mm512_reduce_add_ps(pr);
                _mm512_storeu_ps(pw[u], pr);
            }
            for (int cc = 0; cc < chunks; cc += 4) {
                __m512 a[QG][4];
                for (int u = 0; u < QG; u++)
                    for (int x = 0; x < 4; x++) a[u][x] = _mm512_loadu_ps(acc + (i0 + u) * d + (cc + x) * 16);
                for (int j = 0; j < jn_all; j++) {
                    __m512 v[4];
                    for (int x = 0; x < 4; x++) v[x] = _mm512_loadu_ps(vt + j * d + (cc + x) * 16);
                    for (int u = 0; u < QG; u++) {
                        const __m512 pj = _mm512_set1_ps(pw[u][j]);
                        for (int x = 0; x < 4; x++) a[u][x] = _mm512_fmadd_ps(pj, v[x], a[u][x]);
                    }
                }
                for (int u = 0; u < QG; u++)
                    for (int x = 0; x < 4; x++) _mm512_storeu_ps(acc + (i0 + u) * d + (cc + x) * 16, a[u][x]);
            }
        }
    }
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) {
            const int i = r * g + gi;
            uint16_t *dst = out + (int64_t)(start + it->row0 + r) * out_row_stride + (int64_t)(it->kvh * g + gi) * d;
            const __m512 inv = _mm512_set1_ps(1.0f / l[i]);
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_si256((__m256i *)(dst + c * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + i * d + c * 16), inv)));
        }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2_common.h"
#define HAVE_PREFILL 1
#define TILE 8 /* keys a tile scores at once: one float32 vector */

/* The AVX2 form of the item above: the same walk, tiles of 8 keys, K and V widened to float32
 * (products of bf16 values are exact in float32, as in the dot-product instruction), float32 FMAs
 * with the query vectors' values broadcast; each K/V load feeds four query vectors. */
static void attend_item(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, int block_size, int hkv, int d, int g, const int32_t *table,
                        int start, int context, const Item *it, uint16_t *out, int64_t out_row_stride, float scale) {
    const int qv = it->rows * g, qvp = (qv + QG - 1) / QG * QG, chunks = d / 8;
    float qf[qvp * d];   /* query vectors in float32 [qv][d] (padding: zeros) */
    float acc[qvp * d];  /* unnormalized outputs [qv][d] */
    float m[qvp], l[qvp];
    int limit[qvp];      /* the last key each query vector attends (padding: -1) */
    float kt[d * TILE];  /* the tile's K in float32: [d][8 keys] */
    float vt[TILE * d];  /* the tile's V in float32: [8 keys][d] */
    memset(qf, 0, sizeof(qf));
    item_state(it, g, context, qvp, m, l, limit);
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) {
            const int i = r * g + gi;
            const uint16_t *src = q + (int64_t)(start + it->row0 + r) * q_row_stride + (int64_t)(it->kvh * g + gi) * q_head_stride;
            for (int c = 0; c < d; c++) qf[i * d + c] = bf16_to_f32(src[c]);
        }
    memset(acc, 0, sizeof(float) * (size_t)qvp * d);
    const int64_t token = (int64_t)hkv * d; /* elements per cached token */
    for (int t0 = 0; t0 < it->keys; t0 += TILE) {
        const int kn = it->keys - t0 < TILE ? it->keys - t0 : TILE;
        for (int j = 0; j < TILE; j++) {
            if (j < kn) {
                const int t = t0 + j;
                const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token + (int64_t)it->kvh * d;
                for (int c = 0; c < d; c++) kt[c * TILE + j] = bf16_to_f32(k_cache[at + c]);
                for (int c = 0; c < chunks; c++) _mm256_storeu_ps(vt + j * d + c * 8, bf16x8_to_f32(v_cache + at + c * 8));
            } else {
                for (int c = 0; c < d; c++) kt[c * TILE + j] = 0.0f;
                memset(vt + j * d, 0, sizeof(float) * (size_t)d);
            }
        }
        for (int i0 = 0; i0 < qvp; i0 += QG) {
            int last[QG], any = 0;
            for (int u = 0; u < QG; u++) {
                last[u] = limit[i0 + u] - t0; /* lanes 0..last are keys query i0 + u attends */
                any |= last[u] >= 0;
            }
            if (!any) continue;
            __m256 s[QG][2];
            for (int u = 0; u < QG; u++) s[u][0] = s[u][1] = _mm256_setzero_ps();
            const float *q0 = qf + i0 * d;
            for (int c = 0; c < d; c += 2) {
                const __m256 k0 = _mm256_loadu_ps(kt + c * TILE), k1 = _mm256_loadu_ps(kt + (c + 1) * TILE);
                for (int u = 0; u < QG; u++) {
                    s[u][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + u * d + c), k0, s[u][0]);
                    s[u][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(q0 + u * d + c + 1), k1, s[u][1]);
                }
            }
            float pw[QG][TILE];
            int jn_all = 0;
            for (int u = 0; u < QG; u++) {
                const int i = i0 + u;
                if (last[u] < 0) {
                    memset(pw[u], 0, sizeof(pw[u]));
                    continue;
                }
                const int jn = last[u] + 1 < kn ? last[u] + 1 : kn; /* live lanes: 0 .. jn - 1 */
                jn_all = jn > jn_all ? jn : jn_all;
                const __m256 live = _mm256_castsi256_ps(
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(jn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
                const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                   _mm256_mul_ps(_mm256_add_ps(s[u][0], s[u][1]), _mm256_set1_ps(scale)),
                                                   live);
                const float top = hmax8(sc);
                if (top > m[i]) {
                    const float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
                    l[i] *= corr;
                    float *ai = acc + i * d;
                    for (int c = 0; c < chunks; c++)
                        _mm256_storeu_ps(ai + c * 8, _mm256_mul_ps(_mm256_loadu_ps(ai + c * 8), _mm256_set1_ps(corr)));
                    m[i] = top;
                }
                const __m256 pr = _mm256_and_ps(live, exp_nonpos8(_mm256_sub_ps(sc, _mm256_set1_ps(m[i]))));
                l[i] += hsum8(pr);
                _mm256_storeu_ps(pw[u], pr);
            }
            for (int cc = 0; cc < chunks; cc += 2) {
                __m256 a[QG][2];
                for (int u = 0; u < QG; u++)
                    for (int x = 0; x < 2; x++) a[u][x] = _mm256_loadu_ps(acc + (i0 + u) * d + (cc + x) * 8);
                for (int j = 0; j < jn_all; j++) {
                    const __m256 v0 = _mm256_loadu_ps(vt + j * d + cc * 8), v1 = _mm256_loadu_ps(vt + j * d + cc * 8 + 8);
                    for (int u = 0; u < QG; u++) {
                        const __m256 pj = _mm256_set1_ps(pw[u][j]);
                        a[u][0] = _mm256_fmadd_ps(pj, v0, a[u][0]);
                        a[u][1] = _mm256_fmadd_ps(pj, v1, a[u][1]);
                    }
                }
                for (int u = 0; u < QG; u++)
                    for (int x = 0; x < 2; x++) _mm256_storeu_ps(acc + (i0 + u) * d + (cc + x) * 8, a[u][x]);
            }
        }
    }
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) {
            const int i = r * g + gi;
            uint16_t *dst = out + (int64_t)(start + it->row0 + r) * out_row_stride + (int64_t)(it->kvh * g + gi) * d;
            const float inv = 1.0f / l[i];
            for (int c = 0; c < d; c++) dst[c] = f32_to_bf16(acc[i * d + c] * inv);
        }
}
#endif

#if defined(HAVE_PREFILL)
int lmf_paged_prefill_supported(void) { return 1; }

/* Attention for `n_chunks` chunks: chunk c is rows starts[c] .. starts[c] + lens[c] - 1 of q and
 * out ([T, Hq, D], heads of D contiguous), with contexts[c] cached tokens before it and its blocks
 * in row c of `tables`. `items` is caller-provided room for sum_c ceil(lens[c] / rows per item) *
 * hkv entries (lmf_paged_prefill_items gives the count). Returns 0, or -1 for an unsupported
 * argument (nothing is written then). */
int lmf_paged_prefill_items(const int32_t *lens, int n_chunks, int hq, int hkv) {
    if (hkv <= 0 || hq % hkv != 0 || hq / hkv > MAX_QV) return -1;
    const int rows = MAX_QV / (hq / hkv) < 16 ? MAX_QV / (hq / hkv) : 16;
    int total = 0;
    for (int c = 0; c < n_chunks; c++) total += (lens[c] + rows - 1) / rows * hkv;
    return total;
}

int lmf_paged_prefill(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, int block_size, int hq, int hkv, int d, const int32_t *tables,
                      int64_t table_stride, const int32_t *starts, const int32_t *lens, const int32_t *contexts,
                      int n_chunks, uint16_t *out, int64_t out_row_stride, float scale, void *items_room, int threads) {
    if (hkv <= 0 || hq % hkv != 0 || d <= 0 || d > 512 || d % 64 != 0 || block_size <= 0 || hq / hkv > MAX_QV)
        return -1;
    const int g = hq / hkv;
    const int rows = MAX_QV / g < 16 ? MAX_QV / g : 16;
    Item *items = (Item *)items_room;
    int n = 0;
    /* longest first: within a chunk the last row blocks see the most keys */
    for (int c = 0; c < n_chunks; c++)
        for (int r0 = (lens[c] - 1) / rows * rows; r0 >= 0; r0 -= rows)
            for (int h = 0; h < hkv; h++) {
                const int nr = lens[c] - r0 < rows ? lens[c] - r0 : rows;
                items[n++] = (Item){c, r0, nr, h, contexts[c] + r0 + nr};
            }
    /* a stable order by descending keys would balance best; chunks are few, so interleave by
     * sorting items on keys (insertion sort on a short list is cheap next to the attention) */
    for (int i = 1; i < n; i++) {
        const Item x = items[i];
        int j = i - 1;
        while (j >= 0 && items[j].keys < x.keys) {
            items[j + 1] = items[j];
            j--;
        }
        items[j + 1] = x;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int i = 0; i < n; i++) {
        const Item *it = items + i;
        attend_item(q, q_row_stride, q_head_stride, k_cache, v_cache, block_size, hkv, d, g,
                    tables + (int64_t)it->chunk * table_stride, starts[it->chunk], contexts[it->chunk], it, out,
                    out_row_stride, scale);
    }
    return 0;
}
#else
int lmf_paged_prefill_supported(void) { return 0; }

int lmf_paged_prefill_items(const int32_t *lens, int n_chunks, int hq, int hkv) {
    (void)lens, (void)n_chunks, (void)hq, (void)hkv;
    return -1;
}

int lmf_paged_prefill(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, int block_size, int hq, int hkv, int d, const int32_t *tables,
                      int64_t table_stride, const int32_t *starts, const int32_t *lens, const int32_t *contexts,
                      int n_chunks, uint16_t *out, int64_t out_row_stride, float scale, void *items_room, int threads) {
    (void)q, (void)q_row_stride, (void)q_head_stride, (void)k_cache, (void)v_cache, (void)block_size, (void)hq,
        (void)hkv, (void)d, (void)tables, (void)table_stride, (void)starts, (void)lens, (void)contexts,
        (void)n_chunks, (void)out, (void)out_row_stride, (void)scale, (void)items_room, (void)threads;
    return -1;
}
#endif
