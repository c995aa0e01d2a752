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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_HEADS 16 /* KV heads */
#define CHUNK 64
#define MIN_SHARED_RUN 8 /* shorter runs stay in their request's private item */

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

/* exp(x) for x <= 0 as 2^n * 2^f with a degree-6 polynomial for 2^f, f in [-0.5, 0.5]: relative
 * error ~2e-7 (float32 rounding level), and unlike libm's expf it vectorizes. exp(-inf) = 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f; /* log2(e) */
    const float n = __builtin_roundf(t);
    const float f = t - n;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n << 23;
    memcpy(&p, &bits, sizeof p);
    return x <= -87.0f ? 0.0f : p;
}

static inline float bf16_to_float(uint16_t v) {
    uint32_t bits = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void load_row(const Context *c, const void *cache, int64_t slot, int64_t head, float *row) {
    const int64_t offset = (slot * c->num_kv_heads + head) * c->dim;
    if (c->bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int64_t i = 0; i < c->dim; i++) row[i] = bf16_to_float(src[i]);
    } else {
        memcpy(row, (const float *)cache + offset, sizeof(float) * c->dim);
    }
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

/* Fold one chunk of scores (turned into weights in place) into the states; values come after. */
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
        for (int64_t k = 0; k < CHUNK; k++) {
            scores[g][k] = k < n ? exp_nonpositive(scores[g][k] - chunk_max) : 0.0f;
            sum += scores[g][k];
        }
        s->sum += sum;
    }
}

/* One chunk of n <= CHUNK keys (transposed: kt[i * CHUNK + k], zero beyond n) and values
 * (v[k * dim + i]) against the group's rotated queries: scores vectorize over the keys, the
 * weighted sum over the head dimension. */
static inline __attribute__((always_inline)) void attend_chunk(int64_t dim, int64_t group, float q[][MAX_DIM],
                                                               const float *restrict kt, const float *restrict v,
                                                               int64_t n, State *restrict states) {
    float scores[MAX_GROUP][CHUNK];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t k = 0; k < CHUNK; k++) scores[g][k] = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            const float qi = q[g][i];
            for (int64_t k = 0; k < CHUNK; k++) scores[g][k] += qi * kt[i * CHUNK + k];
        }
    }
    softmax_chunk(dim, group, scores, n, states);
    for (int64_t g = 0; g < group; g++) {
        float acc[MAX_DIM];
        for (int64_t i = 0; i < dim; i++) acc[i] = states[g].acc[i];
        for (int64_t k = 0; k < n; k++) {
            const float w = scores[g][k];
            for (int64_t i = 0; i < dim; i++) acc[i] += w * v[k * dim + i];
        }
        for (int64_t i = 0; i < dim; i++) states[g].acc[i] = acc[i];
    }
}

static inline __attribute__((always_inline)) void load_key_transposed(const Context *c, int64_t dim, int64_t slot,
                                                                      int64_t head, int64_t k, float *kt) {
    float row[MAX_DIM];
    load_row(c, c->keys, slot, head, row);
    for (int64_t i = 0; i < dim; i++) kt[i * CHUNK + k] = row[i];
}

/* A request's private keys: its columns not covered by a shared run (shared[j] == 0), in chunks
 * of keys with one shift (the queries are rotated when it changes). All KV heads per chunk, so the
 * chunk's rows are read from memory once. states: [num_heads]. */
