/*
 * attn_simd.h: the 16-lane fp32 vector VF the attention kernels compute with, for the ISA
 * AT_LEVEL selects (3: AVX-512, one __m512; 2: AVX2 + FMA, two __m256 halves, lanes 0-7
 * and 8-15; 1: plain C, 16 floats and fmaf), and the exp built on it.
 *
 * Every operation computes the same bits at every level: IEEE add / sub / mul, a fused
 * multiply-add (fmaf in plain C), max / min with x86's semantics (a > b ? a : b: the
 * second operand when unordered or both zero), the horizontal trees below. So one
 * kernel written on VF (attn_body.h) gives identical results on every ISA.
 *
 * Included once per translation unit (attn_isa_*.c), after its target pragma.
 */
#ifndef VABFT_ATTN_SIMD_H
#define VABFT_ATTN_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attn.h"

#if AT_LEVEL >= 2
#include <immintrin.h>
#endif

static inline float at_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float at_f16(uint16_t h) { /* exact, every fp16 is an fp32 */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    } else {
        u = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* element i of a mask row of dtype code dt, as the additive term (bool: 0 or -inf) */
static inline float at_mask_elem(const char *p, int dt, int64_t i) {
    if (dt == DT_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    if (dt == DT_BOOL) return p[i] ? 0.0f : -INFINITY;
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return dt == DT_BF16 ? at_bf16(h) : at_f16(h);
}

/* ================================================================================== */
#if AT_LEVEL == 3 /* AVX-512F */

typedef __m512 VF;
static inline VF vzero(void) { return _mm512_setzero_ps(); }
static inline VF vset(float x) { return _mm512_set1_ps(x); }
static inline VF vld(const float *p) { return _mm512_loadu_ps(p); }
static inline void vst(float *p, VF x) { _mm512_storeu_ps(p, x); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline VF vabs(VF a) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
/* 2^n from t = n + 1.5 * 2^23 (n an integer in [-127, 127]): its bits shifted */
static inline VF vpow2(VF t) {
    __m512i i = _mm512_slli_epi32(_mm512_castps_si512(t), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(i, _mm512_set1_epi32(0x3f800000)));
}
/* lanes l with j0 + l >= lim set to -inf */
static inline VF vcut(VF x, int64_t j0, int64_t lim) {
    __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(j0 - lim)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 k = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
    return _mm512_mask_blend_ps(k, x, _mm512_set1_ps(-INFINITY));
}
/* 16 mask elements as additive terms (bool: 0 / -inf) */
static inline VF vmask(const char *p, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)p);
    if (dt == DT_BOOL) {
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        __mmask16 k = _mm512_test_epi32_mask(b, b);
        return _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), _mm512_setzero_ps());
    }
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#define AT_TREE(NAME, OP8, OP4)                                                                 \
    static inline float NAME(VF v) {                                                            \
        __m256 lo = _mm512_castps512_ps256(v);                                                  \
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));           \
        __m256 y = OP8(lo, hi);                                                                 \
        __m128 z = OP4(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));                 \
        z = OP4(z, _mm_movehl_ps(z, z));                                                        \
        z = OP4(z, _mm_movehdup_ps(z));                                                         \
        return _mm_cvtss_f32(z);                                                                \
    }

/* ================================================================================== */
#elif AT_LEVEL == 2 /* AVX2 + FMA: a VF is two halves */

