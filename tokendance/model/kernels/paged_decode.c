/* Paged decode attention on the CPU, collective over shared KV.
 *
 * One query token per request. Keys and values are read in place from the KV pool through each
 * request's slot table (no gather copy). A key stored for another position than it is read at is
 * corrected by rotating the query instead of the key (RoPE rotations compose):
 *     q . R(d) k  ==  (R(-d) q) . k        d = read position - stored position
 * so the query is rotated once per run of equally shifted keys, not once per key.
 *
 * Collective reads: a run of consecutive slots read by several requests in this step (a master
 * span that every agent's table points at, wherever it sits in their prompts) is one work item:
 * each chunk of its keys and values is loaded once and used by all its readers (each with its own
 * rotated query). The rest of each request's context is its private work item. Every item yields
 * partial softmax states (max, sum of exp, weighted values) per reader, merged per request by
 * log-sum-exp, as cascade / flash-decoding attention does.
 *
 * Built at first use by tokendance/model/kernels/__init__.py (gcc -O3 -march=native -fopenmp);
 * called through ctypes with raw pointers.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_HEADS 16 /* KV heads */
#define CHUNK 64
#define MIN_SHARED_RUN 32 /* shorter runs stay in their request's private item */
#define MAX_RUN (4 * CHUNK) /* longer runs are cut into items of this length, so threads share them */

typedef struct {
    const void *keys, *values;
    int bf16;
    const int64_t *slot_positions;
    const float *shift_cos, *shift_sin;
    int64_t max_shift, num_heads, num_kv_heads, group, dim;
    float scale;
} Context;

typedef struct { /* softmax state of one query head over part of the keys */
    float max, sum;
    float acc[MAX_DIM];
} State;

typedef struct {
    int64_t slot_start, length, first_reader, num_readers;
} Run;

typedef struct {
    int64_t request, column, shift, next;
} Reader;

typedef struct { /* a request's run of consecutive slots [start, end) with one shift */
    int64_t start, end, request, column, shift;
} Piece;

static int compare_pieces(const void *a, const void *b) {
    const int64_t x = ((const Piece *)a)->start, y = ((const Piece *)b)->start;
    return (x > y) - (x < y);
}

static int compare_int64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Makes room for `needed` items of `size` bytes in *array (capacity *capacity); 0 when out of memory. */
static int grow(void **array, int64_t *capacity, int64_t needed, size_t size) {
    if (needed <= *capacity) return 1;
    void *grown = realloc(*array, size * 2 * needed);
    if (!grown) return 0;
    *array = grown, *capacity = 2 * needed;
    return 1;
}

/* Row `slot` of one KV head as float32: a pointer into the pool (float32) or a converted copy. */
static inline __attribute__((always_inline)) const float *row_f32(const Context *c, const void *cache, int64_t dim,
                                                                   int64_t slot, int64_t head, float *buffer) {
    const int64_t offset = (slot * c->num_kv_heads + head) * dim;
    if (!c->bf16) return (const float *)cache + offset;
    const uint16_t *src = (const uint16_t *)cache + offset;
    for (int64_t i = 0; i < dim; i++) buffer[i] = bf16_to_float(src[i]);
    return buffer;
}

/* The group's queries, scaled, rotated by -shift (into `out`). */
static void rotate_queries(const Context *c, const float *q, int64_t shift, float out[][MAX_DIM]) {
    const int64_t half = c->dim / 2;
    const float *cs = c->shift_cos + (shift + c->max_shift) * half;
    const float *sn = c->shift_sin + (shift + c->max_shift) * half;
    for (int64_t g = 0; g < c->group; g++) {
        const float *x = q + g * c->dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i] * c->scale, b = x[i + half] * c->scale;
            out[g][i] = shift ? a * cs[i] + b * sn[i] : a;
            out[g][i + half] = shift ? b * cs[i] - a * sn[i] : b;
        }
    }
}

static void init_states(const Context *c, State *states) {
    for (int64_t g = 0; g < c->group; g++) {
        states[g].max = -INFINITY;
        states[g].sum = 0.0f;
        memset(states[g].acc, 0, sizeof(float) * c->dim);
    }
}

/* Fold one chunk of n scores per query (turned into weights in place) into the states' max and
 * sum, rescaling their accumulators; the values are added after. */
static inline __attribute__((always_inline)) void softmax_chunk(int64_t dim, int64_t group, float scores[][CHUNK],
                                                                int64_t n, State *states) {
    for (int64_t g = 0; g < group; g++) {
        State *s = &states[g];
        float chunk_max = s->max;
        for (int64_t k = 0; k < n; k++) chunk_max = scores[g][k] > chunk_max ? scores[g][k] : chunk_max;
        const float correction = exp_nonpositive(s->max - chunk_max);
        s->sum *= correction;
        for (int64_t i = 0; i < dim; i++) s->acc[i] *= correction;
        s->max = chunk_max;
        float sum = 0.0f;
        for (int64_t k = 0; k < n; k++) {
            scores[g][k] = exp_nonpositive(scores[g][k] - chunk_max);
            sum += scores[g][k];
        }
        s->sum += sum;
    }
}