static inline __attribute__((always_inline)) void private_item(const Context *c, int64_t dim, int64_t group,
                                                               const float *q, const int64_t *slots,
                                                               const uint8_t *shared, int64_t length,
                                                               State *states) {
    const int64_t num_kv_heads = c->num_kv_heads;
    float rotated[MAX_HEADS][MAX_GROUP][MAX_DIM];
    float kt[MAX_DIM * CHUNK] __attribute__((aligned(64))), v[CHUNK * MAX_DIM] __attribute__((aligned(64)));
    int64_t columns[CHUNK];
    int64_t current_shift = 0;
    for (int64_t h = 0; h < num_kv_heads; h++) {
        rotate_queries(c, q + h * group * dim, 0, rotated[h]);
        init_states(c, states + h * group);
    }
    int64_t j = 0;
    while (j < length) {
        int64_t n = 0, chunk_shift = 0;
        for (; j < length && n < CHUNK; j++) {
            if (shared[j]) continue;
            const int64_t shift = j - c->slot_positions[slots[j]];
            if (n == 0) {
                chunk_shift = shift;
            } else if (shift != chunk_shift) {
                break; /* the next chunk starts here, with its own rotation */
            }
            columns[n++] = j;
        }
        if (n == 0) break;
        if (chunk_shift != current_shift) {
            for (int64_t h = 0; h < num_kv_heads; h++) rotate_queries(c, q + h * group * dim, chunk_shift, rotated[h]);
            current_shift = chunk_shift;
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            for (int64_t k = 0; k < CHUNK; k++) {
                if (k < n) {
                    load_key_transposed(c, dim, slots[columns[k]], h, k, kt);
                    load_row(c, c->values, slots[columns[k]], h, v + k * dim);
                } else {
                    for (int64_t i = 0; i < dim; i++) kt[i * CHUNK + k] = 0.0f;
                }
            }
            attend_chunk(dim, group, rotated[h], kt, v, n, states + h * group);
        }
    }
}

/* A run of consecutive slots read by several requests: each chunk of keys and values loaded
 * once, for all readers and all KV heads. states: [readers][num_heads]. */
static inline __attribute__((always_inline)) void shared_item(const Context *c, int64_t dim, int64_t group,
                                                              const float *q, const Run *run, const Reader *readers,
                                                              State *states) {
    const int64_t num_kv_heads = c->num_kv_heads, num_heads = c->num_heads;
    float rotated[MAX_GROUP][MAX_DIM];
    float kt[MAX_DIM * CHUNK] __attribute__((aligned(64))), v[CHUNK * MAX_DIM] __attribute__((aligned(64)));
    for (int64_t r = 0; r < run->num_readers; r++)
        for (int64_t h = 0; h < num_kv_heads; h++) init_states(c, states + r * num_heads + h * group);
    for (int64_t start = 0; start < run->length; start += CHUNK) {
        const int64_t n = run->length - start < CHUNK ? run->length - start : CHUNK;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            for (int64_t k = 0; k < CHUNK; k++) {
                if (k < n) {
                    load_key_transposed(c, dim, run->slot_start + start + k, h, k, kt);
                    load_row(c, c->values, run->slot_start + start + k, h, v + k * dim);
                } else {
                    for (int64_t i = 0; i < dim; i++) kt[i * CHUNK + k] = 0.0f;
                }
            }
            int64_t e = run->first_reader;
            for (int64_t r = 0; r < run->num_readers; r++, e = readers[e].next) {
                const Reader *reader = &readers[e];
                rotate_queries(c, q + (reader->request * num_heads + h * group) * dim, reader->shift, rotated);
                attend_chunk(dim, group, rotated, kt, v, n, states + r * num_heads + h * group);
            }
        }
    }
}

