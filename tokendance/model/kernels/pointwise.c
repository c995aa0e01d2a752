/* The element-wise steps of a decoder layer, each one pass over its rows (torch runs each as 3-7
 * ops, each a pass over memory and a dispatch): the residual add with RMSNorm, RoPE in place on
 * the fused q/k projection, and SiLU(gate) * up. Rows are bf16 (bf16 != 0) or float32; the
 * arithmetic is float32, rounded where Hugging Face's Llama rounds (see each function).
 *
 * Built at first use by tokendance/model/kernels/__init__.py and called through ctypes.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernel_math.h"

#define MAX_DIM 256 /* head size, for rope */
#define BLOCK 256   /* elements converted to float32 at a time */
#define PARALLEL_ELEMENTS (1 << 16) /* fewer run on one thread: a parallel region costs more */

static inline float rounded(float f, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(f)) : f; }

static inline __attribute__((always_inline)) float load(const void *row, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline __attribute__((always_inline)) void store(void *row, int64_t i, float value, int bf16) {
    if (bf16)
        ((uint16_t *)row)[i] = float_to_bf16(value);
    else
        ((float *)row)[i] = value;
}

static inline __attribute__((always_inline)) void add_rms_norm_rows(void *hidden, const void *delta,
                                                                    const void *weight, void *out, int64_t rows,
                                                                    int64_t dim, float eps, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        char *h = (char *)hidden + r * dim * size;
        char *o = (char *)out + r * dim * size;
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float x = load(h, i, bf16);
            if (delta) {
                x = rounded(x + load((const char *)delta + r * dim * size, i, bf16), bf16);
                store(h, i, x, bf16);
            }
            squares += x * x;
        }
        const float scale = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            store(o, i, load(weight, i, bf16) * rounded(load(h, i, bf16) * scale, bf16), bf16);
    }
}

/* hidden += delta (row by row, rounded to the dtype; delta may be NULL), then
 * out = weight * (hidden * rsqrt(mean(hidden^2) + eps)), the normalized row rounded to the dtype
 * before the weight is applied, as Hugging Face's LlamaRMSNorm does. [rows, dim] contiguous. */
int add_rms_norm(void *hidden, const void *delta, const void *weight, void *out, int64_t rows, int64_t dim,
                 float eps, int bf16, int threads) {
    if (bf16)
        add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, 1, threads);
    else
        add_rms_norm_rows(hidden, delta, weight, out, rows, dim, eps, 0, threads);
    return 0;
}

static inline __attribute__((always_inline)) void rope_rows(void *x, int64_t row_stride, const int64_t *positions,
                                                            const float *cos, const float *sin, int64_t rows,
                                                            int64_t heads, int64_t dim, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4, half = dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * dim, *s = sin + positions[r] * dim;
        for (int64_t h = 0; h < heads; h++) {
            char *head = (char *)x + (r * row_stride + h * dim) * size;
            float in[MAX_DIM], out[MAX_DIM];
            for (int64_t i = 0; i < dim; i++) in[i] = load(head, i, bf16);
            for (int64_t i = 0; i < half; i++) {
                out[i] = in[i] * c[i] - in[i + half] * s[i];
                out[i + half] = in[i + half] * c[i + half] + in[i] * s[i + half];
            }
            for (int64_t i = 0; i < dim; i++) store(head, i, out[i], bf16);
        }
    }
}

/* Rotary embedding in place, Hugging Face ("neox") pairing (dimension i with i + dim/2): row r
 * holds `heads` heads of `dim` at x + r * row_stride (elements), rotated for positions[r] with
 * the tables cos/sin [max_len, dim] float32. */
int rope(void *x, int64_t row_stride, const int64_t *positions, const float *cos, const float *sin, int64_t rows,
         int64_t heads, int64_t dim, int bf16, int threads) {
    if (dim % 2 || dim > MAX_DIM) return -1;
    if (bf16)
        rope_rows(x, row_stride, positions, cos, sin, rows, heads, dim, 1, threads);
    else
        rope_rows(x, row_stride, positions, cos, sin, rows, heads, dim, 0, threads);
    return 0;
}

static inline __attribute__((always_inline)) void silu_mul_rows(const void *gate_up, void *out, int64_t rows,
                                                                int64_t width, int bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + 2 * r * width * size, *up = gate + width * size;
        char *o = (char *)out + r * width * size;
        for (int64_t start = 0; start < width; start += BLOCK) { /* through float32 buffers: it vectorizes */
            const int64_t n = width - start < BLOCK ? width - start : BLOCK;
            float g[BLOCK], u[BLOCK], y[BLOCK];
            for (int64_t i = 0; i < n; i++) g[i] = load(gate, start + i, bf16), u[i] = load(up, start + i, bf16);
            for (int64_t i = 0; i < n; i++) y[i] = rounded(g[i] / (1.0f + exp_clamped(-g[i])), bf16) * u[i];
            for (int64_t i = 0; i < n; i++) store(o, start + i, y[i], bf16);
        }
    }
}

/* out[r] = SiLU(gate[r]) * up[r], where row r of gate_up is gate then up ([rows, 2 * width]); the
 * SiLU is rounded to the dtype before the product, as torch's F.silu(gate) * up is. */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int bf16, int threads) {
    if (bf16)
        silu_mul_rows(gate_up, out, rows, width, 1, threads);
    else
        silu_mul_rows(gate_up, out, rows, width, 0, threads);
    return 0;
}