static inline __attribute__((always_inline)) void prefetch_slot(const Context *c, const void *cache, int64_t dim,
                                                                int64_t slot) {
    const int64_t bytes = c->num_kv_heads * dim * (c->bf16 ? 2 : 4);
    const char *row = (const char *)cache + slot * bytes;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
}

enum { AHEAD = 4 }; /* rows prefetched ahead of the one read */

/* The same into L2, for a row read a while later (a chunk's values while its scores are computed). */
static inline __attribute__((always_inline)) void prefetch_slot_l2(const Context *c, const void *cache, int64_t dim,
                                                                   int64_t slot) {
    const int64_t bytes = c->num_kv_heads * dim * (c->bf16 ? 2 : 4);
    const char *row = (const char *)cache + slot * bytes;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset, 0, 2);
}

/* Scores of one chunk of n <= CHUNK keys, given by slot and read in place for all KV heads (a
 * slot's heads are contiguous in the pool), against each head's group of rotated queries: one
 * dot product per key and query, reduced across the head dimension, nothing transposed or copied
 * but bf16 -> float32. q: [num_kv_heads][group][dim]; scores: [num_kv_heads * group][CHUNK]. */
static inline __attribute__((always_inline)) void score_rows(const Context *c, int64_t dim, int64_t group,
                                                             float q[][MAX_GROUP][MAX_DIM], const int64_t *slots,
                                                             int64_t n, float scores[][CHUNK]) {
    float buffer[MAX_DIM] __attribute__((aligned(64)));
    for (int64_t k = 0; k < n; k++) {
        if (k + AHEAD < n) prefetch_slot(c, c->keys, dim, slots[k + AHEAD]);
        prefetch_slot_l2(c, c->values, dim, slots[k]); /* read after this chunk's scores */
        for (int64_t h = 0; h < c->num_kv_heads; h++) {
            const float *key = row_f32(c, c->keys, dim, slots[k], h, buffer);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
                for (int64_t i = 0; i < dim; i++) dot += q[h][g][i] * key[i];
                scores[h * group + g][k] = dot;
            }
        }
    }
}

/* The same from keys transposed once per chunk (kt: [num_kv_heads][dim][CHUNK], zero from n to
 * `width`, n rounded up to a multiple of 16): for a chunk read by many queries, scores vectorize
 * over the keys with no reductions. */
static inline __attribute__((always_inline)) void score_transposed(int64_t num_kv_heads, int64_t dim, int64_t group,
                                                                   float q[][MAX_GROUP][MAX_DIM],
                                                                   const float *restrict kt, int64_t width,
                                                                   float scores[][CHUNK]) {
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t g = 0; g < group; g++) {
            float s[CHUNK] __attribute__((aligned(64))) = {0};
            for (int64_t i = 0; i < dim; i++) {
                const float qi = q[h][g][i];
                const float *row = kt + (h * dim + i) * CHUNK;
                for (int64_t k = 0; k < width; k++) s[k] += qi * row[k];
            }
            for (int64_t k = 0; k < width; k++) scores[h * group + g][k] = s[k];
        }
    }
}

/* Softmax-fold the chunk's scores into the states and add its values: read in place by slot
 * (values_f32 == NULL) or from a float32 copy ([num_kv_heads][CHUNK][dim]). */
static inline __attribute__((always_inline)) void accumulate(const Context *c, int64_t dim, int64_t group,
                                                             float scores[][CHUNK], const int64_t *slots,
                                                             const float *values_f32, int64_t n,
                                                             State *restrict states) {
    const int64_t num_kv_heads = c->num_kv_heads;
    float buffer[MAX_DIM] __attribute__((aligned(64)));
    if (!values_f32)
        for (int64_t k = 0; k < AHEAD && k < n; k++) prefetch_slot(c, c->values, dim, slots[k]);
    softmax_chunk(dim, num_kv_heads * group, scores, n, states);
    for (int64_t h = 0; h < num_kv_heads; h++) {
        float acc[MAX_GROUP][MAX_DIM] __attribute__((aligned(64)));
        State *head_states = states + h * group;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < dim; i++) acc[g][i] = head_states[g].acc[i];
        for (int64_t k = 0; k < n; k++) {
            const float *value;
            if (values_f32) {
                value = values_f32 + (h * CHUNK + k) * dim;
            } else {
                if (h == 0 && k + AHEAD < n) prefetch_slot(c, c->values, dim, slots[k + AHEAD]);
                value = row_f32(c, c->values, dim, slots[k], h, buffer);
            }
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[h * group + g][k];
                for (int64_t i = 0; i < dim; i++) acc[g][i] += w * value[i];
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < dim; i++) head_states[g].acc[i] = acc[g][i];
    }
}