static inline __attribute__((always_inline)) void work_item(
    const Context *c, int64_t dim, int64_t group, int64_t index, const float *q, const int64_t *slots,
    const uint8_t *shared, const int64_t *lengths, int64_t width, int64_t batch, const Run *runs,
    const Reader *readers, const int64_t *offsets, State *partials) {
    const int64_t num_heads = c->num_heads;
    if (index < batch) { /* request `index`'s private keys */
        private_item(c, dim, group, q + index * num_heads * dim, slots + index * width, shared + index * width,
                     lengths[index], partials + index * num_heads);
        return;
    }
    const int64_t u = index - batch; /* shared run u */
    shared_item(c, dim, group, q, &runs[u], readers, partials + offsets[u] * num_heads);
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

    /* 1. Runs of consecutive slots with one shift, at least MIN_SHARED_RUN long, grouped by
     *    (first slot, length) in an open-addressing table: runs with several readers are shared. */
    int64_t total = 0;
    for (int64_t b = 0; b < batch; b++) total += lengths[b];
    const int64_t max_runs = total / MIN_SHARED_RUN + 1, capacity = 2 * max_runs + 1;
    Run *runs = malloc(sizeof(Run) * max_runs);
    Reader *readers = malloc(sizeof(Reader) * max_runs);
    int64_t *table = malloc(sizeof(int64_t) * capacity);
    uint8_t *shared = calloc(batch * width, 1);
    int64_t num_runs = 0, num_readers = 0;
    if (!runs || !readers || !table || !shared) {
        free(runs), free(readers), free(table), free(shared);
        return -2;
    }
    for (int64_t i = 0; i < capacity; i++) table[i] = -1;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t *row = slots + b * width;
        int64_t start = 0;
        for (int64_t j = 1; j <= lengths[b]; j++) {
            const int ends = j == lengths[b] || row[j] != row[j - 1] + 1 ||
                             j - slot_positions[row[j]] != start - slot_positions[row[start]];
            if (!ends) continue;
            const int64_t length = j - start;
            if (length >= MIN_SHARED_RUN) {
                uint64_t h = ((uint64_t)row[start] * 0x9E3779B97F4A7C15ull) ^ (uint64_t)length;
                int64_t index = (int64_t)(h % (uint64_t)capacity);
                while (table[index] >= 0 && !(runs[table[index]].slot_start == row[start] &&
                                              runs[table[index]].length == length))
                    index = (index + 1) % capacity;
                if (table[index] < 0) {
                    table[index] = num_runs;
                    runs[num_runs++] = (Run){row[start], length, -1, 0};
                }
                Run *run = &runs[table[index]];
                readers[num_readers] = (Reader){b, start, start - slot_positions[row[start]], run->first_reader};
                run->first_reader = num_readers++;
                run->num_readers++;
            }
            start = j;
        }
    }
    /* only runs with several readers are shared; list them, and mark their columns */
    int64_t num_shared = 0, num_shared_readers = 0;
    for (int64_t u = 0; u < num_runs; u++) {
        if (runs[u].num_readers < 2) continue;
        runs[num_shared++] = runs[u];
        for (int64_t e = runs[u].first_reader; e >= 0; e = readers[e].next) {
            memset(shared + readers[e].request * width + readers[e].column, 1, runs[u].length);
            num_shared_readers++;
        }
    }
    /* partial states: batch private ones, then one per (shared run, reader), each [heads][group] */
    int64_t *offsets = malloc(sizeof(int64_t) * (num_shared + 1));
    State *partials = malloc(sizeof(State) * (batch + num_shared_readers) * num_heads);
    if (!offsets || !partials) {
        free(runs), free(readers), free(table), free(shared), free(offsets), free(partials);
        return -2;
    }
    offsets[0] = batch;
    for (int64_t u = 0; u < num_shared; u++) offsets[u + 1] = offsets[u] + runs[u].num_readers;

    /* 2. Every work item, in parallel: private items (request, head), shared items (run, head). */
    const int64_t num_items = batch + num_shared;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        if (dim == 64 && group == 3) /* SmolLM2's shape, with the sizes known to the compiler */
            work_item(&c, 64, 3, item, q, slots, shared, lengths, width, batch, runs, readers, offsets, partials);
        else
            work_item(&c, dim, group, item, q, slots, shared, lengths, width, batch, runs, readers, offsets, partials);
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
    free(runs), free(readers), free(table), free(shared), free(offsets), free(partials);
    free(first_partial), free(next_partial);
    return 0;
}
