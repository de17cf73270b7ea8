/*
 * vabft_cpu.c: the "cpu" backend of sdc_guard, V-ABFT (shared/docs/VABFT.md) in plain C.
 *
 * Two entry points, both one read of each operand, everything accumulated in fp32:
 *   weight_side  B [Bt, K, N] -> Br [Bt, nseg, K] (segment-major) and the per-segment
 *                aggregates P1, P2, V, col_norm, bad and the four threshold factors of
 *                sdc_guard.abft.WeightSide._factors;
 *   check        A [.., M, K], C [.., M, N] (and a bias broadcast to C) -> D, T, ok per
 *                (row, segment), the row mean / max / min of A, and whether every segment
 *                passed with everything finite.
 * Operands are bf16 / fp16 / fp32 with any strides (fast paths for row-major and
 * column-major); bf16 / fp16 are converted to fp32 a block at a time, never as a copy of
 * a whole operand.
 *
 * Determinism and batch invariance: every value of a row (D, T, the verdict) is computed
 * by the same sequence of fp32 operations whatever M is, whichever thread runs it and
 * whichever other rows share its block: sums use a fixed assignment of element index to
 * accumulator lane (index mod 64 for a contiguous run; one lane per row, in index order,
 * for column-major blocks), then a fixed reduction tree. Contraction into FMA is disabled
 * at build time (-ffp-contract=off) so that two code paths computing the same expression
 * round it the same way.
 *
 * Threads: plain pthreads created per call, only when the work is large (PAR_MIN
 * elements, 16 Mi: below that a call is well under a few ms and a second thread would
 * fight torch's spinning OpenMP workers for the cores); no OpenMP, whose idle workers
 * would spin beside torch's own pool.
 *
 * Memory order: column-major operands are read as few long sequential streams (128 rows
 * of a column-major A per k; 16 columns of a column-major B, 64 k at a time), never as
 * hundreds of short strided runs.
 *
 * NaN semantics follow torch: max / min of a run that holds a NaN is NaN (a rare path
 * rescans a run whose sum is NaN), so the Python side can build inputs_bad /
 * possible_overflow from these statistics exactly as the torch backend does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define SEG 256          /* columns per checksum segment */
#define KC 256           /* K per block of A (a multiple of 64) */
#define RB 16            /* rows per work item of the check (row-major A) */
#define RBC 128          /* rows per work item of the check, column-major A (<= RBMAX) */
#define KCC 32           /* K per block of a column-major A (a multiple of 16) */
#define RBMAX 128
_Static_assert(KCC * RBC <= KC * RB && RBC <= RBMAX && RBC % 16 == 0 && KCC % 16 == 0, "column-major block fits abuf");
#define KCW 1024        /* K per work item of a column-major weight side (a multiple of 16) */
#define KB 64            /* K rows per work item of a row-major weight side */
/* Elements read below which a call runs on one thread. A thread started right after a
 * torch op competes with torch's OpenMP workers, which spin (libgomp) for a while before
 * they sleep: on a small machine that costs more than the split saves unless the call
 * runs for milliseconds. A negative thread count forces the split (tests). */
