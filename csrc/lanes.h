/*
 * lanes.h: the 16-lane fp32 vectors every kernel of the native backend computes with, and
 * the conversion of bf16 / fp16 / fp32 operands into them.
 *
 * Why one place: batch invariance (vabft_cpu.h) needs every code path that computes the
 * same quantity to use the same lane assignment and the same reduction tree, and the
 * same max / min semantics (x86's maxps / minps, whose NaN handling the NaN rescans rely
 * on). Defining them once, static inline, keeps the weight side and the check on one
 * definition while each still compiles them into its own loops.
 *
 * Operands are read through memcpy (any alignment, no strict-aliasing games); bf16 /
 * fp16 are converted a block or a vector at a time, never as a copy of a whole operand.
 */
#ifndef VABFT_LANES_H
#define VABFT_LANES_H

#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "vabft_cpu.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16s __attribute__((vector_size(32)));
#ifdef __FLT16_MAX__
typedef _Float16 v16h __attribute__((vector_size(32)));
#endif

/* bytes per element, by dtype code */
static const int64_t ESZ[3] = {4, 2, 2};

/* ---- element access ------------------------------------------------------------------ */

static inline float bf16_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f(uint16_t h) {
#ifdef __FLT16_MAX__
    _Float16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* element i (in elements, strides already applied) of p */
static inline float ld(const char *p, int dt, int64_t i) {
    if (dt == DT_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return dt == DT_BF16 ? bf16_to_f(h) : f16_to_f(h);
}

/* dst[i] = p[i * stride] in fp32, i < n */
static inline void cvt(const char *p, int dt, int64_t stride, int64_t n, float *dst) {
    int64_t i = 0;
    if (stride == 1) {
        if (dt == DT_F32) {
            memcpy(dst, p, (size_t)n * 4);
            return;
        }
        if (dt == DT_BF16) {
            for (; i + 16 <= n; i += 16) {
                v16s h;
                memcpy(&h, p + 2 * i, 32);
                v16u u = __builtin_convertvector(h, v16u) << 16;
                memcpy(dst + i, &u, 64);
            }
        }
#ifdef __FLT16_MAX__
        else {
            for (; i + 16 <= n; i += 16) {
                v16h h;
                memcpy(&h, p + 2 * i, 32);
                v16 f = __builtin_convertvector(h, v16);
                memcpy(dst + i, &f, 64);
            }
        }
#endif
        for (; i < n; i++) dst[i] = ld(p, dt, i);
        return;
    }
    for (; i < n; i++) dst[i] = ld(p, dt, i * stride);
}

/* ---- lanes ----------------------------------------------------------------------------- */

static inline v16 vld(const float *p) {
    v16 v;
    memcpy(&v, p, 64);
    return v;
}
static inline void vst(float *p, v16 v) { memcpy(p, &v, 64); }
static inline v16 splat(float x) {
    v16 v = {0};
    return v + x;
}
/* a > b ? a : b, lane-wise: a NaN in a is ignored (see the NaN rescans). This is exactly
 * x86's maxps / minps (the second operand when unordered or both zero). */
static inline v16 vmax(v16 a, v16 b) {
#ifdef __AVX512F__
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#else
    v16i m = a > b;
    return (v16)((m & (v16i)a) | (~m & (v16i)b));
#endif
}
static inline v16 vmin(v16 a, v16 b) {
#ifdef __AVX512F__
    return (v16)_mm512_min_ps((__m512)a, (__m512)b);
#else
    v16i m = a < b;
    return (v16)((m & (v16i)a) | (~m & (v16i)b));
#endif
}
static inline v16 vabs(v16 a) { return (v16)((v16i)a & 0x7fffffff); }

/* fixed reduction trees over the 16 lanes: x[j] op x[j + w] for w = 8, 4, 2, 1 */
static const v16i SH8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
static const v16i SH4 = {4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15};
static const v16i SH2 = {2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const v16i SH1 = {1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static inline float hsum(v16 v) {
    v = v + __builtin_shuffle(v, SH8);
    v = v + __builtin_shuffle(v, SH4);
    v = v + __builtin_shuffle(v, SH2);
    v = v + __builtin_shuffle(v, SH1);
    return v[0];
}
/* x[j + w] > x[j] ? x[j + w] : x[j] */
static inline float hmax(v16 v) {
    v = vmax(__builtin_shuffle(v, SH8), v);
    v = vmax(__builtin_shuffle(v, SH4), v);
    v = vmax(__builtin_shuffle(v, SH2), v);
    v = vmax(__builtin_shuffle(v, SH1), v);
    return v[0];
}
static inline float hmin(v16 v) {
    v = vmin(__builtin_shuffle(v, SH8), v);
    v = vmin(__builtin_shuffle(v, SH4), v);
    v = vmin(__builtin_shuffle(v, SH2), v);
    v = vmin(__builtin_shuffle(v, SH1), v);
    return v[0];
}

/* The three trees above for 16 vectors at once: lane r of the result is hsum / hmax /
 * hmin of x[r], bit for bit (the same pairs combined in the same order, so a value does
 * not depend on whether it was reduced alone or with 15 others). Each level combines
 * the halves of two vectors in one op: y = lo op hi where lo holds lanes j and hi lanes
 * j + w of the same rows. */
#ifdef __AVX512F__
#define VABFT_TREE16(NAME, OP)                                                             \
    static inline v16 NAME(const v16 *x) {                                                 \
        __m512 y[8], z[4], u[2];                                                           \
        for (int i = 0; i < 8; i++) { /* w = 8: rows 2i, 2i + 1 in the two halves */       \
            __m512 a = (__m512)x[2 * i], b = (__m512)x[2 * i + 1];                         \
            y[i] = OP(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE)); \
        }                                                                                  \
        for (int i = 0; i < 4; i++) /* w = 4: rows 4i .. 4i + 3, one per 128-bit block */  \
            z[i] = OP(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),                  \
                      _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));                 \
        for (int i = 0; i < 2; i++) /* w = 2: block c: rows 8i + c, 8i + 4 + c */          \
            u[i] = OP(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),                     \
                      _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));                    \
        /* w = 1: lane 4c + i is row 4i + c */                                             \
        __m512 s = OP(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD)); \
        const __m512i ROW = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); \
        return (v16)_mm512_permutexvar_ps(ROW, s);                                         \
    }