/* The next chunk of a request's private keys from column *j on: up to CHUNK slots not covered by
 * a shared run (shared[j] == 0), all with one shift (*shift). Returns how many; 0 at the end. */
static inline __attribute__((always_inline)) int64_t next_chunk(const Context *c, const int64_t *slots,
                                                                const uint8_t *shared, int64_t length, int64_t *j,
                                                                int64_t *chunk_slots, int64_t *chunk_shift) {
    int64_t n = 0;
    *chunk_shift = 0;
    for (; *j < length && n < CHUNK; (*j)++) {
        if (shared[*j]) continue;
        const int64_t shift = *j - c->slot_positions[slots[*j]];
        if (n == 0) {
            *chunk_shift = shift;
        } else if (shift != *chunk_shift) {
            break; /* the next chunk starts here, with its own rotation */
        }
        chunk_slots[n++] = slots[*j];
    }
    return n;
}

/* A request's private keys: its columns not covered by a shared run (shared[j] == 0), in chunks
 * of keys with one shift (the queries are rotated when it changes). states: [num_heads]. */
static inline __attribute__((always_inline)) void private_item(const Context *c, int64_t dim, int64_t group,
                                                               const float *q, const int64_t *slots,
                                                               const uint8_t *shared, int64_t length,
                                                               State *states) {
    const int64_t num_kv_heads = c->num_kv_heads;
    float rotated[MAX_HEADS][MAX_GROUP][MAX_DIM];
    int64_t chunk_slots[CHUNK];
    int64_t current_shift = 0;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        rotate_queries(c, q + h * group * dim, 0, rotated[h]);
        init_states(c, states + h * group);
    }
    int64_t j = 0, n, chunk_shift;
    while ((n = next_chunk(c, slots, shared, length, &j, chunk_slots, &chunk_shift))) {
        if (chunk_shift != current_shift) {
            for (int64_t h = 0; h < num_kv_heads; h++) rotate_queries(c, q + h * group * dim, chunk_shift, rotated[h]);
            current_shift = chunk_shift;
        }
        float scores[MAX_HEADS * MAX_GROUP][CHUNK];
        score_rows(c, dim, group, rotated, chunk_slots, n, scores);
        accumulate(c, dim, group, scores, chunk_slots, NULL, n, states);
    }
}

/* A run of consecutive slots read by several requests: each chunk of keys and values is read
 * from the pool once, converted to float32 (keys transposed, into scratch: 2 * num_kv_heads *
 * dim * CHUNK floats), and used by all its readers. states: [readers][num_heads]. */
static inline __attribute__((always_inline)) void shared_item(const Context *c, int64_t dim, int64_t group,
                                                              const float *q, const Run *run, const Reader *readers,
                                                              float *scratch, State *states) {
    const int64_t num_kv_heads = c->num_kv_heads, num_heads = c->num_heads;
    float rotated[MAX_HEADS][MAX_GROUP][MAX_DIM];
    float scores[MAX_HEADS * MAX_GROUP][CHUNK];
    float buffer[MAX_DIM] __attribute__((aligned(64)));
    float *restrict kt = scratch, *restrict v = scratch + num_kv_heads * dim * CHUNK;
    for (int64_t r = 0; r < run->num_readers; r++)
        for (int64_t h = 0; h < num_kv_heads; h++) init_states(c, states + r * num_heads + h * group);
    for (int64_t start = 0; start < run->length; start += CHUNK) {
        const int64_t n = run->length - start < CHUNK ? run->length - start : CHUNK;
        const int64_t width = (n + 15) & ~(int64_t)15;
        for (int64_t k = 0; k < width; k++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                float *vk = v + (h * CHUNK + k) * dim;
                if (k < n) {
                    const float *key = row_f32(c, c->keys, dim, run->slot_start + start + k, h, buffer);
                    for (int64_t i = 0; i < dim; i++) kt[(h * dim + i) * CHUNK + k] = key[i];
                    memcpy(vk, row_f32(c, c->values, dim, run->slot_start + start + k, h, buffer), sizeof(float) * dim);
                } else {
                    for (int64_t i = 0; i < dim; i++) kt[(h * dim + i) * CHUNK + k] = 0.0f;
                }
            }
        }
        int64_t e = run->first_reader;
        for (int64_t r = 0; r < run->num_readers; r++, e = readers[e].next) {
            const Reader *reader = &readers[e];
            for (int64_t h = 0; h < num_kv_heads; h++)
                rotate_queries(c, q + (reader->request * num_heads + h * group) * dim, reader->shift, rotated[h]);
            score_transposed(num_kv_heads, dim, group, rotated, kt, width, scores);
            accumulate(c, dim, group, scores, NULL, v, n, states + r * num_heads);
        }
    }
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* The same for a bf16 pool and head size 64, in bf16 dot products (vdpbf16ps, 32 products per
 * instruction, float32 sums), where the CPU has them. The run's keys are packed once into tiles of
 * 16 keys x a pair of dimensions per 32-bit lane, its values into pairs of keys per dimension; then
 * each reader in turn, head by head, runs its rotated queries (rounded to bf16) against every chunk
 * with its softmax state in registers (float32). scratch: num_kv_heads * 64 * MAX_RUN floats. */
