/*
 * weight_side.c: the weight-side encoding of V-ABFT, computed once per weight.
 *
 * For B [Bt, K, N]: Br[k, s] = sum over segment s of r[j] B[k, j], Babs[k, s] = the sum of
 * |r[j] B[k, j]|, with the max and min of each (k, segment) run (ws_rows for row-major or
 * strided B, ws_cols for a column-major B such as W.t() of a Linear), then per segment
 * the aggregates of abft.weight_side and the four threshold factors of
 * WeightSide._factors, in fp64 (ws_aggregate), so that a check needs nothing of B but
 * these.
 *
 * Both layouts reduce each run in the order that runs.h fixes, so Br does not depend on
 * B's strides; the aggregates run on one thread in a fixed order, so they do not depend on
 * the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "runs.h"

#define KCW 1024 /* K per work item of a column-major weight side (a multiple of 16) */
#define KB 64    /* K rows per work item of a row-major weight side */

/* Row-major (or strided) B: each (k, segment) is one run along N, read in place when fp32
 * and contiguous, else gathered into buf first; items are KB rows of k. Rows are read in
 * order, 16 at a time: each (k, segment) run into three vectors (vec, [3][nseg][16]),
 * then per segment the 16 runs reduce at once (finish16). */
static int ws_rows(void *vctx, int64_t i0, int64_t i1) {
    ws_ctx *c = (ws_ctx *)vctx;
    int64_t nseg = c->nseg, esz = ESZ[c->dt];
    int gather = !(c->dt == DT_F32 && c->sbn == 1);
    v16 *vec = (v16 *)aligned_alloc(64, 4 * 16 * nseg * sizeof(v16) + SEG * sizeof(float));
    if (!vec) return -1;
    float *buf = (float *)(vec + 4 * 16 * nseg);
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, k0 = (it % c->items_per_batch) * KB;
        int64_t k1 = k0 + KB < c->k ? k0 + KB : c->k;
        for (int64_t j0 = k0; j0 < k1; j0 += 16) {
            int64_t nk = k1 - j0 < 16 ? k1 - j0 : 16;
            for (int64_t j = 0; j < 16; j++) {
                const char *row = c->b + (bi * c->sbb + (j0 + j) * c->sbk) * esz;
                for (int64_t s = 0; s < nseg; s++) {
                    v16 *vs = vec + s * 16, *vh = vs + 16 * nseg, *vl = vh + 16 * nseg, *va = vl + 16 * nseg;
                    if (j >= nk) {
                        vs[j] = vh[j] = vl[j] = va[j] = splat(0.0f);
                        continue;
                    }
                    int64_t w = seg_width(c->n, s);
                    const char *p = row + s * SEG * c->sbn * esz;
                    const float *x;
                    if (gather) {
                        cvt(p, c->dt, c->sbn, w, buf);
                        x = buf;
                    } else {
                        x = (const float *)p;
                    }
                    run_stats(x, c->r ? c->r + s * SEG : NULL, w, &vs[j], &va[j], &vh[j], &vl[j]);
                }
            }
            for (int64_t s = 0; s < nseg; s++) {
                v16 *vs = vec + s * 16, *vh = vs + 16 * nseg, *vl = vh + 16 * nseg, *va = vl + 16 * nseg;
                float sum[16], hi[16], lo[16], ab[16];
                finish16(vs, vh, vl, sum, hi, lo);
                vst(ab, hsum16(va));
                int64_t o = (bi * nseg + s) * c->k + j0, w = seg_width(c->n, s);
                for (int64_t j = 0; j < nk; j++) {
                    if (isnan(sum[j]) &&
                        has_nan(c->b + (bi * c->sbb + (j0 + j) * c->sbk + s * SEG * c->sbn) * esz, c->dt, c->sbn, w))
                        hi[j] = lo[j] = NAN;
                    c->br[o + j] = sum[j];
                    c->babs[o + j] = ab[j];
                    c->hi[o + j] = hi[j];
                    c->lo[o + j] = lo[j];
                }
            }
        }
    }
    free(vec);
    return 1;
}

/* Column-major B (W.t()): a segment is 256 contiguous runs along K; lanes run along K and
 * each k sums its 256 values in index order, 16 at a time then into the total. The 16
 * columns of a chunk are read together, 64 k at a time (16 sequential streams), with the
 * partial sums, max and min of those k in registers. */