#define VABFT_ADD(lo, hi) _mm512_add_ps(lo, hi)
#define VABFT_MAX(lo, hi) _mm512_max_ps(hi, lo)
#define VABFT_MIN(lo, hi) _mm512_min_ps(hi, lo)
VABFT_TREE16(hsum16, VABFT_ADD)
VABFT_TREE16(hmax16, VABFT_MAX)
VABFT_TREE16(hmin16, VABFT_MIN)
#undef VABFT_ADD
#undef VABFT_MAX
#undef VABFT_MIN
#undef VABFT_TREE16
#else
static inline v16 hsum16(const v16 *x) {
    v16 r;
    for (int j = 0; j < 16; j++) r[j] = hsum(x[j]);
    return r;
}
static inline v16 hmax16(const v16 *x) {
    v16 r;
    for (int j = 0; j < 16; j++) r[j] = hmax(x[j]);
    return r;
}
static inline v16 hmin16(const v16 *x) {
    v16 r;
    for (int j = 0; j < 16; j++) r[j] = hmin(x[j]);
    return r;
}
#endif

/* 16 consecutive elements (rows of a column-major block), the first n < 16 of them when
 * n < 16 (the rest 0) */
static inline v16 load16(const char *p, int dt, int64_t n) {
    if (n == 16) {
        if (dt == DT_F32) return vld((const float *)p);
        if (dt == DT_BF16) {
            v16s h;
            memcpy(&h, p, 32);
            return (v16)(__builtin_convertvector(h, v16u) << 16);
        }
#ifdef __FLT16_MAX__
        v16h h;
        memcpy(&h, p, 32);
        return __builtin_convertvector(h, v16);
#endif
    }
    float x[16] = {0};
    for (int64_t i = 0; i < n; i++) x[i] = ld(p, dt, i);
    return vld(x);
}

#endif /* VABFT_LANES_H */