enum { PAIRS64 = 32, TILES = CHUNK / 16 };

static inline __attribute__((always_inline)) void to_pairs(const float *x, uint32_t *pairs) { /* 64 floats */
    for (int64_t i = 0; i < 64; i += 32)
        _mm512_storeu_si512(pairs + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
}

/* Keys [start, start + n) of the run, packed: keys into kp ([Hkv][n/16 tiles][32][16]), values
 * into vp ([Hkv][n/2][64][2]), zero past n up to a multiple of 16. */
static inline __attribute__((always_inline)) void pack_run(const Context *c, int64_t slot_start, int64_t n,
                                                           uint32_t *restrict kp, uint16_t *restrict vp) {
    const int64_t num_kv_heads = c->num_kv_heads, width = (n + 15) & ~(int64_t)15;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t k = 0; k < width; k++) {
            uint32_t *key_lane = kp + (h * (MAX_RUN / 16) + k / 16) * PAIRS64 * 16 + k % 16;
            uint16_t *value_lane = vp + (h * (MAX_RUN / 2) + k / 2) * 64 * 2 + k % 2;
            const int64_t offset = ((slot_start + k) * num_kv_heads + h) * 64;
            const uint32_t *key = (const uint32_t *)((const uint16_t *)c->keys + offset);
            const uint16_t *value = (const uint16_t *)c->values + offset;
            for (int64_t p = 0; p < PAIRS64; p++) key_lane[p * 16] = k < n ? key[p] : 0;
            for (int64_t d = 0; d < 64; d++) value_lane[d * 2] = k < n ? value[d] : 0;
        }
    }
}

/* One reader's query group of one KV head (query pairs [group][32]) against the packed keys and
 * values of a run of n keys, chunk by chunk, folded into `states` ([group]). */
static inline __attribute__((always_inline)) void read_run_bf16(int64_t group, const uint32_t query[][PAIRS64],
                                                                const uint32_t *tiles, const uint16_t *values,
                                                                int64_t n, State *states) {
    __m512 acc[MAX_GROUP][4], max[MAX_GROUP], sum[MAX_GROUP];
    uint32_t weight[MAX_GROUP][CHUNK / 2] __attribute__((aligned(64)));
    for (int64_t g = 0; g < group; g++) {
        for (int64_t j = 0; j < 4; j++) acc[g][j] = _mm512_setzero_ps();
        max[g] = _mm512_set1_ps(-INFINITY), sum[g] = _mm512_setzero_ps();
    }
    for (int64_t start = 0; start < n; start += CHUNK) {
        const int64_t m = n - start < CHUNK ? n - start : CHUNK, num_tiles = (m + 15) / 16;
        const uint32_t *chunk = tiles + (start / 16) * PAIRS64 * 16;
        __m512 s[MAX_GROUP][TILES];
        for (int64_t g = 0; g < group; g++)
            for (int64_t t = 0; t < TILES; t++) s[g][t] = _mm512_setzero_ps();
        for (int64_t p = 0; p < PAIRS64; p++) {
            __m512bh k[TILES];
            for (int64_t t = 0; t < num_tiles; t++) k[t] = (__m512bh)_mm512_load_si512(chunk + (t * PAIRS64 + p) * 16);
            for (int64_t g = 0; g < group; g++) {
                const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)query[g][p]);
                for (int64_t t = 0; t < num_tiles; t++) s[g][t] = _mm512_dpbf16_ps(s[g][t], qp, k[t]);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            __m512 chunk_max = max[g];
            for (int64_t t = 0; t < num_tiles; t++) {
                const int64_t left = m - 16 * t;
                if (left < 16) s[g][t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << left) - 1), s[g][t]);
                chunk_max = _mm512_max_ps(chunk_max, s[g][t]);
            }
            chunk_max = _mm512_set1_ps(_mm512_reduce_max_ps(chunk_max));
            const __m512 correction = exp512_nonpositive(_mm512_sub_ps(max[g], chunk_max));
            max[g] = chunk_max;
            __m512 chunk_sum = _mm512_setzero_ps(), w[TILES];
            for (int64_t t = 0; t < TILES; t++) {
                w[t] = t < num_tiles ? exp512_nonpositive(_mm512_sub_ps(s[g][t], chunk_max)) : _mm512_setzero_ps();
                chunk_sum = _mm512_add_ps(chunk_sum, w[t]);
            }
            sum[g] = _mm512_fmadd_ps(sum[g], correction, chunk_sum);
            for (int64_t j = 0; j < 4; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], correction);
            for (int64_t t = 0; t < TILES; t += 2)
                _mm512_store_si512(weight[g] + t * 8, (__m512i)_mm512_cvtne2ps_pbh(w[t + 1], w[t]));
        }
        const uint16_t *chunk_values = values + (start / 2) * 64 * 2;
        for (int64_t pair = 0; pair < (m + 1) / 2; pair++) {
            __m512bh v[4];
            for (int64_t j = 0; j < 4; j++) v[j] = (__m512bh)_mm512_load_si512(chunk_values + (pair * 64 + j * 16) * 2);
            for (int64_t g = 0; g < group; g++) {
                const __m512bh wp = (__m512bh)_mm512_set1_epi32((int)weight[g][pair]);
                for (int64_t j = 0; j < 4; j++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], wp, v[j]);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        states[g].max = _mm512_cvtss_f32(max[g]);
        states[g].sum = _mm512_reduce_add_ps(sum[g]);
        for (int64_t j = 0; j < 4; j++) _mm512_storeu_ps(states[g].acc + j * 16, acc[g][j]);
    }
}

