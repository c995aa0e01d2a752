/* Prefill attention in bf16 dot products (AVX512-BF16), flash style, on the CPU.
 *
 * The queries of one request against its context: query token t attends keys [0, limits[t]) (its
 * position + 1 where key column = position, so causal prefill, a chunk over cached context and a
 * round's scattered recomputed tokens are all one call, with no mask tensor).
 *
 * Scores and the weighted sum of values are computed with vdpbf16ps: 32 bf16 products summed
 * into 16 float32 lanes per instruction, twice the float32 FMA rate, and no bf16 -> float32
 * conversion of keys or values. The softmax is float32 (online, per block of 64 keys); the
 * probabilities are rounded to bf16 for the value product, as PyTorch's bf16 flash kernel does.
 *
 * Keys and values are read from the KV pool through the request's slots; a key stored for another
 * position than it is read at (shared KV) is rotated while it is packed.
 *
 * Layout: each KV head's keys are first packed as [tile of 16 keys][dimension pair][key] (a pair
 * of dimensions per 32-bit lane), values as [key pair][dimension][key of the pair]. Work items are
 * (KV head, ROWS query rows), a row being one query head of one token; each item keeps its rows'
 * softmax states and outputs in registers over the whole context.
 *
 * Built only where the CPU has AVX512-BF16 (tokendance/model/kernels/__init__.py); elsewhere
 * attention runs in PyTorch's SDPA.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define DIM 64          /* head dimension this kernel is built for */
#define PAIRS (DIM / 2) /* dimension pairs */
#define ROWS 6          /* query rows per work item */
#define BLOCK 64        /* keys per softmax block */
#define TILES (BLOCK / 16)

typedef struct { /* where key j's row is: keys[slots[j]] (keys[j] without slots), stored for position
                  * positions[slots[j]] and read at position j: rotated by the difference */
    const uint16_t *keys, *values;
    const int64_t *slots, *positions;
    const float *shift_cos, *shift_sin; /* [2 * max_shift + 1][DIM / 2] */
    int64_t max_shift, num_kv_heads;
} Source;

/* Key j of KV head h at position j, as bf16 pairs: RoPE pairs (i, i + DIM/2) rotated in float32 by
 * the shift between where it is read and where it was stored, then rounded to bf16. */
static void read_key(const Source *s, int64_t j, int64_t h, uint16_t *out) {
    const int64_t slot = s->slots ? s->slots[j] : j;
    const uint16_t *row = s->keys + (slot * s->num_kv_heads + h) * DIM;
    const int64_t shift = s->slots ? j - s->positions[slot] : 0;
    if (shift == 0) {
        memcpy(out, row, sizeof(uint16_t) * DIM);
        return;
    }
    const float *cos = s->shift_cos + (shift + s->max_shift) * (DIM / 2), *sin = s->shift_sin + (shift + s->max_shift) * (DIM / 2);
    for (int64_t i = 0; i < DIM / 2; i++) {
        const float a = bf16_to_float(row[i]), b = bf16_to_float(row[i + DIM / 2]);
        out[i] = float_to_bf16(a * cos[i] - b * sin[i]);
        out[i + DIM / 2] = float_to_bf16(b * cos[i] + a * sin[i]);
    }
}

/* Keys -> packed [num_kv_heads][tiles][PAIRS][16] 32-bit pairs; values -> [num_kv_heads][pairs of
 * keys][DIM][2] bf16. Keys past num_keys are zero. */
static void pack(const Source *s, int64_t num_keys, int64_t padded, uint32_t *packed_keys, uint16_t *packed_values,
                 int num_threads) {
    const int64_t tiles = padded / 16, num_kv_heads = s->num_kv_heads;
#pragma omp parallel for collapse(2) num_threads(num_threads)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t tile = 0; tile < tiles; tile++) {
            uint32_t *kt = packed_keys + (h * tiles + tile) * PAIRS * 16;
            uint16_t *vt = packed_values + (h * padded + tile * 16) * DIM;
            uint32_t key[PAIRS];
            for (int64_t j = 0; j < 16; j++) {
                const int64_t index = tile * 16 + j;
                if (index < num_keys) {
                    read_key(s, index, h, (uint16_t *)key);
                    const int64_t slot = s->slots ? s->slots[index] : index;
                    const uint16_t *value = s->values + (slot * num_kv_heads + h) * DIM;
                    for (int64_t p = 0; p < PAIRS; p++) kt[p * 16 + j] = key[p];
                    for (int64_t d = 0; d < DIM; d++) vt[((j / 2) * DIM + d) * 2 + (j % 2)] = value[d];
                } else {
                    for (int64_t p = 0; p < PAIRS; p++) kt[p * 16 + j] = 0;
                    for (int64_t d = 0; d < DIM; d++) vt[((j / 2) * DIM + d) * 2 + (j % 2)] = 0;
                }
            }
        }
    }
}

