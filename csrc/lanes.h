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
 *
 * Hot loops run on parts of a v16 (below): the v16 itself with AVX-512 (and in the
 * portable code), its two 256-bit halves with AVX2, where gcc would otherwise keep every
 * v16 on the stack. Any ISA-specific path here computes what the portable C computes,
 * bit for bit: the same lanes, trees and operand order.
 */
#ifndef VABFT_LANES_H
#define VABFT_LANES_H

#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
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

/* ---- AVX2 halves ------------------------------------------------------------------------
 * Without AVX-512 a v16 is no machine type: gcc keeps it on the stack, splits its
 * arithmetic into two 256-bit ops through memory, and lowers a 16-lane comparison,
 * shuffle, conversion or lane extraction one lane at a time. With AVX2 the helpers below
 * work on its two 8-lane halves (lanes 0-7, 8-15) instead, and the hot loops on parts
 * (below). Each computes what the portable code computes, lane by lane, in the same
 * order with the same operands: the same bits (tests/unit/backends/test_native_isa.py compares the
 * two builds). */
#if !defined(__AVX512F__) && defined(__AVX2__)
#define VABFT_AVX2 1
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __m256 v16_lo(v16 v) {
    __m256 h;
    memcpy(&h, &v, 32);
    return h;
}
static inline __m256 v16_hi(v16 v) {
    __m256 h;
    memcpy(&h, (const char *)&v + 32, 32);
    return h;
}
static inline v16 v16_of(__m256 lo, __m256 hi) {
    v16 v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
}

/* 8 elements of dtype dt at p in fp32: bf16 is the top half of its fp32, fp16 converts
 * exactly (F16C), as bf16_to_f / f16_to_f do */
static inline __m256 ld8(const char *p, int dt) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (dt == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#ifdef __F16C__
    return _mm256_cvtph_ps(h);
#else
    float x[8];
    for (int j = 0; j < 8; j++) x[j] = ld(p, DT_F16, j);
    return _mm256_loadu_ps(x);
#endif
}

/* The trees of hsum / hmax / hmin (below) on the halves: OP(lo, hi) combines lane j with
 * lane j + w, in the operand order of the 16-lane code (x[j] + x[j + w], and
 * vmax(x[j + w], x[j])). HALVES1: lane 0 of one vector. HALVES16: 16 vectors at once,
 * each level combining the halves of two vectors in one op as the AVX-512 version does;
 * lane r of the result is row r. */
#define VABFT_ADD8(lo, hi) _mm256_add_ps(lo, hi)
#define VABFT_MAX8(lo, hi) _mm256_max_ps(hi, lo)
#define VABFT_MIN8(lo, hi) _mm256_min_ps(hi, lo)
#define VABFT_ADD4(lo, hi) _mm_add_ps(lo, hi)
#define VABFT_MAX4(lo, hi) _mm_max_ps(hi, lo)
#define VABFT_MIN4(lo, hi) _mm_min_ps(hi, lo)
#define VABFT_HALVES1(NAME, OP8, OP4)                                                               \
    static inline float NAME(v16 v) {                                                               \
        __m256 y = OP8(v16_lo(v), v16_hi(v));                                                       \
        __m128 z = OP4(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));                     \
        z = OP4(z, _mm_movehl_ps(z, z));    /* w = 2: lanes 2, 3 to 0, 1 */                         \
        z = OP4(z, _mm_movehdup_ps(z));     /* w = 1: lane 1 to 0 */                                \
        return _mm_cvtss_f32(z);                                                                    \
    }
