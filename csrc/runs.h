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
 * accumulators are combined as (0 + 1) + (2 + 3) into *c, then hsum. */
#define ACC(i) (((i) >> 4) & 3)
static inline void comb4(const v16 *a, v16 *c) {
    for (int pt = 0; pt < NPART; pt++)
        pset(c, pt, (pget(&a[0], pt) + pget(&a[1], pt)) + (pget(&a[2], pt) + pget(&a[3], pt)));
}

/* The sums of the run x[0..w) (dtype dt, converted in registers; times r), of |.| when
 * A and of the squares when Q, as comb4 vectors into *S, *A and *Q: element i goes to
 * lane i % 16 of accumulator ACC(i), the four accumulators start at 0. One part at a time
 * (lanes.h), constant indices only, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void run_sum(const char *x, int dt, const float *r, int64_t w, v16 *S,
                                                          v16 *A, v16 *Q) {
    const int64_t esz = ESZ[dt];
    for (int pt = 0; pt < NPART; pt++) {
        const char *xh = x + pt * PW * esz;
        const float *rh = r ? r + pt * PW : NULL;
        vpart s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        vpart q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
        int64_t i = 0;
#define LDX(o) (r ? pload(xh + (i + (o)) * esz, dt, PW) * pld(rh + i + (o)) : pload(xh + (i + (o)) * esz, dt, PW))
        for (; i + 64 <= w; i += 64) {
            vpart v0 = LDX(0), v1 = LDX(16), v2 = LDX(32), v3 = LDX(48);
            s0 += v0;
            s1 += v1;
            s2 += v2;
            s3 += v3;
            if (A) {
                a0 += pabs(v0);
                a1 += pabs(v1);
                a2 += pabs(v2);
                a3 += pabs(v3);
            }
            if (Q) {
                q0 += v0 * v0;
                q1 += v1 * v1;
                q2 += v2 * v2;
                q3 += v3 * v3;
            }
        }
#define SREM(j, sj, aj, qj)                                                              \
        if (w - i > 16 * (j)) {                                                          \
            int64_t n = w - i - 16 * (j);                                                \
            vpart v;                                                                     \
            if (n >= 16) {                                                               \
                v = LDX(16 * (j));                                                       \
            } else { /* this part's lanes of the tail, the rest 0 (0 * 0 with r) */     \
                int64_t o = i + 16 * (j), nh = n - pt * PW;                              \
                v = pload(xh + o * esz, dt, nh);                                         \
                if (r) v = v * pload((const char *)(rh + o), DT_F32, nh);               \
            }                                                                            \
            sj += v;                                                                     \
            aj += pabs(v);                                                               \
            qj += v * v;                                                                 \
        }
        SREM(0, s0, a0, q0)
        SREM(1, s1, a1, q1)
        SREM(2, s2, a2, q2)
        SREM(3, s3, a3, q3)
#undef SREM
#undef LDX
        pset(S, pt, (s0 + s1) + (s2 + s3)); /* comb4 */
        if (A) pset(A, pt, (a0 + a1) + (a2 + a3));
        if (Q) pset(Q, pt, (q0 + q1) + (q2 + q3));
    }
}

/* Part pt (lanes.h) of the run x[0..w) (times r) accumulated into its sum / max / min
 * accumulators s, h, l (4 each; the caller's locals, kept in registers once inlined), and
 * into the sums of |.| in a when ABS (a constant where inlined). */