/* r[k] = the sum of v[k]'s 16 lanes, for 16 vectors at once (a transposing reduction tree). */
static inline __attribute__((always_inline)) __m512 sum_lanes16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sums of v[4i .. 4i+3] */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

/* Row `slot`, KV head h of a bf16 pool of head size 64, as four float32 vectors. */
static inline __attribute__((always_inline)) void load_row_f32(const uint16_t *pool, int64_t offset, __m512 out[4]) {
    for (int64_t j = 0; j < 4; j++)
        out[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(pool + offset + 16 * j))), 16));
}

/* One chunk of n <= CHUNK private keys (by slot) against every KV head's query group (bf16
 * pairs, two vectors per query; query[h][g]), folded into `states` ([num_kv_heads][group]): scores
 * in bf16 dot products (float32 sums) reduced 16 keys at a time, all heads of a key together (a
 * slot's heads are contiguous in the pool), softmax and values in float32. */
static inline __attribute__((always_inline)) void private_chunk_bf16(const Context *c, int64_t group,
                                                                     const __m512bh query[][MAX_GROUP][4],
                                                                     const int64_t *slots, int64_t n, State *states) {
    const int64_t num_kv_heads = c->num_kv_heads, num_queries = num_kv_heads * group, num_tiles = (n + 15) / 16;
    const uint16_t *keys = c->keys, *values = c->values;
    __m512 s[MAX_HEADS * 4][TILES], part[MAX_HEADS * 4][16];
    float weights[MAX_HEADS * 4][CHUNK] __attribute__((aligned(64)));
    for (int64_t t = 0; t < num_tiles; t++) {
        for (int64_t k = 0; k < 16; k++) {
            if (16 * t + k >= n) {
                for (int64_t i = 0; i < num_queries; i++) part[i][k] = _mm512_setzero_ps();
                continue;
            }
            if (16 * t + k + AHEAD < n) prefetch_slot(c, c->keys, 64, slots[16 * t + k + AHEAD]);
            prefetch_slot_l2(c, c->values, 64, slots[16 * t + k]); /* read after this chunk's scores */
            const uint16_t *row = keys + slots[16 * t + k] * num_kv_heads * 64;
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512(row + h * 64);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512(row + h * 64 + 32);
                for (int64_t g = 0; g < group; g++) { /* the query's bf16 part, then what rounding left */
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[h][g][0], k0);
                    dot = _mm512_dpbf16_ps(dot, query[h][g][1], k1);
                    dot = _mm512_dpbf16_ps(dot, query[h][g][2], k0);
                    part[h * group + g][k] = _mm512_dpbf16_ps(dot, query[h][g][3], k1);
                }
            }
        }
        const int64_t left = n - 16 * t;
        for (int64_t i = 0; i < num_queries; i++) {
            s[i][t] = sum_lanes16(part[i]);
            if (left < 16) s[i][t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << left) - 1), s[i][t]);
        }
    }
    float correction[MAX_HEADS * 4];
    for (int64_t i = 0; i < num_queries; i++) {
        State *state = &states[i];
        __m512 top = _mm512_set1_ps(state->max);
        for (int64_t t = 0; t < num_tiles; t++) top = _mm512_max_ps(top, s[i][t]);
        const float chunk_max = _mm512_reduce_max_ps(top);
        correction[i] = exp_nonpositive(state->max - chunk_max);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < num_tiles; t++) {
            const __m512 w = exp512_nonpositive(_mm512_sub_ps(s[i][t], _mm512_set1_ps(chunk_max)));
            _mm512_store_ps(weights[i] + 16 * t, w);
            sum = _mm512_add_ps(sum, w);
        }
        state->max = chunk_max;
        state->sum = state->sum * correction[i] + _mm512_reduce_add_ps(sum);
    }
    for (int64_t h = 0; h < num_kv_heads; h++) {
        __m512 acc[4][4];
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < 4; j++)
                acc[g][j] = _mm512_mul_ps(_mm512_loadu_ps(states[h * group + g].acc + 16 * j),
                                          _mm512_set1_ps(correction[h * group + g]));
        for (int64_t k = 0; k < n; k++) {
            __m512 v[4];
            load_row_f32(values, (slots[k] * num_kv_heads + h) * 64, v);
            for (int64_t g = 0; g < group; g++) {
                const __m512 w = _mm512_set1_ps(weights[h * group + g][k]);
                for (int64_t j = 0; j < 4; j++) acc[g][j] = _mm512_fmadd_ps(w, v[j], acc[g][j]);
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t j = 0; j < 4; j++) _mm512_storeu_ps(states[h * group + g].acc + 16 * j, acc[g][j]);
    }
}