#define PAR_MIN (1 << 24)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16s __attribute__((vector_size(32)));
#ifdef __FLT16_MAX__
typedef _Float16 v16h __attribute__((vector_size(32)));
#endif

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
static void cvt(const char *p, int dt, int64_t stride, int64_t n, float *dst) {
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

/* Element i of a contiguous run goes to lane i % 16 of accumulator (i / 16) % 4; the four
 * accumulators are combined as (0 + 1) + (2 + 3), then hsum. */
#define ACC(i) (((i) >> 4) & 3)
static inline v16 comb4(const v16 *a) { return (a[0] + a[1]) + (a[2] + a[3]); }

/* The last n < 16 values of a run (times r when given), padded with 0 for sums, -inf for
 * max and +inf for min. */
static inline void tail_vals(const float *x, const float *r, int64_t n, v16 *vs, v16 *vh, v16 *vl) {
    float a[16], b[16], c[16];
    for (int j = 0; j < 16; j++) {
        if (j < n) {
            float y = r ? x[j] * r[j] : x[j];
            a[j] = b[j] = c[j] = y;
        } else {
            a[j] = 0.0f;
            b[j] = -INFINITY;
            c[j] = INFINITY;
        }
    }
    *vs = vld(a);
    *vh = vld(b);
    *vl = vld(c);
}

/* Accumulate the run x[0..w) (times r) into sums S[4], and |.| into A[4] when A: element
 * i goes to lane i % 16 of accumulator ACC(i). Constant indices only, so that the
 * accumulators stay in registers. */
static inline void acc_sum(const float *x, const float *r, int64_t w, v16 *S, v16 *A) {
    v16 s0 = S[0], s1 = S[1], s2 = S[2], s3 = S[3], z = {0};
    v16 a0 = A ? A[0] : z, a1 = A ? A[1] : z, a2 = A ? A[2] : z, a3 = A ? A[3] : z;
    int64_t i = 0;
#define LD(o) (r ? vld(x + i + (o)) * vld(r + i + (o)) : vld(x + i + (o)))
    for (; i + 64 <= w; i += 64) {
        v16 v0 = LD(0), v1 = LD(16), v2 = LD(32), v3 = LD(48);
        s0 += v0;
        s1 += v1;
        s2 += v2;
        s3 += v3;
        if (A) {
            a0 += vabs(v0);
            a1 += vabs(v1);
            a2 += vabs(v2);
            a3 += vabs(v3);
        }
    }
#define SREM(j, sj, aj)                                                                  \
    if (w - i > 16 * (j)) {                                                              \
        int64_t n = w - i - 16 * (j);                                                    \
        v16 v, vh, vl;                                                                   \
        if (n >= 16)                                                                     \
            v = LD(16 * (j));                                                            \
        else                                                                             \
            tail_vals(x + i + 16 * (j), r ? r + i + 16 * (j) : NULL, n, &v, &vh, &vl);   \
        sj += v;                                                                         \
        aj += vabs(v);                                                                   \
    }
    SREM(0, s0, a0)
    SREM(1, s1, a1)
    SREM(2, s2, a2)
    SREM(3, s3, a3)
#undef SREM
    S[0] = s0;
    S[1] = s1;
    S[2] = s2;
    S[3] = s3;
    if (A) {
        A[0] = a0;
        A[1] = a1;
        A[2] = a2;
        A[3] = a3;
    }
}

/* Accumulate sum / max / min of the run x[0..w) (times r) into S, H, L (4 each). */
static inline void acc_stats(const float *x, const float *r, int64_t w, v16 *S, v16 *H, v16 *L) {
    v16 s0 = S[0], s1 = S[1], s2 = S[2], s3 = S[3];
    v16 h0 = H[0], h1 = H[1], h2 = H[2], h3 = H[3];
    v16 l0 = L[0], l1 = L[1], l2 = L[2], l3 = L[3];
    int64_t i = 0;
#define STEP(sj, hj, lj, v, vh, vl) \
    sj += v;                        \
    hj = vmax(vh, hj);              \
    lj = vmin(vl, lj);
    for (; i + 64 <= w; i += 64) {
        v16 v0 = LD(0), v1 = LD(16), v2 = LD(32), v3 = LD(48);
        STEP(s0, h0, l0, v0, v0, v0)
        STEP(s1, h1, l1, v1, v1, v1)
        STEP(s2, h2, l2, v2, v2, v2)
        STEP(s3, h3, l3, v3, v3, v3)
    }
#define REM(j, sj, hj, lj)                                                               \
    if (w - i > 16 * (j)) {                                                              \
        int64_t n = w - i - 16 * (j);                                                    \
        v16 v, vh, vl;                                                                   \
        if (n >= 16) {                                                                   \
            v = vh = vl = LD(16 * (j));                                                  \
        } else {                                                                         \
            tail_vals(x + i + 16 * (j), r ? r + i + 16 * (j) : NULL, n, &v, &vh, &vl);   \
        }                                                                                \
        STEP(sj, hj, lj, v, vh, vl)                                                      \
    }
    REM(0, s0, h0, l0)
    REM(1, s1, h1, l1)
    REM(2, s2, h2, l2)
    REM(3, s3, h3, l3)
#undef REM
#undef STEP
#undef LD
    S[0] = s0;
    S[1] = s1;
    S[2] = s2;
    S[3] = s3;
    H[0] = h0;
    H[1] = h1;
    H[2] = h2;
    H[3] = h3;
    L[0] = l0;
    L[1] = l1;
    L[2] = l2;
    L[3] = l3;
}

static inline void init_stats(v16 *S, v16 *H, v16 *L) {
    for (int j = 0; j < 4; j++) {
        S[j] = splat(0.0f);
        H[j] = splat(-INFINITY);
        L[j] = splat(INFINITY);
    }
}

static inline void finish_stats(const v16 *S, const v16 *H, const v16 *L, float *sum, float *hi, float *lo) {
    *sum = hsum(comb4(S));
    *hi = hmax(vmax(vmax(H[0], H[1]), vmax(H[2], H[3])));
    *lo = hmin(vmin(vmin(L[0], L[1]), vmin(L[2], L[3])));
}

/* sum of x[0..w) (times r when given), and of |x r| when asum */
static inline void run_sum(const float *x, const float *r, int64_t w, float *sum, float *asum) {
    v16 S[4] = {{0}}, A[4] = {{0}};
    acc_sum(x, r, w, S, asum ? A : NULL);
    *sum = hsum(comb4(S));
    if (asum) *asum = hsum(comb4(A));
}

/* sum, max, min of x[0..w) (times r when given); NaN-aware via rescan by the caller */
static inline void run_stats(const float *x, const float *r, int64_t w, float *sum, float *hi, float *lo) {
    v16 S[4], H[4], L[4];
    init_stats(S, H, L);
    acc_stats(x, r, w, S, H, L);
    finish_stats(S, H, L, sum, hi, lo);
}

/* whether p[i * stride], i < n, holds a NaN (the rare path after a NaN sum) */
static int has_nan(const char *p, int dt, int64_t stride, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(ld(p, dt, i * stride))) return 1;
    return 0;
}

/* ---- threads --------------------------------------------------------------------------- */

typedef int (*work_fn)(void *ctx, int64_t i0, int64_t i1); /* returns an AND-able flag */

typedef struct {
    work_fn fn;
    void *ctx;
    int64_t i0, i1;
    int result;
} job_t;

static void *run_job(void *p) {
    job_t *j = (job_t *)p;
    j->result = j->fn(j->ctx, j->i0, j->i1);
    return NULL;
}

/* Run fn over items [0, n) split into contiguous ranges on up to `threads` threads
 * (the caller's thread takes the first range). Returns the AND of the results, or -1
 * when memory ran out. */
static int parallel(work_fn fn, void *ctx, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    if (threads <= 1) return fn(ctx, 0, n);
    job_t jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){fn, ctx, n * t / threads, n * (t + 1) / threads, 1};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    int all = jobs[0].result;
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(tid[t], NULL);
        } else {
            run_job(&jobs[t]); /* could not start a thread: do its share here */
        }
        if (jobs[t].result < 0 || all < 0)
            all = -1;
        else
            all = all && jobs[t].result;
    }
    return all;
}

/* ---- weight side ----------------------------------------------------------------------- */

typedef struct {
    const char *b;
    int dt;
    int64_t bt, k, n, nseg, sbb, sbk, sbn;
    const float *r;
    float *br, *hi, *lo; /* [bt][nseg][k] */
    int colwise;
    int64_t items_per_batch;
} ws_ctx;

static inline int64_t seg_width(int64_t n, int64_t s) {
    int64_t w = n - s * SEG;
    return w < SEG ? w : SEG;
}

static int ws_rows(void *vctx, int64_t i0, int64_t i1) {
    ws_ctx *c = (ws_ctx *)vctx;
    float *buf = NULL;
    if (!(c->dt == DT_F32 && c->sbn == 1)) {
        buf = (float *)malloc(SEG * sizeof(float));
        if (!buf) return -1;
    }
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, k0 = (it % c->items_per_batch) * KB;
        int64_t k1 = k0 + KB < c->k ? k0 + KB : c->k;
        for (int64_t k = k0; k < k1; k++) {
            const char *row = c->b + (bi * c->sbb + k * c->sbk) * ESZ[c->dt];
            for (int64_t s = 0; s < c->nseg; s++) {
                int64_t w = seg_width(c->n, s);
                const char *p = row + s * SEG * c->sbn * ESZ[c->dt];
                const float *x;
                if (buf) {
                    cvt(p, c->dt, c->sbn, w, buf);
                    x = buf;
                } else {
                    x = (const float *)p;
                }
                float sum, hi, lo;
                run_stats(x, c->r ? c->r + s * SEG : NULL, w, &sum, &hi, &lo);
                if (isnan(sum) && has_nan(p, c->dt, c->sbn, w)) hi = lo = NAN;
                int64_t o = (bi * c->nseg + s) * c->k + k;
                c->br[o] = sum;
                c->hi[o] = hi;
                c->lo[o] = lo;
            }
        }
    }
    free(buf);
    return 1;
}