/* One work item: query rows [first, first + count) of KV head h (row r = token r / group, query
 * head h * group + r % group), over its keys. */
static void item(const uint16_t *q, const uint32_t *packed_keys, const uint16_t *packed_values,
                 const int64_t *limits, int64_t num_heads, int64_t group, int64_t h, int64_t first, int64_t count,
                 int64_t tiles, int64_t padded, float scale, float *out) {
    const uint32_t *query[ROWS];
    int64_t limit[ROWS], most = 0, least = INT64_MAX;
    for (int64_t r = 0; r < ROWS; r++) {
        const int64_t row = first + (r < count ? r : 0), token = row / group;
        query[r] = (const uint32_t *)(q + (token * num_heads + h * group + row % group) * DIM);
        limit[r] = limits[token];
        if (limit[r] > most) most = limit[r];
        if (limit[r] < least) least = limit[r];
    }
    const uint32_t *keys = packed_keys + h * tiles * PAIRS * 16;
    const uint16_t *values = packed_values + h * padded * DIM;
    __m512 acc[ROWS][DIM / 16];
    float m[ROWS], l[ROWS];
    for (int64_t r = 0; r < ROWS; r++) {
        m[r] = -INFINITY, l[r] = 0.0f;
        for (int64_t j = 0; j < DIM / 16; j++) acc[r][j] = _mm512_setzero_ps();
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint32_t probability_pairs[ROWS][BLOCK / 2] __attribute__((aligned(64)));
    for (int64_t start = 0; start < most; start += BLOCK) {
        const uint32_t *k0 = keys + (start / 16) * PAIRS * 16;
        __m512 s[ROWS][TILES];
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t t = 0; t < TILES; t++) s[r][t] = _mm512_setzero_ps();
        for (int64_t p = 0; p < PAIRS; p++) {
            __m512bh k[TILES];
            for (int64_t t = 0; t < TILES; t++) k[t] = (__m512bh)_mm512_load_si512(k0 + (t * PAIRS + p) * 16);
            for (int64_t r = 0; r < ROWS; r++) {
                const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)query[r][p]);
                for (int64_t t = 0; t < TILES; t++) s[r][t] = _mm512_dpbf16_ps(s[r][t], qp, k[t]);
            }
        }
        for (int64_t r = 0; r < ROWS; r++) {
            __mmask16 valid[TILES];
            __m512 block_max = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < TILES; t++) {
                valid[t] = 0xFFFF;
                if (start + BLOCK > least) { /* some keys of this block are past some rows' limits */
                    const __m512i bound = _mm512_set1_epi32((int)(limit[r] - start - 16 * t));
                    valid[t] = _mm512_cmplt_epi32_mask(lane, bound);
                    s[r][t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[t], s[r][t]);
                }
                block_max = _mm512_max_ps(block_max, s[r][t]);
            }
            /* scores are unscaled here: the scale is applied inside the exponent */
            const float top = _mm512_reduce_max_ps(block_max) * scale;
            if (top > m[r]) { /* a new max: rescale what was summed so far (most blocks keep it) */
                const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - top);
                l[r] *= alpha;
                const __m512 a = _mm512_set1_ps(alpha);
                for (int64_t j = 0; j < DIM / 16; j++) acc[r][j] = _mm512_mul_ps(acc[r][j], a);
                m[r] = top;
            }
            const __m512 shift = _mm512_set1_ps(m[r] == -INFINITY ? 0.0f : m[r]), scaled = _mm512_set1_ps(scale);
            __m512 p[TILES], total = _mm512_setzero_ps();
            for (int64_t t = 0; t < TILES; t++) {
                p[t] = _mm512_maskz_mov_ps(valid[t], exp512_nonpositive(_mm512_fmsub_ps(s[r][t], scaled, shift)));
                total = _mm512_add_ps(total, p[t]);
            }
            l[r] += _mm512_reduce_add_ps(total);
            for (int64_t t = 0; t < TILES; t += 2)
                _mm512_store_si512(probability_pairs[r] + t * 8, (__m512i)_mm512_cvtne2ps_pbh(p[t + 1], p[t]));
        }
        const uint16_t *v = values + start * DIM;
        for (int64_t pair = 0; pair < BLOCK / 2; pair++) {
            __m512bh vp[DIM / 16];
            for (int64_t j = 0; j < DIM / 16; j++) vp[j] = (__m512bh)_mm512_loadu_si512(v + (pair * DIM + j * 16) * 2);
            for (int64_t r = 0; r < ROWS; r++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)probability_pairs[r][pair]);
                for (int64_t j = 0; j < DIM / 16; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pp, vp[j]);
            }
        }
    }
    for (int64_t r = 0; r < count; r++) {
        const int64_t row = first + r, token = row / group;
        float *dst = out + (token * num_heads + h * group + row % group) * DIM;
        const __m512 inverse = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (int64_t j = 0; j < DIM / 16; j++) _mm512_storeu_ps(dst + j * 16, _mm512_mul_ps(acc[r][j], inverse));
    }
}