/* private_item for a bf16 pool of head size 64 where the CPU has bf16 dot products. */
static inline __attribute__((always_inline)) void private_item_bf16(const Context *c, int64_t group, const float *q,
                                                                    const int64_t *slots, const uint8_t *shared,
                                                                    int64_t length, State *states) {
    const int64_t num_kv_heads = c->num_kv_heads;
    float rotated[MAX_GROUP][MAX_DIM];
    float residual[MAX_DIM];
    __m512bh query[MAX_HEADS][MAX_GROUP][4]; /* each query as bf16 + bf16 (~16 bits of mantissa) */
    int64_t chunk_slots[CHUNK];
    int64_t current_shift = 0, j = 0, n, chunk_shift, rotated_yet = 0;
    for (int64_t h = 0; h < num_kv_heads; h++) init_states(c, states + h * group);
    while ((n = next_chunk(c, slots, shared, length, &j, chunk_slots, &chunk_shift))) {
        if (!rotated_yet || chunk_shift != current_shift) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                rotate_queries(c, q + h * group * 64, chunk_shift, rotated);
                for (int64_t g = 0; g < group; g++) {
                    for (int64_t i = 0; i < 64; i++)
                        residual[i] = rotated[g][i] - bf16_to_float(float_to_bf16(rotated[g][i]));
                    for (int64_t half = 0; half < 2; half++) {
                        query[h][g][half] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(rotated[g] + 32 * half + 16),
                                                                _mm512_loadu_ps(rotated[g] + 32 * half));
                        query[h][g][2 + half] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(residual + 32 * half + 16),
                                                                    _mm512_loadu_ps(residual + 32 * half));
                    }
                }
            }
            current_shift = chunk_shift, rotated_yet = 1;
        }
        private_chunk_bf16(c, group, query, chunk_slots, n, states);
    }
}

static inline __attribute__((always_inline)) void shared_item_bf16(const Context *c, int64_t group, const float *q,
                                                                   const Run *run, const Reader *readers,
                                                                   float *scratch, State *states) {
    const int64_t num_kv_heads = c->num_kv_heads, num_heads = c->num_heads;
    uint32_t *restrict kp = (uint32_t *)scratch;                                     /* [Hkv][MAX_RUN/16][32][16] */
    uint16_t *restrict vp = (uint16_t *)(kp + num_kv_heads * (MAX_RUN / 16) * PAIRS64 * 16); /* [Hkv][MAX_RUN/2][64][2] */
    float rotated[MAX_GROUP][MAX_DIM];
    uint32_t query[MAX_GROUP][PAIRS64] __attribute__((aligned(64)));
    pack_run(c, run->slot_start, run->length, kp, vp);
    int64_t e = run->first_reader;
    for (int64_t r = 0; r < run->num_readers; r++, e = readers[e].next) {
        const Reader *reader = &readers[e];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate_queries(c, q + (reader->request * num_heads + h * group) * 64, reader->shift, rotated);
            for (int64_t g = 0; g < group; g++) to_pairs(rotated[g], query[g]);
            read_run_bf16(group, query, kp + h * (MAX_RUN / 16) * PAIRS64 * 16, vp + h * (MAX_RUN / 2) * 64 * 2,
                          run->length, states + r * num_heads + h * group);
        }
    }
}
#endif

/* The work item at `position` in an order that spreads the shared items (compute-bound: many
 * readers per key) evenly among the private ones (bound by memory reads), so that the threads
 * running at any one time tend to do some of each. Items [0, batch) are private, the rest shared. */
static inline int64_t interleaved(int64_t position, int64_t batch, int64_t num_shared) {
    const int64_t total = batch + num_shared;
    /* shared items before `position`, and whether the one at `position` is shared */
    const int64_t before = position * num_shared / total, through = (position + 1) * num_shared / total;
    return through > before ? batch + before : position - before;
}