/* Column-major B (W.t()): a segment is 256 contiguous runs along K; lanes run along K and
 * each k sums its 256 values in index order, 16 at a time then into the total. The 16
 * columns of a chunk are read together, 64 k at a time (16 sequential streams), with the
 * partial sums, max and min of those k in registers. */
static int ws_cols(void *vctx, int64_t i0, int64_t i1) {
    ws_ctx *c = (ws_ctx *)vctx;
    float *mem = (float *)aligned_alloc(64, 3 * KCW * sizeof(float));
    if (!mem) return -1;
    float *tot = mem, *hi = mem + KCW, *lo = mem + 2 * KCW;
    int64_t kblocks = (c->k + KCW - 1) / KCW, esz = ESZ[c->dt];
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, rem = it % c->items_per_batch;
        int64_t s = rem / kblocks, k0 = (rem % kblocks) * KCW;
        int64_t kc = c->k - k0 < KCW ? c->k - k0 : KCW, w = seg_width(c->n, s);
        for (int64_t q = 0; q < KCW; q++) {
            tot[q] = 0.0f;
            hi[q] = -INFINITY;
            lo[q] = INFINITY;
        }
        const char *base = c->b + (bi * c->sbb + k0 * c->sbk + s * SEG * c->sbn) * esz;
        const float *rs = c->r ? c->r + s * SEG : NULL;
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            int64_t j1 = j0 + 16 < w ? j0 + 16 : w;
            int64_t q0 = 0;
            for (; q0 + 64 <= kc; q0 += 64) {
                v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                v16 h0 = vld(hi + q0), h1 = vld(hi + q0 + 16), h2 = vld(hi + q0 + 32), h3 = vld(hi + q0 + 48);
                v16 l0 = vld(lo + q0), l1 = vld(lo + q0 + 16), l2 = vld(lo + q0 + 32), l3 = vld(lo + q0 + 48);
                for (int64_t j = j0; j < j1; j++) {
                    const char *p = base + (j * c->sbn + q0) * esz;
                    v16 v0 = load16(p, c->dt, 16), v1 = load16(p + 16 * esz, c->dt, 16);
                    v16 v2 = load16(p + 32 * esz, c->dt, 16), v3 = load16(p + 48 * esz, c->dt, 16);
                    if (rs) {
                        v16 rj = splat(rs[j]);
                        v0 = v0 * rj;
                        v1 = v1 * rj;
                        v2 = v2 * rj;
                        v3 = v3 * rj;
                    }
                    p0 += v0;
                    p1 += v1;
                    p2 += v2;
                    p3 += v3;
                    h0 = vmax(v0, h0);
                    h1 = vmax(v1, h1);
                    h2 = vmax(v2, h2);
                    h3 = vmax(v3, h3);
                    l0 = vmin(v0, l0);
                    l1 = vmin(v1, l1);
                    l2 = vmin(v2, l2);
                    l3 = vmin(v3, l3);
                }
                vst(tot + q0, vld(tot + q0) + p0);
                vst(tot + q0 + 16, vld(tot + q0 + 16) + p1);
                vst(tot + q0 + 32, vld(tot + q0 + 32) + p2);
                vst(tot + q0 + 48, vld(tot + q0 + 48) + p3);
                vst(hi + q0, h0);
                vst(hi + q0 + 16, h1);
                vst(hi + q0 + 32, h2);
                vst(hi + q0 + 48, h3);
                vst(lo + q0, l0);
                vst(lo + q0 + 16, l1);
                vst(lo + q0 + 32, l2);
                vst(lo + q0 + 48, l3);
            }
            for (; q0 < kc; q0 += 16) {
                int64_t n = kc - q0 < 16 ? kc - q0 : 16;
                v16 p0 = {0}, h0 = vld(hi + q0), l0 = vld(lo + q0);
                for (int64_t j = j0; j < j1; j++) {
                    v16 v0 = load16(base + (j * c->sbn + q0) * esz, c->dt, n);
                    if (rs) v0 = v0 * splat(rs[j]);
                    p0 += v0;
                    h0 = vmax(v0, h0);
                    l0 = vmin(v0, l0);
                }
                vst(tot + q0, vld(tot + q0) + p0);
                vst(hi + q0, h0);
                vst(lo + q0, l0);
            }
        }
        float *obr = c->br + (bi * c->nseg + s) * c->k + k0;
        float *ohi = c->hi + (bi * c->nseg + s) * c->k + k0;
        float *olo = c->lo + (bi * c->nseg + s) * c->k + k0;
        for (int64_t q = 0; q < kc; q++) {
            obr[q] = tot[q];
            ohi[q] = hi[q];
            olo[q] = lo[q];
            if (isnan(tot[q]) && has_nan(base + q * c->sbk * esz, c->dt, c->sbn, w)) ohi[q] = olo[q] = NAN;
        }
    }
    free(mem);
    return 1;
}

/* Per segment: the aggregates of abft.weight_side and the factors of WeightSide._factors.
 * Sums over k run in double, in k order (one thread: the result does not depend on the
 * thread count). agg is [9][bt][nseg]: p1, p2, v, col_norm, f_mean, f_cross_mu,
 * f_cross_sd, f_spread, and bad as 0 / 1 in the last plane. Returns mu_scale. */