#define VABFT_HALVES16(NAME, OP8)                                                                   \
    static inline v16 NAME(const v16 *x) {                                                          \
        __m256 z[8], u[4], s[2];                                                                    \
        for (int i = 0; i < 8; i++) { /* w = 8 per row, w = 4: rows 2i, 2i + 1 per block */         \
            __m256 a = OP8(v16_lo(x[2 * i]), v16_hi(x[2 * i]));                                     \
            __m256 b = OP8(v16_lo(x[2 * i + 1]), v16_hi(x[2 * i + 1]));                             \
            z[i] = OP8(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));     \
        }                                                                                           \
        for (int i = 0; i < 4; i++) /* w = 2: block c: rows 4i + c, 4i + 2 + c */                   \
            u[i] = OP8(_mm256_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),                             \
                       _mm256_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));                            \
        for (int i = 0; i < 2; i++) /* w = 1: block c: rows 8i + c + 0, 2, 4, 6 */                  \
            s[i] = OP8(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x88),                             \
                       _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xDD));                            \
        const __m256i ROW = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);                              \
        return v16_of(_mm256_permutevar8x32_ps(s[0], ROW), _mm256_permutevar8x32_ps(s[1], ROW));    \
    }
#endif

/* dst[i] = p[i * stride] in fp32, i < n */
static inline void cvt(const char *p, int dt, int64_t stride, int64_t n, float *dst) {
    int64_t i = 0;
    if (stride == 1) {
        if (dt == DT_F32) {
            memcpy(dst, p, (size_t)n * 4);
            return;
        }
#ifdef VABFT_AVX2
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld8(p + 2 * i, dt));
#else
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
static inline v16 splat(float x) { /* 0 + x: -0 becomes +0 */
#ifdef VABFT_AVX2
    v8 h = (v8){0} + x;
    return v16_of((__m256)h, (__m256)h);
#else
    v16 v = {0};
    return v + x;
#endif
}
/* a > b ? a : b, lane-wise: a NaN in a is ignored (see the NaN rescans). This is exactly
 * x86's maxps / minps (the second operand when unordered or both zero). */
static inline v16 vmax(v16 a, v16 b) {
#ifdef __AVX512F__
    return (v16)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(VABFT_AVX2)
    return v16_of(_mm256_max_ps(v16_lo(a), v16_lo(b)), _mm256_max_ps(v16_hi(a), v16_hi(b)));
#else
    v16i m = a > b;
    return (v16)((m & (v16i)a) | (~m & (v16i)b));
#endif
}
static inline v16 vmin(v16 a, v16 b) {
#ifdef __AVX512F__
    return (v16)_mm512_min_ps((__m512)a, (__m512)b);
#elif defined(VABFT_AVX2)
    return v16_of(_mm256_min_ps(v16_lo(a), v16_lo(b)), _mm256_min_ps(v16_hi(a), v16_hi(b)));
#else
    v16i m = a < b;
    return (v16)((m & (v16i)a) | (~m & (v16i)b));
#endif
}
static inline v16 vabs(v16 a) { return (v16)((v16i)a & 0x7fffffff); }

/* fixed reduction trees over the 16 lanes: x[j] op x[j + w] for w = 8, 4, 2, 1 */
#ifdef VABFT_AVX2
VABFT_HALVES1(hsum, VABFT_ADD8, VABFT_ADD4)
VABFT_HALVES1(hmax, VABFT_MAX8, VABFT_MAX4)
VABFT_HALVES1(hmin, VABFT_MIN8, VABFT_MIN4)
#else
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
#endif

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
#elif defined(VABFT_AVX2)
VABFT_HALVES16(hsum16, VABFT_ADD8)
VABFT_HALVES16(hmax16, VABFT_MAX8)
VABFT_HALVES16(hmin16, VABFT_MIN8)
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
#ifdef VABFT_AVX2
        return v16_of(ld8(p, dt), ld8(p + 8 * ESZ[dt], dt));
#endif
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

/* ---- parts ------------------------------------------------------------------------------
 * The hot loops compute a v16 as NPART parts of PW lanes, part h holding lanes [h PW,
 * h PW + PW): the v16 itself with AVX-512 and in the portable code, its two AVX2 halves
 * otherwise, so that a loop's accumulators stay in registers. Lanes are independent, and
 * a lane goes through the same operations whichever part holds it, so the results do not
 * depend on PW. */
#ifdef VABFT_AVX2
#define PW 8
typedef v8 vpart;
typedef v8i vpmask;
#else
#define PW 16
typedef v16 vpart;
typedef v16i vpmask;
#endif
#define NPART (16 / PW)

static inline vpart pld(const float *p) {
    vpart v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void pst(float *p, vpart v) { memcpy(p, &v, sizeof v); }
/* part h of *v, and into it */
static inline vpart pget(const v16 *v, int h) { return pld((const float *)v + h * PW); }
static inline void pset(v16 *v, int h, vpart x) { pst((float *)v + h * PW, x); }
static inline vpart psplat(float x) { /* as splat: 0 + x (-0 becomes +0) */
    vpart v = {0};
    return v + x;
}
static inline vpart pmax(vpart a, vpart b) {
#ifdef VABFT_AVX2
    return (vpart)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return vmax(a, b);
#endif
}
static inline vpart pmin(vpart a, vpart b) {
#ifdef VABFT_AVX2
    return (vpart)_mm256_min_ps((__m256)a, (__m256)b);
#else
    return vmin(a, b);
#endif
}
static inline vpart pabs(vpart a) { return (vpart)((vpmask)a & 0x7fffffff); }
static inline vpart psel(vpmask m, vpart a, vpart b) { return (vpart)((m & (vpmask)a) | (~m & (vpmask)b)); }
/* 0, 1, .., PW - 1 */
static inline vpmask pindex(void) {
    static const int32_t I[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vpmask m;
    memcpy(&m, I, sizeof m);
    return m;
}
/* part h of load16(p - h PW elements, dt, n + h PW): PW elements of dtype dt at p, the
 * first n of them when n < PW (the rest 0; none when n <= 0) */
static inline vpart pload(const char *p, int dt, int64_t n) {
#ifdef VABFT_AVX2
    if (n >= PW) return (vpart)ld8(p, dt);
    if (n <= 0) return psplat(0.0f);
    if (dt == DT_F32) /* a masked load: no store of lanes to read back whole (a stall) */
        return (vpart)_mm256_maskload_ps((const float *)p, (__m256i)(pindex() < (int32_t)n));
    float x[PW] = {0};
    for (int64_t i = 0; i < n; i++) x[i] = ld(p, dt, i);
    return pld(x);
#else
    return load16(p, dt, n < 16 ? n : 16);
#endif
}

/* part h of the four vectors of a block of 64 elements of dtype dt at p (16 apart): the
 * four partials the statistics of A's rows and of B's runs keep */
static inline __attribute__((always_inline)) void pload4(const char *p, int dt, vpart v[4]) {
    for (int u = 0; u < 4; u++) v[u] = pload(p + 16 * u * ESZ[dt], dt, PW);
}
/* running sum, max and min of each of four partials: s[u] += v[u], h[u] = max(v[u], h[u]),
 * l[u] = min(v[u], l[u]) (operands in this order: a NaN's fate depends on it) */
static inline __attribute__((always_inline)) void pstats4(const vpart v[4], vpart s[4], vpart h[4], vpart l[4]) {
    for (int u = 0; u < 4; u++) {
        s[u] += v[u];
        h[u] = pmax(v[u], h[u]);
        l[u] = pmin(v[u], l[u]);
    }
}

/* STEP(u, j) for each j in [j0, j1), into partial u = (j - j0) % 4, j ascending within a
 * partial: a sum spread over four accumulators (four dependency chains in flight) whose
 * order of operations, and so whose bits, j0 and j1 alone fix. STEP pastes u onto its
 * accumulators' names (p##u). */
#define FOUR_PARTIALS(STEP, j0, j1)                                     \
    {                                                                   \
        int64_t j_ = (j0);                                              \
        for (; j_ + 4 <= (j1); j_ += 4) {                               \
            STEP(0, j_) STEP(1, j_ + 1) STEP(2, j_ + 2) STEP(3, j_ + 3) \
        }                                                               \
        if (j_ < (j1)) STEP(0, j_)                                      \
        if (j_ + 1 < (j1)) STEP(1, j_ + 1)                              \
        if (j_ + 2 < (j1)) STEP(2, j_ + 2)                              \
    }

#endif /* VABFT_LANES_H */