static inline __attribute__((always_inline)) void work_item(
    const Context *c, int64_t dim, int64_t group, int64_t index, const float *q, const int64_t *slots,
    const uint8_t *shared, const int64_t *lengths, int64_t width, int64_t batch, const Run *runs,
    const Reader *readers, const int64_t *offsets, float *scratch, State *partials) {
    const int64_t num_heads = c->num_heads;
    if (index < batch) { /* request `index`'s private keys */
#if defined(__AVX512BF16__)
        if (c->bf16 && dim == 64 && group <= 4) {
            private_item_bf16(c, group, q + index * num_heads * dim, slots + index * width, shared + index * width,
                              lengths[index], partials + index * num_heads);
            return;
        }
#endif
        private_item(c, dim, group, q + index * num_heads * dim, slots + index * width, shared + index * width,
                     lengths[index], partials + index * num_heads);
        return;
    }
    const int64_t u = index - batch; /* shared run u */
#if defined(__AVX512BF16__)
    if (c->bf16 && dim == 64 && group <= 4) {
        shared_item_bf16(c, group, q, &runs[u], readers, scratch, partials + offsets[u] * num_heads);
        return;
    }
#endif
    shared_item(c, dim, group, q, &runs[u], readers, scratch, partials + offsets[u] * num_heads);
}

/* q:        [batch, num_heads, dim] float32, rotated for each request's own position
 * keys, values: [num_slots, num_kv_heads, dim], float32 or bf16 (bf16 != 0)
 * slots:    [batch, width] int64, row b valid for its first lengths[b] columns (column = position)
 * slot_positions: [num_slots] int64, the position each key was rotated for
 * shift_cos, shift_sin: [2 * max_shift + 1, dim / 2] float32, rotation by d at row d + max_shift
 * out:      [batch, num_heads, dim] float32
 * stats:    [2] int64 out: key/value rows loaded, and rows a per-request read would load
 * Returns 0, -1 for a shape it does not support, -2 when out of memory (nothing written).
 */