static float ws_aggregate(const ws_ctx *c, float *agg, uint8_t *bad) {
    int64_t plane = c->bt * c->nseg;
    float *p1o = agg, *p2o = agg + plane, *vo = agg + 2 * plane, *cno = agg + 3 * plane;
    float *fm = agg + 4 * plane, *fcm = agg + 5 * plane, *fcs = agg + 6 * plane, *fsp = agg + 7 * plane;
    int overflow = 0;
    for (int64_t bi = 0; bi < c->bt; bi++) {
        for (int64_t s = 0; s < c->nseg; s++) {
            int64_t o = bi * c->nseg + s;
            const float *br = c->br + o * c->k, *hi = c->hi + o * c->k, *lo = c->lo + o * c->k;
            float w = (float)seg_width(c->n, s);
            double p1 = 0, p2 = 0, v = 0, cn = 0;
            for (int64_t k = 0; k < c->k; k++) {
                float mu = br[k] / w;
                float var = fabsf((hi[k] - mu) * (mu - lo[k]));
                float m = (isnan(hi[k]) || isnan(lo[k])) ? NAN : (hi[k] > -lo[k] ? hi[k] : -lo[k]);
                p1 += fabsf(mu);
                p2 += mu * mu;
                v += var;
                cn += m * m;
            }
            float P1 = (float)p1, P2 = (float)p2, V = (float)v;
            p1o[o] = P1;
            p2o[o] = P2;
            vo[o] = V;
            cno[o] = sqrtf((float)cn);
            bad[o] = !(isfinite(P1) && isfinite(V));
            float sqrt_n = sqrtf(w), sqrt_v = sqrtf(V);
            fm[o] = w * P1;
            if (!isfinite(fm[o])) overflow = 1;
            fcm[o] = (4.0f * sqrt_n) * sqrt_v;
            fcs[o] = (4.0f * w) * sqrtf(P2);
            fsp[o] = sqrt_n * sqrt_v;
        }
    }
    if (!overflow) return 1.0f;
    /* n_s P1 overflowed somewhere: VABFT.md's order, (256 |muA|) (P1 n_s / 256) */
    for (int64_t o = 0; o < plane; o++) fm[o] = p1o[o] * ((float)seg_width(c->n, o % c->nseg) / (float)SEG);
    return (float)SEG;
}

/* ---- check ----------------------------------------------------------------------------- */

typedef struct {
    int64_t m, n, k, nseg, nb1, items_per_batch, rb;
    const char *a;
    int adt;
    int64_t sa0, sa1, sam, sak;
    const char *c;
    int cdt;
    int64_t sc0, sc1, scm, scn;
    const char *bias; /* NULL: no bias term */
    int bdt;
    int64_t sb0, sb1, sbm, sbn;
    const float *r;
    const float *br;
    int64_t sbr0, sbr1, sbrs; /* Br[k, s] at br + b0 sbr0 + b1 sbr1 + s sbrs + k */
    const float *fm, *fcm, *fcs, *fsp;
    int64_t sf0, sf1; /* factors: batch strides, segment stride 1 */
    float mu_scale, scale, alpha, beta, tiny, bias_round;
    float *diff, *thr, *mu, *hi, *lo; /* [nb][m][nseg], [nb][m] */
    uint8_t *ok, *zero;               /* [nb][m][nseg] */
    float *worst;                     /* [work items]: largest D / T of each item's rows */
} chk_ctx;

typedef struct {
    float *abuf;  /* KC * RB (or KCC * RBC): a converted block of A */
    float *cbuf;  /* SEG * 16 */
    v16 *acc;     /* RBMAX * nseg */
    float *ref, *csum, *bsum, *babs; /* [nseg][RBMAX] each: segment s of row r at s * RBMAX + r */
    float *floor;                    /* nseg */
    float sum[RBMAX], hi[RBMAX], lo[RBMAX];
} scratch;

static const float ZEROS[KC];

/* sum / max / min of a contiguous run p[0..k) of dtype dt, converted in registers: the
 * same lane assignment and order as acc_stats over consecutive KC blocks (KC is a
 * multiple of 64), with the 12 accumulators in registers for the whole run. */
static void row_stats(const char *p, int dt, int64_t k, float *sum, float *hi, float *lo) {
    int64_t esz = ESZ[dt], i = 0;
    v16 S[4], H[4], L[4];
    v16 s0 = splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
    v16 h0 = splat(-INFINITY), h1 = h0, h2 = h0, h3 = h0;
    v16 l0 = splat(INFINITY), l1 = l0, l2 = l0, l3 = l0;
    for (; i + 64 <= k; i += 64) {
        const char *q = p + i * esz;
        v16 v0 = load16(q, dt, 16), v1 = load16(q + 16 * esz, dt, 16);
        v16 v2 = load16(q + 32 * esz, dt, 16), v3 = load16(q + 48 * esz, dt, 16);
        s0 += v0;
        s1 += v1;
        s2 += v2;
        s3 += v3;
        h0 = vmax(v0, h0);
        h1 = vmax(v1, h1);
        h2 = vmax(v2, h2);
        h3 = vmax(v3, h3);
        l0 = vmin(v0, l0);
        l1 = vmin(v1, l1);
        l2 = vmin(v2, l2);
        l3 = vmin(v3, l3);
    }
    S[0] = s0, S[1] = s1, S[2] = s2, S[3] = s3;
    H[0] = h0, H[1] = h1, H[2] = h2, H[3] = h3;
    L[0] = l0, L[1] = l1, L[2] = l2, L[3] = l3;
    if (i < k) {
        float tmp[64];
        cvt(p + i * esz, dt, 1, k - i, tmp);
        acc_stats(tmp, NULL, k - i, S, H, L);
    }
    finish_stats(S, H, L, sum, hi, lo);
}

/* acc[r * nseg + (r & 3)] += x[r][0..kc) * b (lane i % 16, in i order) for rows r < padded,
 * four rows per Br load; x[r] holds dtype dt (a constant where inlined). Every dtype
 * converts to the same fp32 values, so a row's arithmetic does not depend on dt here. */
static inline __attribute__((always_inline)) void dot4(const char *const *x, int dt, const float *b, int64_t kc,
                                                       int64_t padded, v16 *acc, int64_t nseg) {
    int64_t kv = kc & ~(int64_t)15, esz = ESZ[dt];
    for (int64_t r = 0; r < padded; r += 4) {
        const char *x0 = x[r], *x1 = x[r + 1], *x2 = x[r + 2], *x3 = x[r + 3];
        v16 *a = acc + r * nseg;
        v16 a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
        for (int64_t i = 0; i < kv; i += 16) {
            v16 bv = vld(b + i);
            a0 += load16(x0 + i * esz, dt, 16) * bv;
            a1 += load16(x1 + i * esz, dt, 16) * bv;
            a2 += load16(x2 + i * esz, dt, 16) * bv;
            a3 += load16(x3 + i * esz, dt, 16) * bv;
        }
        for (int64_t i = kv; i < kc; i++) {
            int q = (int)(i & 15);
            a0[q] += ld(x0, dt, i) * b[i];
            a1[q] += ld(x1, dt, i) * b[i];
            a2[q] += ld(x2, dt, i) * b[i];
            a3[q] += ld(x3, dt, i) * b[i];
        }
        a[0] = a0;
        a[1] = a1;
        a[2] = a2;
        a[3] = a3;
    }
}

