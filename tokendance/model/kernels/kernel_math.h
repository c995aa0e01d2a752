/* Scalar helpers the kernels share, written so that loops over them vectorize: bf16 <-> float32
 * and exp. Included by the kernels' sources (the build cache key covers this file too). */
#ifndef TOKENDANCE_KERNEL_MATH_H
#define TOKENDANCE_KERNEL_MATH_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t v) {
    const uint32_t bits = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* exp(x), x clamped to [-87, 88] (float32's range), as 2^n * 2^f with a degree-6 polynomial for
 * 2^f, f in [-0.5, 0.5]: relative error ~2e-7 (float32 rounding level), and unlike libm's expf
 * it vectorizes. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f; /* log2(e) */
    const float n = __builtin_rintf(t);       /* vectorizes (roundf does not) */
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
    return p;
}

/* exp(x) for x <= 0, with exp(-inf) = 0 (x <= -87 gives 0). */
static inline float exp_nonpositive(float x) { return x <= -87.0f ? 0.0f : exp_clamped(x); }

#if defined(__AVX512F__)
#include <immintrin.h>
/* exp(x) on 16 lanes for x <= 0 (larger x is taken as 0), exactly 0 where x <= -87 (so -inf):
 * Cody-Waite reduction by ln 2 and a degree-6 polynomial, ~1e-7 relative error. */
static inline __m512 exp512_nonpositive(__m512 x) {
    x = _mm512_min_ps(x, _mm512_setzero_ps());
    const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}
#endif

#endif
