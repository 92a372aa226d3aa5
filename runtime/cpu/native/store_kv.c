/* Write a step's new K and V rows into their slots of the paged cache (float storage in the
 * model's dtype: a copy per row and KV head). Slots < 0 (padding) are skipped.
 *
 * One call per layer instead of the index_copy_ pair with its casts and views: a decode step
 * writes one row per sequence, so what the write costs is the per-op overhead, not the bytes.
 */
#include <stdint.h>
#include <string.h>

void lmf_store_kv(const char *k, int64_t k_row_stride, int64_t k_head_stride, const char *v, int64_t v_row_stride,
                  int64_t v_head_stride, char *k_cache, char *v_cache, const int64_t *slots, int64_t n, int hkv, int d,
                  int esize) {
    const int64_t row = (int64_t)d * esize, token = (int64_t)hkv * row;
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int h = 0; h < hkv; h++) {
            memcpy(k_cache + slot * token + h * row, k + (t * k_row_stride + h * k_head_stride) * esize, (size_t)row);
            memcpy(v_cache + slot * token + h * row, v + (t * v_row_stride + h * v_head_stride) * esize, (size_t)row);
        }
    }
}
