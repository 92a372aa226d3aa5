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
 * AVX2 and FMA but no bf16 instructions the same walk runs with K and V widened to float32 (the
 * products are the same exact float32 values), six query vectors against 16 keys at a time.
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
#define TILE 16 /* keys a tile scores at once: two float32 vectors */
#define QA 6    /* query vectors per pass: 6 x 2 accumulators, the shape of the FMA GEMM's 6 x 16 tile */

/* The scores of QA query vectors (q0 + u * d) against a tile's 16 keys (kt: [d][16] float32), one
 * FMA chain per score in dimension order. The accumulators are locals, not an array, so that they
 * stay in registers (GCC stores an array of them back every iteration); each pair of K loads and
 * six broadcasts feed twelve FMAs. */
static inline __attribute__((always_inline)) void score_tile(const float *q0, int d, const float *kt, __m256 lo[QA],
                                                             __m256 hi[QA]) {
    __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0;
    __m256 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0;
    for (int c = 0; c < d; c++) {
        const __m256 k0 = _mm256_loadu_ps(kt + c * TILE), k1 = _mm256_loadu_ps(kt + c * TILE + 8);
        __m256 x = _mm256_broadcast_ss(q0 + c);
        l0 = _mm256_fmadd_ps(x, k0, l0), h0 = _mm256_fmadd_ps(x, k1, h0);
        x = _mm256_broadcast_ss(q0 + d + c);
        l1 = _mm256_fmadd_ps(x, k0, l1), h1 = _mm256_fmadd_ps(x, k1, h1);
        x = _mm256_broadcast_ss(q0 + 2 * d + c);
        l2 = _mm256_fmadd_ps(x, k0, l2), h2 = _mm256_fmadd_ps(x, k1, h2);
        x = _mm256_broadcast_ss(q0 + 3 * d + c);
        l3 = _mm256_fmadd_ps(x, k0, l3), h3 = _mm256_fmadd_ps(x, k1, h3);
        x = _mm256_broadcast_ss(q0 + 4 * d + c);
        l4 = _mm256_fmadd_ps(x, k0, l4), h4 = _mm256_fmadd_ps(x, k1, h4);
        x = _mm256_broadcast_ss(q0 + 5 * d + c);
        l5 = _mm256_fmadd_ps(x, k0, l5), h5 = _mm256_fmadd_ps(x, k1, h5);
    }
    lo[0] = l0, lo[1] = l1, lo[2] = l2, lo[3] = l3, lo[4] = l4, lo[5] = l5;
    hi[0] = h0, hi[1] = h1, hi[2] = h2, hi[3] = h3, hi[4] = h4, hi[5] = h5;
}

/* a[u][0..16) += sum over the tile's first jn keys of pw[u][j] * vt[j][0..16) for QA query
 * vectors' 16 output dimensions (a: their accumulator rows, stride d), key after key. */
static inline __attribute__((always_inline)) void pv_tile(const float (*pw)[TILE], int jn, const float *vt, int d,
                                                          float *a) {
    __m256 l0 = _mm256_loadu_ps(a), l1 = _mm256_loadu_ps(a + d), l2 = _mm256_loadu_ps(a + 2 * d);
    __m256 l3 = _mm256_loadu_ps(a + 3 * d), l4 = _mm256_loadu_ps(a + 4 * d), l5 = _mm256_loadu_ps(a + 5 * d);
    __m256 h0 = _mm256_loadu_ps(a + 8), h1 = _mm256_loadu_ps(a + d + 8), h2 = _mm256_loadu_ps(a + 2 * d + 8);
    __m256 h3 = _mm256_loadu_ps(a + 3 * d + 8), h4 = _mm256_loadu_ps(a + 4 * d + 8);
    __m256 h5 = _mm256_loadu_ps(a + 5 * d + 8);
    for (int j = 0; j < jn; j++) {
        const __m256 v0 = _mm256_loadu_ps(vt + j * d), v1 = _mm256_loadu_ps(vt + j * d + 8);
        __m256 p = _mm256_broadcast_ss(pw[0] + j);
        l0 = _mm256_fmadd_ps(p, v0, l0), h0 = _mm256_fmadd_ps(p, v1, h0);
        p = _mm256_broadcast_ss(pw[1] + j);
        l1 = _mm256_fmadd_ps(p, v0, l1), h1 = _mm256_fmadd_ps(p, v1, h1);
        p = _mm256_broadcast_ss(pw[2] + j);
        l2 = _mm256_fmadd_ps(p, v0, l2), h2 = _mm256_fmadd_ps(p, v1, h2);
        p = _mm256_broadcast_ss(pw[3] + j);
        l3 = _mm256_fmadd_ps(p, v0, l3), h3 = _mm256_fmadd_ps(p, v1, h3);
        p = _mm256_broadcast_ss(pw[4] + j);
        l4 = _mm256_fmadd_ps(p, v0, l4), h4 = _mm256_fmadd_ps(p, v1, h4);
        p = _mm256_broadcast_ss(pw[5] + j);
        l5 = _mm256_fmadd_ps(p, v0, l5), h5 = _mm256_fmadd_ps(p, v1, h5);
    }
    _mm256_storeu_ps(a, l0), _mm256_storeu_ps(a + d, l1), _mm256_storeu_ps(a + 2 * d, l2);
    _mm256_storeu_ps(a + 3 * d, l3), _mm256_storeu_ps(a + 4 * d, l4), _mm256_storeu_ps(a + 5 * d, l5);
    _mm256_storeu_ps(a + 8, h0), _mm256_storeu_ps(a + d + 8, h1), _mm256_storeu_ps(a + 2 * d + 8, h2);
    _mm256_storeu_ps(a + 3 * d + 8, h3), _mm256_storeu_ps(a + 4 * d + 8, h4), _mm256_storeu_ps(a + 5 * d + 8, h5);
}