/* R <= 16 rows of A, each contiguous after conversion (row-major, or gathered): sum / max
 * / min of each row and A[row] . Br[:, s]. Rows go through the dot four at a time (each
 * Br load serves four rows; absent rows read zeros), but each row's arithmetic is its
 * own: lane k % 16 of one accumulator per (row, segment), in k order. */
static void a_rows(const chk_ctx *c, const char *pa, int64_t rows, const float *br, float *buf, v16 *acc,
                   float *sum, float *hi, float *lo, float *ref) {
    int64_t nseg = c->nseg, padded = (rows + 3) & ~(int64_t)3;
    /* contiguous rows: the statistics in one pass per row, accumulators in registers;
     * strided rows: per block of K from the gathered copy */
    int contig = c->sak == 1;
    v16 s[RB][4], h[RB][4], l[RB][4];
    if (contig) {
        for (int64_t r = 0; r < rows; r++)
            row_stats(pa + r * c->sam * ESZ[c->adt], c->adt, c->k, &sum[r], &hi[r], &lo[r]);
    } else {
        for (int64_t r = 0; r < rows; r++) init_stats(s[r], h[r], l[r]);
    }
    memset(acc, 0, sizeof(v16) * padded * nseg);
    /* rows read in place (fp32; or bf16 / fp16 converted in registers when few segments
     * reuse them), else converted once per block into buf */
    int direct = contig && (c->adt == DT_F32 || nseg <= 2);
    int xdt = direct ? c->adt : DT_F32;
    const char *x[RB];
    for (int64_t k0 = 0; k0 < c->k; k0 += KC) {
        int64_t kc = c->k - k0 < KC ? c->k - k0 : KC;
        for (int64_t r = 0; r < padded; r++) {
            const char *p = pa + (r * c->sam + k0 * c->sak) * ESZ[c->adt];
            if (r >= rows) {
                x[r] = (const char *)ZEROS; /* zero bytes: 0 in every dtype */
            } else if (direct) {
                x[r] = p;
            } else {
                cvt(p, c->adt, c->sak, kc, buf + r * KC);
                x[r] = (const char *)(buf + r * KC);
            }
        }
        if (!contig)
            for (int64_t r = 0; r < rows; r++) acc_stats((const float *)x[r], NULL, kc, s[r], h[r], l[r]);
        for (int64_t sg = 0; sg < nseg; sg++) {
            const float *b = br + sg * c->sbrs + k0;
            v16 *a = acc + 4 * sg;
            if (xdt == DT_F32)
                dot4(x, DT_F32, b, kc, padded, a, nseg);
            else if (xdt == DT_BF16)
                dot4(x, DT_BF16, b, kc, padded, a, nseg);
            else
                dot4(x, DT_F16, b, kc, padded, a, nseg);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        if (!contig) finish_stats(s[r], h[r], l[r], &sum[r], &hi[r], &lo[r]);
        for (int64_t sg = 0; sg < nseg; sg++) ref[sg * RBMAX + r] = hsum(acc[(r & ~(int64_t)3) * nseg + 4 * sg + (r & 3)]);
    }
}

/* R <= RBC rows of a column-major A (stride 1 along M): lane r % 16 of group r / 16 is row
 * r; each row sums in k order, 4 interleaved partials per block of 16 k (k0 a multiple of
 * 16), then into the total. A block of KCC k is read as KCC contiguous runs of R elements
 * (one stream, whatever the row count) into buf[q][RBC]; the groups then work from buf.
 * A row's arithmetic depends neither on R nor on its group. */
static void a_cols(const chk_ctx *c, const char *pa, int64_t rows, const float *br, float *buf, v16 *acc,
                   float *sum, float *hi, float *lo, float *ref) {
    int64_t ng = (rows + 15) / 16, nseg = c->nseg, esz = ESZ[c->adt];
    v16 tot[RBC / 16], h[RBC / 16], l[RBC / 16];
    for (int64_t g = 0; g < ng; g++) {
        tot[g] = splat(0.0f);
        h[g] = splat(-INFINITY);
        l[g] = splat(INFINITY);
    }
    memset(acc, 0, sizeof(v16) * ng * nseg);
    for (int64_t k0 = 0; k0 < c->k; k0 += KCC) {
        int64_t kc = c->k - k0 < KCC ? c->k - k0 : KCC;
        for (int64_t q = 0; q < kc; q++) {
            const char *p = pa + (k0 + q) * c->sak * esz;
            for (int64_t g = 0; g < ng; g++) {
                int64_t n = rows - 16 * g;
                vst(buf + RBC * q + 16 * g, load16(p + 16 * g * esz, c->adt, n < 16 ? n : 16));
            }
        }
        for (int64_t g = 0; g < ng; g++) {
            const float *x = buf + 16 * g;
            v16 t = tot[g], hg = h[g], lg = l[g];
            for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
#define COL(pj, q)                        \
    {                                     \
        v16 v = vld(x + RBC * (q));       \
        pj += v;                          \
        hg = vmax(v, hg);                 \
        lg = vmin(v, lg);                 \
    }
                int64_t q = q0;
                for (; q + 4 <= q1; q += 4) {
                    COL(p0, q) COL(p1, q + 1) COL(p2, q + 2) COL(p3, q + 3)
                }
                if (q < q1) COL(p0, q)
                if (q + 1 < q1) COL(p1, q + 1)
                if (q + 2 < q1) COL(p2, q + 2)
#undef COL
                t += (p0 + p1) + (p2 + p3);
            }
            tot[g] = t;
            h[g] = hg;
            l[g] = lg;
            for (int64_t sg = 0; sg < nseg; sg++) {
                const float *b = br + sg * c->sbrs + k0;
                v16 a = acc[g * nseg + sg];
                for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                    int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                    v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                    int64_t q = q0;
                    for (; q + 4 <= q1; q += 4) {
                        p0 += vld(x + RBC * q) * splat(b[q]);
                        p1 += vld(x + RBC * (q + 1)) * splat(b[q + 1]);
                        p2 += vld(x + RBC * (q + 2)) * splat(b[q + 2]);
                        p3 += vld(x + RBC * (q + 3)) * splat(b[q + 3]);
                    }
                    if (q < q1) p0 += vld(x + RBC * q) * splat(b[q]);
                    if (q + 1 < q1) p1 += vld(x + RBC * (q + 1)) * splat(b[q + 1]);
                    if (q + 2 < q1) p2 += vld(x + RBC * (q + 2)) * splat(b[q + 2]);
                    a += (p0 + p1) + (p2 + p3);
                }
                acc[g * nseg + sg] = a;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t g = r / 16, j = r % 16;
        sum[r] = tot[g][j];
        hi[r] = h[g][j];
        lo[r] = l[g][j];
        for (int64_t sg = 0; sg < nseg; sg++) ref[sg * RBMAX + r] = acc[g * nseg + sg][j];
    }
}

/* Segment sums of r * X over one row (stride sx along N): out[s * RBMAX], and of |r * X| in aout. */
static void x_row(const chk_ctx *c, const char *px, int dt, int64_t sx, float *buf, float *out, float *aout) {
    int direct = dt == DT_F32 && sx == 1;
    for (int64_t s = 0; s < c->nseg; s++) {
        int64_t w = seg_width(c->n, s);
        const char *p = px + s * SEG * sx * ESZ[dt];
        const float *x;
        if (direct) {
            x = (const float *)p;
        } else {
            cvt(p, dt, sx, w, buf);
            x = buf;
        }
        run_sum(x, c->r ? c->r + s * SEG : NULL, w, &out[s * RBMAX], aout ? &aout[s * RBMAX] : NULL);
    }
}

/* Segment sums of R <= 16 rows of a column-major X (stride 1 along M): lane r is row r. */
static void x_cols(const chk_ctx *c, const char *px, int dt, int64_t sx, int64_t rows, float *buf, float *out,
                   float *aout) {
    for (int64_t s = 0; s < c->nseg; s++) {
        int64_t w = seg_width(c->n, s);
        v16 tot = {0}, atot = {0};
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            int64_t j1 = j0 + 16 < w ? j0 + 16 : w;
            v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
#define XC(pj, qj, jj)                                                   \
    {                                                                    \
        int64_t col = s * SEG + (jj);                                    \
        v16 v = load16(px + col * sx * ESZ[dt], dt, rows);               \
        if (c->r) v = v * c->r[col];                                     \
        pj += v;                                                         \
        qj += vabs(v);                                                   \
    }
            int64_t j = j0;
            for (; j + 4 <= j1; j += 4) {
                XC(p0, q0, j) XC(p1, q1, j + 1) XC(p2, q2, j + 2) XC(p3, q3, j + 3)
            }
            if (j < j1) XC(p0, q0, j)
            if (j + 1 < j1) XC(p1, q1, j + 1)
            if (j + 2 < j1) XC(p2, q2, j + 2)
#undef XC
            tot += (p0 + p1) + (p2 + p3);
            atot += (q0 + q1) + (q2 + q3);
        }
        for (int64_t r = 0; r < rows; r++) {
            out[s * RBMAX + r] = tot[r];
            if (aout) aout[s * RBMAX + r] = atot[r];
        }
    }
}