int paged_decode_attention(const float *q, const void *keys, const void *values, int bf16,
                           const int64_t *slots, const int64_t *lengths, int64_t width,
                           const int64_t *slot_positions, const float *shift_cos, const float *shift_sin,
                           int64_t max_shift, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                           int64_t dim, float scale, int num_threads, float *out, int64_t *stats) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || num_kv_heads > MAX_HEADS || dim % 2 || group * num_kv_heads != num_heads)
        return -1;
    Context c = {keys, values, bf16, slot_positions, shift_cos, shift_sin, max_shift, num_heads, num_kv_heads,
                 group, dim, scale};

    /* 1. Each request's context as runs of consecutive slots with one shift. Where runs of several
     *    requests overlap in slot space (a master span, possibly cut differently in each table by
     *    the agent's own diff blocks), the overlap is read once for all of them: the slot axis is
     *    cut at every run's ends, and each piece covered by two runs or more (and at least
     *    MIN_SHARED_RUN long) is a shared item whose readers are those runs' requests. */
    int64_t total = 0, num_pieces = 0;
    for (int64_t b = 0; b < batch; b++) total += lengths[b];
    uint8_t *shared = calloc(batch * width, 1);
    Piece *pieces = malloc(sizeof(Piece) * (total / MIN_SHARED_RUN + 1));
    if (!shared || !pieces) {
        free(shared), free(pieces);
        return -2;
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *row = slots + b * width;
        int64_t start = 0;
        for (int64_t j = 1; j <= lengths[b]; j++) {
            const int ends = j == lengths[b] || row[j] != row[j - 1] + 1 ||
                             j - slot_positions[row[j]] != start - slot_positions[row[start]];
            if (!ends) continue;
            if (j - start >= MIN_SHARED_RUN)
                pieces[num_pieces++] = (Piece){row[start], row[start] + j - start, b, start,
                                               start - slot_positions[row[start]]};
            start = j;
        }
    }
    qsort(pieces, num_pieces, sizeof(Piece), compare_pieces);
    int64_t *cuts = malloc(sizeof(int64_t) * (2 * num_pieces + 1));
    int64_t *active = malloc(sizeof(int64_t) * (num_pieces + 1));
    int64_t runs_capacity = 2 * num_pieces + 16, readers_capacity = 2 * num_pieces + 16;
    int64_t num_readers = 0, num_shared = 0, num_active = 0;
    Run *runs = malloc(sizeof(Run) * runs_capacity);
    Reader *readers = malloc(sizeof(Reader) * readers_capacity);
    if (!cuts || !active || !runs || !readers) {
        free(shared), free(pieces), free(cuts), free(active), free(runs), free(readers);
        return -2;
    }
    int64_t num_cuts = 0;
    for (int64_t i = 0; i < num_pieces; i++) cuts[num_cuts++] = pieces[i].start, cuts[num_cuts++] = pieces[i].end;
    qsort(cuts, num_cuts, sizeof(int64_t), compare_int64);
    for (int64_t k = 0, next = 0; k + 1 < num_cuts; k++) {
        const int64_t lo = cuts[k], hi = cuts[k + 1];
        if (lo == hi) continue;
        int64_t kept = 0; /* the pieces covering [lo, hi): drop those that ended, add those starting */
        for (int64_t a = 0; a < num_active; a++)
            if (pieces[active[a]].end > lo) active[kept++] = active[a];
        num_active = kept;
        for (; next < num_pieces && pieces[next].start <= lo; next++)
            if (pieces[next].end > lo) active[num_active++] = next;
        if (num_active < 2 || hi - lo < MIN_SHARED_RUN) continue;
        const int64_t items = (hi - lo + MAX_RUN - 1) / MAX_RUN;
        if (!grow((void **)&readers, &readers_capacity, num_readers + items * num_active, sizeof(Reader)) ||
            !grow((void **)&runs, &runs_capacity, num_shared + items, sizeof(Run))) {
            free(shared), free(pieces), free(cuts), free(active), free(runs), free(readers);
            return -2;
        }
        for (int64_t from = lo; from < hi; from += MAX_RUN) {
            const int64_t to = hi - from < MAX_RUN ? hi : from + MAX_RUN;
            Run *run = &runs[num_shared++];
            *run = (Run){from, to - from, -1, 0};
            for (int64_t a = 0; a < num_active; a++) {
                const Piece *piece = &pieces[active[a]];
                const int64_t column = piece->column + (from - piece->start);
                readers[num_readers] = (Reader){piece->request, column, piece->shift, run->first_reader};
                run->first_reader = num_readers++;
                run->num_readers++;
                memset(shared + piece->request * width + column, 1, to - from);
            }
        }
    }
    const int64_t num_shared_readers = num_readers;
    free(pieces), free(cuts), free(active);
    /* partial states: batch private ones, then one per (shared run, reader), each [heads][group] */
    int64_t *offsets = malloc(sizeof(int64_t) * (num_shared + 1));
    State *partials = malloc(sizeof(State) * (batch + num_shared_readers) * num_heads);
    const int64_t scratch_floats = num_kv_heads * dim * MAX_RUN; /* per thread, for shared runs (>= 2 chunks) */
    float *scratch = aligned_alloc(64, sizeof(float) * scratch_floats * num_threads);
    if (!offsets || !partials || !scratch) {
        free(runs), free(readers), free(shared), free(offsets), free(partials), free(scratch);
        return -2;
    }
    offsets[0] = batch;
    for (int64_t u = 0; u < num_shared; u++) offsets[u + 1] = offsets[u] + runs[u].num_readers;

    /* 2. Every work item, in parallel: private items (request, head), shared items (run, head). */
    const int64_t num_items = batch + num_shared;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t position = 0; position < num_items; position++) {
        const int64_t item = interleaved(position, batch, num_shared);
        float *mine = scratch + omp_get_thread_num() * scratch_floats;
        if (dim == 64 && group == 3) /* SmolLM2's shape, with the sizes known to the compiler */
            work_item(&c, 64, 3, item, q, slots, shared, lengths, width, batch, runs, readers, offsets, mine, partials);
        else
            work_item(&c, dim, group, item, q, slots, shared, lengths, width, batch, runs, readers, offsets, mine,
                      partials);
    }

    /* 3. Merge each request's partial states by log-sum-exp, and normalize. */
    int64_t *first_partial = malloc(sizeof(int64_t) * batch), *next_partial = malloc(sizeof(int64_t) * (batch + num_shared_readers));
    for (int64_t b = 0; b < batch; b++) first_partial[b] = -1;
    for (int64_t u = 0; u < num_shared; u++) {
        int64_t r = 0;
        for (int64_t e = runs[u].first_reader; e >= 0; e = readers[e].next, r++) {
            const int64_t p = offsets[u] + r;
            next_partial[p] = first_partial[readers[e].request];
            first_partial[readers[e].request] = p;
        }
    }
#pragma omp parallel for num_threads(num_threads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t hq = 0; hq < num_heads; hq++) {
            State total = partials[b * num_heads + hq];
            for (int64_t p = first_partial[b]; p >= 0; p = next_partial[p]) {
                const State *s = &partials[p * num_heads + hq];
                const float m = s->max > total.max ? s->max : total.max;
                if (m == -INFINITY) continue;
                const float a = exp_nonpositive(total.max - m), w = exp_nonpositive(s->max - m);
                total.sum = total.sum * a + s->sum * w;
                for (int64_t i = 0; i < dim; i++) total.acc[i] = total.acc[i] * a + s->acc[i] * w;
                total.max = m;
            }
            float *dst = out + (b * num_heads + hq) * dim;
            const float inverse = total.sum > 0.0f ? 1.0f / total.sum : 0.0f;
            for (int64_t i = 0; i < dim; i++) dst[i] = total.acc[i] * inverse;
        }
    }
    int64_t loaded = 0;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < lengths[b]; j++) loaded += !shared[b * width + j];
    for (int64_t u = 0; u < num_shared; u++) loaded += runs[u].length;
    stats[0] = loaded * num_kv_heads;
    stats[1] = total * num_kv_heads;
    free(runs), free(readers), free(shared), free(offsets), free(partials), free(scratch);
    free(first_partial), free(next_partial);
    return 0;
}