static inline __attribute__((always_inline)) void part_stats(const float *x, const float *r, int64_t w, int pt,
                                                             vpart *s, vpart *h, vpart *l, int ABS, vpart *a) {
    const float *xh = x + pt * PW, *rh = r ? r + pt * PW : NULL;
    vpart s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
    vpart h0 = h[0], h1 = h[1], h2 = h[2], h3 = h[3];
    vpart l0 = l[0], l1 = l[1], l2 = l[2], l3 = l[3];
    vpart a0 = psplat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    if (ABS) a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    int64_t i = 0;
#define LD(o) (r ? pld(xh + i + (o)) * pld(rh + i + (o)) : pld(xh + i + (o)))
#define STEP(sj, hj, lj, aj, v, vh, vl) \
    sj += v;                            \
    hj = pmax(vh, hj);                  \
    lj = pmin(vl, lj);                  \
    if (ABS) aj += pabs(v);
    for (; i + 64 <= w; i += 64) {
        vpart v0 = LD(0), v1 = LD(16), v2 = LD(32), v3 = LD(48);
        STEP(s0, h0, l0, a0, v0, v0, v0)
        STEP(s1, h1, l1, a1, v1, v1, v1)
        STEP(s2, h2, l2, a2, v2, v2, v2)
        STEP(s3, h3, l3, a3, v3, v3, v3)
    }
#define REM(j, sj, hj, lj, aj)                                                           \
    if (w - i > 16 * (j)) {                                                              \
        int64_t n = w - i - 16 * (j);                                                    \
        vpart v, vh, vl;                                                                 \
        if (n >= 16) {                                                                   \
            v = vh = vl = LD(16 * (j));                                                  \
        } else { /* this part's lanes of the tail; the rest 0, -inf and +inf */         \
            int64_t o = i + 16 * (j), nh = n - pt * PW;                                  \
            vpmask in = pindex() < (int32_t)nh;                                          \
            v = pload((const char *)(xh + o), DT_F32, nh);                               \
            if (r) v = v * pload((const char *)(rh + o), DT_F32, nh);                    \
            vh = psel(in, v, psplat(-INFINITY));                                         \
            vl = psel(in, v, psplat(INFINITY));                                          \
        }                                                                                \
        STEP(sj, hj, lj, aj, v, vh, vl)                                                  \
    }
    REM(0, s0, h0, l0, a0)
    REM(1, s1, h1, l1, a1)
    REM(2, s2, h2, l2, a2)
    REM(3, s3, h3, l3, a3)
#undef REM
#undef STEP
#undef LD
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
    h[0] = h0, h[1] = h1, h[2] = h2, h[3] = h3;
    l[0] = l0, l[1] = l1, l[2] = l2, l[3] = l3;
    if (ABS) a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
}

/* Accumulate sum / max / min of the run x[0..w) (times r) into S, H, L (4 each). */
static inline void acc_stats(const float *x, const float *r, int64_t w, v16 *S, v16 *H, v16 *L) {
    for (int pt = 0; pt < NPART; pt++) {
        vpart s[4], h[4], l[4];
        for (int j = 0; j < 4; j++) s[j] = pget(&S[j], pt), h[j] = pget(&H[j], pt), l[j] = pget(&L[j], pt);
        part_stats(x, r, w, pt, s, h, l, 0, NULL);
        for (int j = 0; j < 4; j++) pset(&S[j], pt, s[j]), pset(&H[j], pt, h[j]), pset(&L[j], pt, l[j]);
    }
}

/* The accumulators' starting values: 0, -inf, +inf */
static inline void init_stats(v16 *S, v16 *H, v16 *L) {
    for (int pt = 0; pt < NPART; pt++)
        for (int j = 0; j < 4; j++) {
            pset(&S[j], pt, psplat(0.0f));
            pset(&H[j], pt, psplat(-INFINITY));
            pset(&L[j], pt, psplat(INFINITY));
        }
}

/* init_stats, acc_stats and comb_stats (below) of one run, the accumulators in
 * registers throughout; with the sum of |.| into *abs, combined as the sum is */
static inline void run_stats(const float *x, const float *r, int64_t w, v16 *sum, v16 *abs, v16 *hi, v16 *lo) {
    for (int pt = 0; pt < NPART; pt++) {
        vpart s[4], a[4], h[4], l[4];
        for (int j = 0; j < 4; j++)
            s[j] = a[j] = psplat(0.0f), h[j] = psplat(-INFINITY), l[j] = psplat(INFINITY);
        part_stats(x, r, w, pt, s, h, l, 1, a);
        pset(sum, pt, (s[0] + s[1]) + (s[2] + s[3]));
        pset(abs, pt, (a[0] + a[1]) + (a[2] + a[3]));
        pset(hi, pt, pmax(pmax(h[0], h[1]), pmax(h[2], h[3])));
        pset(lo, pt, pmin(pmin(l[0], l[1]), pmin(l[2], l[3])));
    }
}

/* The four accumulators of each of sum / max / min combined into one vector, which
 * hsum / hmax / hmin (one run) or finish16 (16 runs) reduce: a run's sum / max / min is
 * hsum of comb4(S), hmax(max of H) and hmin(min of L), whichever of the two reduces it. */
static inline void comb_stats(const v16 *S, const v16 *H, const v16 *L, v16 *sum, v16 *hi, v16 *lo) {
    comb4(S, sum);
    for (int pt = 0; pt < NPART; pt++) {
        pset(hi, pt, pmax(pmax(pget(&H[0], pt), pget(&H[1], pt)), pmax(pget(&H[2], pt), pget(&H[3], pt))));
        pset(lo, pt, pmin(pmin(pget(&L[0], pt), pget(&L[1], pt)), pmin(pget(&L[2], pt), pget(&L[3], pt))));
    }
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