/* The AVX2 form of the item above: the same walk in tiles of 16 keys, K and V widened to float32
 * (products of bf16 values are exact in float32, as in the dot-product instruction), float32 FMAs
 * with the query vectors' values broadcast; each K/V load feeds six query vectors. */
static void attend_item(const uint16_t *q, int64_t q_row_stride, int64_t q_head_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, int block_size, int hkv, int d, int g, const int32_t *table,
                        int start, int context, const Item *it, uint16_t *out, int64_t out_row_stride, float scale) {
    const int qv = it->rows * g, qvp = (qv + QA - 1) / QA * QA, chunks = d / 8;
    float qf[qvp * d];   /* query vectors in float32 [qv][d] (padding: zeros) */
    float acc[qvp * d];  /* unnormalized outputs [qv][d] */
    float m[qvp], l[qvp];
    int limit[qvp];      /* the last key each query vector attends (padding: -1) */
    float kt[d * TILE];  /* the tile's K in float32: [d][16 keys] */
    float vt[TILE * d];  /* the tile's V in float32: [16 keys][d] */
    memset(qf, 0, sizeof(qf));
    item_state(it, g, context, qvp, m, l, limit);
    for (int r = 0; r < it->rows; r++)
        for (int gi = 0; gi < g; gi++) {
            const int i = r * g + gi;
            const uint16_t *src = q + (int64_t)(start + it->row0 + r) * q_row_stride + (int64_t)(it->kvh * g + gi) * q_head_stride;
            for (int c = 0; c < chunks; c++) _mm256_storeu_ps(qf + i * d + c * 8, bf16x8_to_f32(src + c * 8));
        }
    memset(acc, 0, sizeof(float) * (size_t)qvp * d);
    const int64_t token = (int64_t)hkv * d; /* elements per cached token */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
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
        for (int i0 = 0; i0 < qvp; i0 += QA) {
            int any = 0;
            for (int u = 0; u < QA; u++) any |= limit[i0 + u] >= t0;
            if (!any) continue;
            __m256 slo[QA], shi[QA];
            score_tile(qf + i0 * d, d, kt, slo, shi);
            float pw[QA][TILE];
            int jn_all = 0;
            for (int u = 0; u < QA; u++) {
                const int i = i0 + u, last = limit[i] - t0; /* keys 0..last of the tile are attended */
                if (last < 0) {
                    memset(pw[u], 0, sizeof(pw[u]));
                    continue;
                }
                const int jn = last + 1 < kn ? last + 1 : kn; /* live lanes: 0 .. jn - 1 */
                jn_all = jn > jn_all ? jn : jn_all;
                const __m256 live_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(jn), lane));
                const __m256 live_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(jn - 8), lane));
                const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
                const __m256 sc_lo = _mm256_blendv_ps(ninf, _mm256_mul_ps(slo[u], vs), live_lo);
                const __m256 sc_hi = _mm256_blendv_ps(ninf, _mm256_mul_ps(shi[u], vs), live_hi);
                const float top = hmax8(_mm256_max_ps(sc_lo, sc_hi));
                if (top > m[i]) {
                    const float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - top);
                    l[i] *= corr;
                    float *ai = acc + i * d;
                    for (int c = 0; c < chunks; c++)
                        _mm256_storeu_ps(ai + c * 8, _mm256_mul_ps(_mm256_loadu_ps(ai + c * 8), _mm256_set1_ps(corr)));
                    m[i] = top;
                }
                const __m256 mi = _mm256_set1_ps(m[i]);
                const __m256 p_lo = _mm256_and_ps(live_lo, exp_nonpos8(_mm256_sub_ps(sc_lo, mi)));
                const __m256 p_hi = _mm256_and_ps(live_hi, exp_nonpos8(_mm256_sub_ps(sc_hi, mi)));
                l[i] += hsum8(_mm256_add_ps(p_lo, p_hi));
                _mm256_storeu_ps(pw[u], p_lo);
                _mm256_storeu_ps(pw[u] + 8, p_hi);
            }
            for (int c = 0; c < d; c += 16) pv_tile((const float(*)[TILE])pw, jn_all, vt + c, d, acc + i0 * d + c);
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