typedef struct {
    __m256 a, b;
} VF;
static inline VF vmk(__m256 a, __m256 b) {
    VF r = {a, b};
    return r;
}
static inline VF vzero(void) { return vmk(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline VF vset(float x) { return vmk(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline VF vld(const float *p) { return vmk(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vst(float *p, VF x) {
    _mm256_storeu_ps(p, x.a);
    _mm256_storeu_ps(p + 8, x.b);
}
static inline VF vadd(VF x, VF y) { return vmk(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
static inline VF vsub(VF x, VF y) { return vmk(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
static inline VF vmul(VF x, VF y) { return vmk(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline VF vfma(VF x, VF y, VF z) { return vmk(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static inline VF vmax(VF x, VF y) { return vmk(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
static inline VF vabs(VF x) {
    __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return vmk(_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m));
}
static inline __m256 at_pow2h(__m256 t) {
    __m256i i = _mm256_slli_epi32(_mm256_castps_si256(t), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(i, _mm256_set1_epi32(0x3f800000)));
}
static inline VF vpow2(VF t) { return vmk(at_pow2h(t.a), at_pow2h(t.b)); }
static inline __m256 at_cuth(__m256 x, int64_t j0, int64_t lim) {
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)(j0 - lim)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 cut = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(-1)));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), cut);
}
static inline VF vcut(VF x, int64_t j0, int64_t lim) { return vmk(at_cuth(x.a, j0, lim), at_cuth(x.b, j0 + 8, lim)); }
static inline __m256 at_maskh(const char *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p);
    if (dt == DT_BOOL) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        __m256 zero = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, _mm256_setzero_si256()));
        return _mm256_blendv_ps(_mm256_setzero_ps(), _mm256_set1_ps(-INFINITY), zero);
    }
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
static inline VF vmask(const char *p, int dt) {
    int64_t half = dt == DT_F32 ? 32 : dt == DT_BOOL ? 8 : 16;
    return vmk(at_maskh(p, dt), at_maskh(p + half, dt));
}
#define AT_TREE(NAME, OP8, OP4)                                                                 \
    static inline float NAME(VF v) {                                                            \
        __m256 y = OP8(v.a, v.b);                                                               \
        __m128 z = OP4(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));                 \
        z = OP4(z, _mm_movehl_ps(z, z));                                                        \
        z = OP4(z, _mm_movehdup_ps(z));                                                         \
        return _mm_cvtss_f32(z);                                                                \
    }

/* ================================================================================== */
#else /* plain C */

typedef struct {
    float v[16];
} VF;
#define AT_MAP(EXPR)                                  \
    VF r;                                             \
    for (int l = 0; l < 16; l++) r.v[l] = (EXPR);     \
    return r
static inline VF vzero(void) { AT_MAP(0.0f); }
static inline VF vset(float x) { AT_MAP(x); }
static inline VF vld(const float *p) {
    VF r;
    memcpy(r.v, p, 64);
    return r;
}
static inline void vst(float *p, VF x) { memcpy(p, x.v, 64); }
static inline VF vadd(VF a, VF b) { AT_MAP(a.v[l] + b.v[l]); }
static inline VF vsub(VF a, VF b) { AT_MAP(a.v[l] - b.v[l]); }
static inline VF vmul(VF a, VF b) { AT_MAP(a.v[l] * b.v[l]); }
static inline VF vfma(VF a, VF b, VF c) { AT_MAP(fmaf(a.v[l], b.v[l], c.v[l])); }
static inline VF vmax(VF a, VF b) { AT_MAP(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
static inline VF vabs(VF a) { AT_MAP(fabsf(a.v[l])); }
static inline float at_pow2s(float t) {
    uint32_t u;
    memcpy(&u, &t, 4);
    u = (u << 23) + 0x3f800000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline VF vpow2(VF t) { AT_MAP(at_pow2s(t.v[l])); }
static inline VF vcut(VF x, int64_t j0, int64_t lim) { AT_MAP(j0 + l >= lim ? -INFINITY : x.v[l]); }
static inline VF vmask(const char *p, int dt) { AT_MAP(at_mask_elem(p, dt, l)); }
static inline float at_add(float a, float b) { return a + b; }
static inline float at_max(float a, float b) { return a > b ? a : b; }
#define AT_TREE(NAME, OPS, UNUSED)                                                              \
    static inline float NAME(VF x) {                                                            \
        for (int w = 8; w >= 1; w /= 2)                                                         \
            for (int l = 0; l < w; l++) x.v[l] = OPS(x.v[l], x.v[l + w]);                        \
        return x.v[0];                                                                          \
    }
#endif

/* ---- horizontal trees: lanes j and j + w combined for w = 8, 4, 2, 1 ------------------- */
#if AT_LEVEL >= 2
AT_TREE(vhsum, _mm256_add_ps, _mm_add_ps)
AT_TREE(vhmax, _mm256_max_ps, _mm_max_ps)
#else
AT_TREE(vhsum, at_add, _)
AT_TREE(vhmax, at_max, _)
#endif

/* ---- exp ----------------------------------------------------------------------------------
 * exp(x) for x <= 0 (x = s - max s in every use; NaN stays NaN). Cody-Waite reduction
 * x = n ln2 + r with n = rint(x log2 e) (the 1.5 * 2^23 shift), |r| <= ln2 / 2 to within
 * rounding, SLEEF's degree-7 polynomial for e^r - 1 - r (1 ulp, xexpf's coefficients),
 * then 2^n (1 + r + r^2 P(r)) with one fma. x is clamped to -88 first, where n = -127 and
 * 2^n's bits are 0: every x with exp(x) < 2^-126.5 gives 0, all others are computed
 * (subnormal results included), so the only loss beyond the polynomial is a flush of
 * values below 2^-126 (the threshold's TINY floor). The measured worst error over every
 * fp32 x in [-88, 0] is in docs/ATTENTION.md ("exp"); the threshold counts 4 u32. */
#define AT_EXP_LO -88.0f
static inline VF vexp(VF x) {
    const VF shift = vset(12582912.0f); /* 1.5 * 2^23 */
    x = vmax(vset(AT_EXP_LO), x);      /* NaN stays (the second operand) */
    VF t = vfma(x, vset(1.44269504088896341f), shift);
    VF n = vsub(t, shift);
    VF r = vfma(n, vset(-0.693145751953125f), x);
    r = vfma(n, vset(-1.428606765330187045e-06f), r);
    VF p = vfma(vset(0.000198527617612853646278381f), r, vset(0.00139304355252534151077271f));
    p = vfma(p, r, vset(0.00833336077630519866943359f));
    p = vfma(p, r, vset(0.0416664853692054748535156f));
    p = vfma(p, r, vset(0.166666671633720397949219f));
    p = vfma(p, r, vset(0.5f));
    p = vfma(p, vmul(r, r), r); /* e^r - 1 */
    VF e = vpow2(t);
    return vfma(p, e, e);
}

#endif /* VABFT_ATTN_SIMD_H */