/* segment sums of rows [m0, m0 + rows) of X (C or the bias) into out[s][r] (and aout) */
static void x_block(const chk_ctx *c, scratch *w, const char *px, int dt, int64_t sm, int64_t sn, int64_t rows,
                    float *out, float *aout) {
    if (sn != 1 && sm == 1) {
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
            x_cols(c, px + r0 * ESZ[dt], dt, sn, rows - r0 < 16 ? rows - r0 : 16, w->cbuf, out + r0,
                   aout ? aout + r0 : NULL);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        x_row(c, px + r * sm * ESZ[dt], dt, sn, w->cbuf, out + r, aout ? aout + r : NULL);
}

static inline v16 vsqrt(v16 x) {
#ifdef __AVX512F__
    return (v16)_mm512_sqrt_ps((__m512)x);
#else
    for (int j = 0; j < 16; j++) x[j] = sqrtf(x[j]);
    return x;
#endif
}
static inline v16 vsel(v16i m, v16 a, v16 b) { return (v16)((m & (v16i)a) | (~m & (v16i)b)); }
static inline v16i visnan(v16 x) { return x != x; }
static inline v16i visinf(v16 x) { return vabs(x) == splat(INFINITY); }

/* hypot(x, y) lane-wise, exact to a few ulp and without intermediate overflow:
 * m sqrt(1 + (n / m)^2) with m = max(|x|, |y|), n = min; 0 when both are 0; +inf when
 * either is infinite (even with a NaN, as C's hypot); NaN when either is NaN otherwise. */
static inline v16 vhypot(v16 x, v16 y) {
    v16 ax = vabs(x), ay = vabs(y);
    v16i xgt = ax > ay;
    v16 m = vsel(xgt, ax, ay), n = vsel(xgt, ay, ax);
    v16 q = n / m;
    v16 h = m * vsqrt(splat(1.0f) + q * q);
    h = vsel(m == splat(0.0f), splat(0.0f), h);
    h = vsel(visnan(x) | visnan(y), splat(NAN), h);
    return vsel(visinf(x) | visinf(y), splat(INFINITY), h);
}

/* D, T and the verdict of rows [0, rows) of a work item (row0: their flat index), 16
 * rows per vector: every row goes through the same lane-wise operations whichever lane
 * and group it lands in (padding lanes are computed and dropped). Stores mu / hi / lo,
 * diff / thr / ok / zero; *worst = the largest finite-verdict D / T. Returns whether
 * every segment passed with D and T finite. */
static int chk_rows(const chk_ctx *c, const scratch *w, int64_t rows, int64_t row0, const float *fm,
                    const float *fcm, const float *fcs, const float *fsp, float *worst_out) {
    int64_t nseg = c->nseg;
    int all_ok = 1;
    v16 worst = splat(0.0f);
    const v16 kf = splat((float)c->k), alpha = splat(c->alpha), beta = splat(c->beta);
    const v16 beta_abs = splat(fabsf(c->beta)), bias_round = splat(c->bias_round);
    const v16 mu_scale = splat(c->mu_scale), scale = splat(c->scale), inf = splat(INFINITY);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        v16 mu = vld(w->sum + r0) / kf, hi = vld(w->hi + r0), lo = vld(w->lo + r0);
        v16 sd = vsqrt(vabs((hi - mu) * (mu - lo))), mua = vabs(mu);
        for (int64_t j = 0; j < nr; j++) {
            c->mu[row0 + r0 + j] = mu[j];
            c->hi[row0 + r0 + j] = hi[j];
            c->lo[row0 + r0 + j] = lo[j];
        }
        v16 mus = mua * mu_scale;
        for (int64_t s = 0; s < nseg; s++) {
            int64_t q = s * RBMAX + r0;
            v16 ref = vld(w->ref + q) * alpha, floor = splat(w->floor[s]);
            if (c->bias) {
                ref = ref + beta * vld(w->bsum + q);
                floor = floor + bias_round * (vld(w->babs + q) * beta_abs);
            }
            v16 bracket = mus * splat(fm[s]);
            bracket = bracket + vhypot(mua * splat(fcm[s]), sd * splat(fcs[s]));
            bracket = bracket + sd * splat(fsp[s]);
            v16 t = floor + scale * bracket;
            v16 d = vabs(vld(w->csum + q) - ref);
            v16i okv = (d <= t) & (d < inf);
            v16i good = okv & (vabs(t) < inf);
            v16 ratio = d / t;
            v16i gt = ratio > worst;
            for (int64_t j = 0; j < nr; j++) {
                int64_t o = (row0 + r0 + j) * nseg + s;
                c->diff[o] = d[j];
                c->thr[o] = t[j];
                c->ok[o] = (uint8_t)(okv[j] != 0);
                c->zero[o] = 0;
                all_ok = all_ok && good[j];
                if (gt[j]) worst[j] = ratio[j];
            }
        }
    }
    *worst_out = hmax(worst);
    return all_ok;
}