static int ws_cols(void *vctx, int64_t i0, int64_t i1) {
    ws_ctx *c = (ws_ctx *)vctx;
    float *mem = (float *)aligned_alloc(64, 4 * KCW * sizeof(float));
    if (!mem) return -1;
    float *tot = mem, *hi = mem + KCW, *lo = mem + 2 * KCW, *ab = mem + 3 * KCW;
    int64_t kblocks = (c->k + KCW - 1) / KCW, esz = ESZ[c->dt];
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, rem = it % c->items_per_batch;
        int64_t s = rem / kblocks, k0 = (rem % kblocks) * KCW;
        int64_t kc = c->k - k0 < KCW ? c->k - k0 : KCW, w = seg_width(c->n, s);
        for (int64_t q = 0; q < ((kc + 15) & ~(int64_t)15); q++) { /* the vectors this item touches */
            tot[q] = ab[q] = 0.0f;
            hi[q] = -INFINITY;
            lo[q] = INFINITY;
        }
        const char *base = c->b + (bi * c->sbb + k0 * c->sbk + s * SEG * c->sbn) * esz;
        const float *rs = c->r ? c->r + s * SEG : NULL;
        for (int64_t j0 = 0; j0 < w; j0 += 16) {
            int64_t j1 = j0 + 16 < w ? j0 + 16 : w;
            int64_t q0 = 0;
            for (; q0 + 64 <= kc; q0 += 64) {
                for (int pt = 0; pt < NPART; pt++) { /* a part at a time (lanes.h) */
                    int64_t qp = q0 + pt * PW;
                    vpart p[4], h[4], l[4], v[4], a[4];
                    for (int u = 0; u < 4; u++)
                        p[u] = a[u] = psplat(0.0f), h[u] = pld(hi + qp + 16 * u), l[u] = pld(lo + qp + 16 * u);
                    for (int64_t j = j0; j < j1; j++) {
                        pload4(base + (j * c->sbn + qp) * esz, c->dt, v);
                        if (rs)
                            for (int u = 0; u < 4; u++) v[u] = v[u] * psplat(rs[j]);
                        pstats4(v, p, h, l);
                        for (int u = 0; u < 4; u++) a[u] += pabs(v[u]);
                    }
                    for (int u = 0; u < 4; u++) {
                        pst(tot + qp + 16 * u, pld(tot + qp + 16 * u) + p[u]);
                        pst(ab + qp + 16 * u, pld(ab + qp + 16 * u) + a[u]);
                        pst(hi + qp + 16 * u, h[u]);
                        pst(lo + qp + 16 * u, l[u]);
                    }
                }
            }
            for (; q0 < kc; q0 += 16) {
                int64_t n = kc - q0 < 16 ? kc - q0 : 16;
                for (int pt = 0; pt < NPART && pt * PW < n; pt++) {
                    int64_t qp = q0 + pt * PW;
                    vpart p0 = {0}, a0 = {0}, h0 = pld(hi + qp), l0 = pld(lo + qp);
                    for (int64_t j = j0; j < j1; j++) {
                        vpart v0 = pload(base + (j * c->sbn + qp) * esz, c->dt, n - pt * PW);
                        if (rs) v0 = v0 * psplat(rs[j]);
                        p0 += v0;
                        a0 += pabs(v0);
                        h0 = pmax(v0, h0);
                        l0 = pmin(v0, l0);
                    }
                    pst(tot + qp, pld(tot + qp) + p0);
                    pst(ab + qp, pld(ab + qp) + a0);
                    pst(hi + qp, h0);
                    pst(lo + qp, l0);
                }
            }
        }
        float *obr = c->br + (bi * c->nseg + s) * c->k + k0;
        float *oab = c->babs + (bi * c->nseg + s) * c->k + k0;
        float *ohi = c->hi + (bi * c->nseg + s) * c->k + k0;
        float *olo = c->lo + (bi * c->nseg + s) * c->k + k0;
        for (int64_t q = 0; q < kc; q++) {
            obr[q] = tot[q];
            oab[q] = ab[q];
            ohi[q] = hi[q];
            olo[q] = lo[q];
            if (isnan(tot[q]) && has_nan(base + q * c->sbk * esz, c->dt, c->sbn, w)) ohi[q] = olo[q] = NAN;
        }
    }
    free(mem);
    return 1;
}

typedef double v16d __attribute__((vector_size(128)));
typedef double v4d __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int64_t v4l __attribute__((vector_size(32)));

static inline v4d dabs4(v4d x) { return (v4d)((v4l)x & (v4l){INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX}); }

/* the 16 lanes of v summed by a fixed tree (lane j + w into lane j, w = 8, 4, 2, 1) */
static double dsum16(const v16d *v) {
    double t[16];
    memcpy(t, v, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) t[j] = t[j] + t[j + w];
    return t[0];
}

/* lanes 4q .. 4q + 3 of x as fp64 (exact) */
static inline v4d quad64(vpart x, int q) {
    v4f f;
    memcpy(&f, (const char *)&x + 16 * q, 16);
    return __builtin_convertvector(f, v4d);
}

