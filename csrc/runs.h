/*
 * runs.h: sums, max and min of a contiguous run of fp32 values in a fixed order.
 *
 * This is the lane assignment that makes results batch invariant: element i of a run
 * goes to lane i % 16 of accumulator (i / 16) % 4 whatever the run's length, where it
 * starts, or which thread reads it, and the accumulators are reduced by one fixed tree
 * (lanes.h). The weight side (rows of B) and the check (rows of A, C and the bias) both
 * sum runs through these helpers, so a run's result never depends on who computes it.
 *
 * Max / min ignore a NaN (maxps / minps); a caller whose sum came out NaN rescans the
 * run with has_nan, so that max / min can be NaN as torch's are.
 */
#ifndef VABFT_RUNS_H
#define VABFT_RUNS_H

#include "lanes.h"

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
static inline __attribute__((always_inline)) void acc_sum(const float *x, const float *r, int64_t w, v16 *S, v16 *A) {
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

/* The four accumulators of each of sum / max / min combined into one vector, which
 * hsum / hmax / hmin (one run) or finish16 (16 runs) reduce: a run's sum / max / min is
 * hsum(comb4(S)), hmax(max of H) and hmin(min of L), whichever of the two reduces it. */
static inline void comb_stats(const v16 *S, const v16 *H, const v16 *L, v16 *sum, v16 *hi, v16 *lo) {
    *sum = comb4(S);
    *hi = vmax(vmax(H[0], H[1]), vmax(H[2], H[3]));
    *lo = vmin(vmin(L[0], L[1]), vmin(L[2], L[3]));
}

/* sum / max / min of 16 runs at once from their comb_stats vectors: 16 lanes stored to
 * each of sum, hi, lo */
static inline void finish16(const v16 *vs, const v16 *vh, const v16 *vl, float *sum, float *hi, float *lo) {
    vst(sum, hsum16(vs));
    vst(hi, hmax16(vh));
    vst(lo, hmin16(vl));
}

/* whether p[i * stride], i < n, holds a NaN (the rare path after a NaN sum) */
static inline int has_nan(const char *p, int dt, int64_t stride, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (isnan(ld(p, dt, i * stride))) return 1;
    return 0;
}

#endif /* VABFT_RUNS_H */