static int chk_work(void *vctx, int64_t i0, int64_t i1) {
    const chk_ctx *c = (const chk_ctx *)vctx;
    scratch w;
    int64_t nseg = c->nseg;
    size_t per = (size_t)RBMAX * nseg * sizeof(float);
    char *mem = (char *)aligned_alloc(64, KC * RB * 4 + SEG * 16 * 4 + RBMAX * nseg * sizeof(v16) + 4 * per + nseg * sizeof(float) + 256);
    if (!mem) return -1;
    w.abuf = (float *)mem;
    w.cbuf = w.abuf + KC * RB;
    w.acc = (v16 *)(w.cbuf + SEG * 16);
    w.ref = (float *)(w.acc + RBMAX * nseg);
    w.csum = w.ref + RBMAX * nseg;
    w.bsum = w.csum + RBMAX * nseg;
    w.babs = w.bsum + RBMAX * nseg;
    int all_ok = 1;
    /* n_s * tiny(C) is subnormal for fp32 / bf16 C: computed once per segment here, as a
     * subnormal product costs a microcode assist per (row, segment) */
    w.floor = w.babs + RBMAX * nseg;
    for (int64_t s = 0; s < nseg; s++) w.floor[s] = (float)seg_width(c->n, s) * c->tiny;
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, m0 = (it % c->items_per_batch) * c->rb;
        int64_t b0 = bi / c->nb1, b1 = bi % c->nb1;
        int64_t rows = c->m - m0 < c->rb ? c->m - m0 : c->rb;
        const char *pa = c->a + (b0 * c->sa0 + b1 * c->sa1 + m0 * c->sam) * ESZ[c->adt];
        const float *br = c->br + b0 * c->sbr0 + b1 * c->sbr1;
        if (c->rb == RBC) {
            a_cols(c, pa, rows, br, w.abuf, w.acc, w.sum, w.hi, w.lo, w.ref);
        } else {
            a_rows(c, pa, rows, br, w.abuf, w.acc, w.sum, w.hi, w.lo, w.ref);
        }
        const char *pc = c->c + (b0 * c->sc0 + b1 * c->sc1 + m0 * c->scm) * ESZ[c->cdt];
        x_block(c, &w, pc, c->cdt, c->scm, c->scn, rows, w.csum, NULL);
        if (c->bias) {
            const char *pb = c->bias + (b0 * c->sb0 + b1 * c->sb1 + m0 * c->sbm) * ESZ[c->bdt];
            x_block(c, &w, pb, c->bdt, c->sbm, c->sbn, rows, w.bsum, w.babs);
        }
        /* padding lanes of the last group of 16 rows: zeros (computed, then dropped) */
        for (int64_t r = rows; r < ((rows + 15) & ~(int64_t)15); r++) {
            w.sum[r] = w.hi[r] = w.lo[r] = 0.0f;
            for (int64_t s = 0; s < nseg; s++)
                w.ref[s * RBMAX + r] = w.csum[s * RBMAX + r] = w.bsum[s * RBMAX + r] = w.babs[s * RBMAX + r] = 0.0f;
        }
        /* NaN in a row of A: max / min are NaN (torch semantics), found by a rescan */
        for (int64_t r = 0; r < rows; r++)
            if (isnan(w.sum[r]) && has_nan(pa + r * c->sam * ESZ[c->adt], c->adt, c->sak, c->k)) w.hi[r] = w.lo[r] = NAN;
        const float *fm = c->fm + b0 * c->sf0 + b1 * c->sf1, *fcm = c->fcm + b0 * c->sf0 + b1 * c->sf1;
        const float *fcs = c->fcs + b0 * c->sf0 + b1 * c->sf1, *fsp = c->fsp + b0 * c->sf0 + b1 * c->sf1;
        int64_t row0 = bi * c->m + m0;
        int ok_all = chk_rows(c, &w, rows, row0, fm, fcm, fcs, fsp, &c->worst[it]);
        all_ok = all_ok && ok_all;
    }
    free(mem);
    return all_ok;
}

/* ---- Python bindings (METH_FASTCALL: a few ns per argument) ----------------------------- */

#define I(i) PyLong_AsLongLong(args[i])
#define P(i) ((char *)(intptr_t)PyLong_AsLongLong(args[i]))
#define F(i) ((float)PyFloat_AsDouble(args[i]))