/* Per segment: the aggregates of abft.weight_side and the factors of WeightSide._factors,
 * all in fp64. Each (k, s) value is widened to fp64 first and every square and product
 * is taken there, where the product of two fp32 values is exact and nothing underflows or
 * overflows (fp32 squares leave fp32's range below 1e-19 and above 1e19). Sums over k run
 * on one thread (the result does not depend on the thread count), 16 k at a time: k goes
 * to lane k % 16 (a tail padded with zeros, which add nothing), then the lanes reduce by
 * a fixed tree. Vectors rather than one k at a time because this runs between the
 * threaded encode and the check while the other threads wait. agg is [8][bt][nseg] fp64:
 * p1, p2, v, col_norm, f_mean, f_cross_mu, f_cross_sd, f_spread. */
static void ws_aggregate(const ws_ctx *c, double *agg, uint8_t *bad) {
    int64_t plane = c->bt * c->nseg;
    double *p1o = agg, *p2o = agg + plane, *vo = agg + 2 * plane, *cno = agg + 3 * plane;
    double *fm = agg + 4 * plane, *fcm = agg + 5 * plane, *fcs = agg + 6 * plane, *fsp = agg + 7 * plane;
    const vpmask lane = pindex();
    for (int64_t bi = 0; bi < c->bt; bi++) {
        for (int64_t s = 0; s < c->nseg; s++) {
            int64_t o = bi * c->nseg + s;
            const float *br = c->br + o * c->k, *hi = c->hi + o * c->k, *lo = c->lo + o * c->k;
            float w = (float)seg_width(c->n, s);
            v16d p1, p2, v, cn;
            for (int pt = 0; pt < NPART; pt++) {
                v4d a1[PW / 4] = {{0}}, a2[PW / 4] = {{0}}, av[PW / 4] = {{0}}, ac[PW / 4] = {{0}};
                for (int64_t k0 = 0; k0 < c->k; k0 += 16) {
                    int64_t kp = k0 + pt * PW, np = c->k - kp; /* lanes < np hold a k */
                    vpart vb = psplat(0.0f), vh = vb, vl = vb;
                    if (np >= PW) {
                        vb = pld(br + kp), vh = pld(hi + kp), vl = pld(lo + kp);
                    } else {
                        for (int64_t j = 0; j < np; j++) vb[j] = br[kp + j], vh[j] = hi[kp + j], vl[j] = lo[kp + j];
                    }
                    vpart mu = vb / psplat(w);
                    vpart m = psel(vh > -vl, vh, -vl);
                    m = psel((vh != vh) | (vl != vl), psplat(NAN), m);
                    if (np < PW) { /* padding lanes add 0 */
                        vpmask live = lane < (int32_t)(np > 0 ? np : 0);
                        mu = psel(live, mu, psplat(0.0f));
                        vh = psel(live, vh, psplat(0.0f));
                        vl = psel(live, vl, psplat(0.0f));
                        m = psel(live, m, psplat(0.0f));
                    }
                    for (int q = 0; q < PW / 4; q++) {
                        v4d mu64 = quad64(mu, q), hi64 = quad64(vh, q), lo64 = quad64(vl, q), m64 = quad64(m, q);
                        v4d var = (hi64 - mu64) * (mu64 - lo64);
                        a1[q] += dabs4(mu64);
                        a2[q] += mu64 * mu64;
                        av[q] += dabs4(var);
                        ac[q] += m64 * m64;
                    }
                }
                memcpy((char *)&p1 + pt * PW * 8, a1, sizeof a1);
                memcpy((char *)&p2 + pt * PW * 8, a2, sizeof a2);
                memcpy((char *)&v + pt * PW * 8, av, sizeof av);
                memcpy((char *)&cn + pt * PW * 8, ac, sizeof ac);
            }
            double P1 = dsum16(&p1), P2 = dsum16(&p2), V = dsum16(&v), cns = dsum16(&cn);
            p1o[o] = P1;
            p2o[o] = P2;
            vo[o] = V;
            cno[o] = sqrt(cns);
            bad[o] = !(isfinite(P1) && isfinite(V));
            double wd = (double)w, sqrt_n = sqrt(wd), sqrt_v = sqrt(V);
            fm[o] = wd * P1;
            fcm[o] = (4.0 * sqrt_n) * sqrt_v;
            fcs[o] = (4.0 * wd) * sqrt(P2);
            fsp[o] = sqrt_n * sqrt_v;
        }
    }
}

int vabft_weight_side(ws_ctx *c, double *agg, uint8_t *bad, int threads) {
    /* column-major: runs along K (W.t() of a Linear); else rows of B, gathered if strided */
    c->colwise = c->sbk == 1 && c->sbn != 1 && c->k > 1;
    c->items_per_batch = c->colwise ? c->nseg * ((c->k + KCW - 1) / KCW) : (c->k + KB - 1) / KB;
    threads = vabft_threads(threads, c->bt * c->k * c->n);
    int rc = vabft_parallel(c->colwise ? ws_cols : ws_rows, c, c->bt * c->items_per_batch, threads);
    if (rc >= 0) ws_aggregate(c, agg, bad);
    return rc;
}