/* q:      [num_queries, num_heads, DIM] bf16, contiguous
 * keys, values: the KV pool [num_slots, num_kv_heads, DIM] bf16 read through slots, or (slots
 *         NULL) the context itself [num_keys, num_kv_heads, DIM], key j at position j
 * slots:  [num_keys] int64 or NULL; slot_positions: [num_slots] int64, the position each key was
 *         stored for (keys read at other positions are rotated; unused without slots)
 * shift_cos, shift_sin: [2 * max_shift + 1, DIM / 2] float32, the rotation by d at row d + max_shift
 * limits: [num_queries] int64, query t attends keys [0, limits[t]), 1 <= limits[t] <= num_keys
 * out:    [num_queries, num_heads, DIM] float32
 * Returns 0, -1 for a shape it does not support, -2 when out of memory. */
int prefill_attention_bf16(const uint16_t *q, const uint16_t *keys, const uint16_t *values, const int64_t *slots,
                           const int64_t *slot_positions, const float *shift_cos, const float *shift_sin,
                           int64_t max_shift, const int64_t *limits, int64_t num_queries, int64_t num_keys,
                           int64_t num_heads, int64_t num_kv_heads, int64_t dim, float scale, int num_threads,
                           float *out) {
    if (dim != DIM || num_kv_heads <= 0 || num_heads % num_kv_heads) return -1;
    const int64_t group = num_heads / num_kv_heads, padded = (num_keys + BLOCK - 1) / BLOCK * BLOCK;
    uint32_t *packed_keys = aligned_alloc(64, sizeof(uint32_t) * num_kv_heads * padded * PAIRS);
    uint16_t *packed_values = aligned_alloc(64, sizeof(uint16_t) * num_kv_heads * padded * DIM);
    if (!packed_keys || !packed_values) {
        free(packed_keys), free(packed_values);
        return -2;
    }
    const Source source = {keys, values, slots, slot_positions, shift_cos, shift_sin, max_shift, num_kv_heads};
    pack(&source, num_keys, padded, packed_keys, packed_values, num_threads);
    const int64_t rows = num_queries * group, per_head = (rows + ROWS - 1) / ROWS;
    /* the last items (latest tokens, most keys) first: the longest work is not left for the end */
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t index = 0; index < num_kv_heads * per_head; index++) {
        const int64_t h = index % num_kv_heads, first = (per_head - 1 - index / num_kv_heads) * ROWS;
        const int64_t count = rows - first < ROWS ? rows - first : ROWS;
        item(q, packed_keys, packed_values, limits, num_heads, group, h, first, count, padded / 16, padded, scale, out);
    }
    free(packed_keys), free(packed_values);
    return 0;
}