/* weight_side(b, dt, bt, k, n, sbb, sbk, sbn, r, br, hi, lo, agg, bad, threads) -> mu_scale */
static PyObject *py_weight_side(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "weight_side: expected 15 arguments");
        return NULL;
    }
    ws_ctx c;
    c.b = P(0);
    c.dt = (int)I(1);
    c.bt = I(2);
    c.k = I(3);
    c.n = I(4);
    c.nseg = (c.n + SEG - 1) / SEG;
    c.sbb = I(5);
    c.sbk = I(6);
    c.sbn = I(7);
    c.r = (const float *)P(8);
    c.br = (float *)P(9);
    c.hi = (float *)P(10);
    c.lo = (float *)P(11);
    float *agg = (float *)P(12);
    uint8_t *bad = (uint8_t *)P(13);
    int threads = (int)I(14);
    if (PyErr_Occurred()) return NULL;
    if (c.dt < 0 || c.dt > 2) {
        PyErr_SetString(PyExc_ValueError, "weight_side: bad dtype code");
        return NULL;
    }
    /* column-major: runs along K (W.t() of a Linear); else rows of B, gathered if strided */
    c.colwise = c.sbk == 1 && c.sbn != 1 && c.k > 1;
    c.items_per_batch = c.colwise ? c.nseg * ((c.k + KCW - 1) / KCW) : (c.k + KB - 1) / KB;
    if (threads < 0)
        threads = -threads;
    else if (c.bt * c.k * c.n < PAR_MIN)
        threads = 1;
    int rc;
    float mu_scale;
    Py_BEGIN_ALLOW_THREADS
    rc = parallel(c.colwise ? ws_cols : ws_rows, &c, c.bt * c.items_per_batch, threads);
    mu_scale = rc < 0 ? 0.0f : ws_aggregate(&c, agg, bad);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(mu_scale);
}

/* check(m, n, k, nb0, nb1,
 *       a, adt, sa0, sa1, sam, sak,  c, cdt, sc0, sc1, scm, scn,
 *       bias, bdt, sb0, sb1, sbm, sbn,  r,  br, sbr0, sbr1, sbrs,
 *       fm, fcm, fcs, fsp, sf0, sf1,
 *       mu_scale, scale, alpha, beta, tiny, bias_round,
 *       vals (diff, thr: 2 planes), rows (mu, hi, lo: 3 planes), flags (ok, zero: 2 planes),
 *       threads) -> bool: every segment passed with D and T finite */
static PyObject *py_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 44) {
        PyErr_SetString(PyExc_TypeError, "check: expected 44 arguments");
        return NULL;
    }
    chk_ctx c;
    c.m = I(0);
    c.n = I(1);
    c.k = I(2);
    int64_t nb0 = I(3);
    c.nb1 = I(4);
    c.a = P(5);
    c.adt = (int)I(6);
    c.sa0 = I(7);
    c.sa1 = I(8);
    c.sam = I(9);
    c.sak = I(10);
    c.c = P(11);
    c.cdt = (int)I(12);
    c.sc0 = I(13);
    c.sc1 = I(14);
    c.scm = I(15);
    c.scn = I(16);
    c.bias = P(17);
    c.bdt = (int)I(18);
    c.sb0 = I(19);
    c.sb1 = I(20);
    c.sbm = I(21);
    c.sbn = I(22);
    c.r = (const float *)P(23);
    c.br = (const float *)P(24);
    c.sbr0 = I(25);
    c.sbr1 = I(26);
    c.sbrs = I(27);
    c.fm = (const float *)P(28);
    c.fcm = (const float *)P(29);
    c.fcs = (const float *)P(30);
    c.fsp = (const float *)P(31);
    c.sf0 = I(32);
    c.sf1 = I(33);
    c.mu_scale = F(34);
    c.scale = F(35);
    c.alpha = F(36);
    c.beta = F(37);
    c.tiny = F(38);
    c.bias_round = F(39);
    float *vals = (float *)P(40), *rows = (float *)P(41);
    uint8_t *flags = (uint8_t *)P(42);
    int threads = (int)I(43);
    if (PyErr_Occurred()) return NULL;
    if (c.adt < 0 || c.adt > 2 || c.cdt < 0 || c.cdt > 2 || c.bdt < 0 || c.bdt > 2 || c.m <= 0 || c.k <= 0 ||
        c.n <= 0 || nb0 <= 0 || c.nb1 <= 0) {
        PyErr_SetString(PyExc_ValueError, "check: bad dtype code or empty operand");
        return NULL;
    }
    c.nseg = (c.n + SEG - 1) / SEG;
    int64_t nb = nb0 * c.nb1, plane = nb * c.m * c.nseg;
    c.diff = vals;
    c.thr = vals + plane;
    c.mu = rows;
    c.hi = rows + nb * c.m;
    c.lo = rows + 2 * nb * c.m;
    c.ok = flags;
    c.zero = flags + plane;
    c.rb = c.sak != 1 && c.sam == 1 ? RBC : RB;
    c.items_per_batch = (c.m + c.rb - 1) / c.rb;
    if (threads < 0)
        threads = -threads;
    else if (nb * c.m * (c.k + c.n) < PAR_MIN)
        threads = 1;
    int64_t items = nb * c.items_per_batch;
    c.worst = (float *)malloc((size_t)items * sizeof(float));
    if (!c.worst) return PyErr_NoMemory();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = parallel(chk_work, &c, items, threads);
    Py_END_ALLOW_THREADS
    float worst = 0.0f;
    for (int64_t i = 0; i < items; i++)
        if (c.worst[i] > worst) worst = c.worst[i];
    free(c.worst);
    if (rc < 0) return PyErr_NoMemory();
    /* (every segment passed with D and T finite, largest D / T where that holds) */
    return Py_BuildValue("(Nd)", PyBool_FromLong(rc), (double)worst);
}

/* noop(*args): the binding's own cost, for measuring the per-call overhead */
static PyObject *py_noop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    (void)nargs;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"weight_side", (PyCFunction)(void (*)(void))py_weight_side, METH_FASTCALL, "V-ABFT weight side (see native.py)"},
    {"check", (PyCFunction)(void (*)(void))py_check, METH_FASTCALL, "V-ABFT check (see native.py)"},
    {"noop", (PyCFunction)(void (*)(void))py_noop, METH_FASTCALL, "does nothing (overhead probe)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_vabft_cpu", "V-ABFT CPU kernels (sdc_guard.native)",
                                    -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__vabft_cpu(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod) {
        PyModule_AddIntConstant(mod, "SEGMENT", SEG);
        PyModule_AddIntConstant(mod, "PAR_MIN", PAR_MIN);
    }
    return mod;
}
