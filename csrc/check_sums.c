/*
 * check_sums.c: the check's segment sums of C (and of the bias, with its absolute sums),
 * per work item of rows.
 *
 * The observed checksum of row r and segment s is the sum of r[j] C[r, j] over the
 * segment's columns; the threshold reads the sum of |r[j] C[r, j]| (C's self-bounded
 * rounding) and, for the tight screen, of its squares; the bias enters the reference
 * the same way (and its absolute sum the threshold). A row-major X sums each segment as a contiguous run (runs.h
 * order); a column-major X (stride 1 along M) puts one row per lane and sums 16 rows at
 * once in column order, reading 16 consecutive rows per column instead of one element
 * per cache line. A bias broadcast along M (row stride 0) is summed once per item.
 */
#include <stddef.h>

#include "check.h"

/* Segment sums of r * X over R <= 16 rows (row stride sm, stride sx along N):
 * out[s * RBMAX + r], of |r * X| in aout and of (r * X)^2 in qout (when not NULL). Rows
 * are read in order, each (row, segment) run into four accumulators (runs.h order)
 * combined into one vector (vec: [3][nseg][16]), then per segment the 16 rows reduce at
 * once (16 lanes stored: absent rows get 0; fewer than 4 rows, only theirs, one tree
 * each). */
static void x_rows(const chk_ctx *c, const char *px, int dt, int64_t sm, int64_t sx, int64_t rows, float *buf,
                   v16 *vec, float *out, float *aout, float *qout) {
    int64_t nseg = c->nseg;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t s = 0; s < nseg; s++) {
            v16 *vs = vec + s * 16, *va = vs + 16 * nseg, *vq = va + 16 * nseg;
            int64_t w = seg_width(c->n, s);
            const char *p = px + (r * sm + s * SEG * sx) * ESZ[dt];
            const float *rs = c->r ? c->r + s * SEG : NULL;
            v16 *as = aout ? &va[r] : NULL, *qs = qout ? &vq[r] : NULL;
            /* a contiguous run is read in place (bf16 / fp16 converted in registers), a
             * strided one gathered into buf first */
            const char *x = p;
            int xdt = dt;
            if (sx != 1) {
                cvt(p, dt, sx, w, buf);
                x = (const char *)buf;
                xdt = DT_F32;
            }
            if (xdt == DT_F32)
                run_sum(x, DT_F32, rs, w, &vs[r], as, qs);
            else if (xdt == DT_BF16)
                run_sum(x, DT_BF16, rs, w, &vs[r], as, qs);
            else
                run_sum(x, DT_F16, rs, w, &vs[r], as, qs);
        }
    }
    if (rows < 4) { /* a row or two (decoding): one tree each, the same values */
        for (int64_t s = 0; s < nseg; s++)
            for (int64_t r = 0; r < rows; r++) {
                out[s * RBMAX + r] = hsum(vec[s * 16 + r]);
                if (aout) aout[s * RBMAX + r] = hsum(vec[(nseg + s) * 16 + r]);
                if (qout) qout[s * RBMAX + r] = hsum(vec[(2 * nseg + s) * 16 + r]);
            }
        return;
    }
    for (int64_t s = 0; s < nseg; s++) {
        v16 *vs = vec + s * 16, *va = vs + 16 * nseg, *vq = va + 16 * nseg;
        for (int64_t r = rows; r < 16; r++) vs[r] = va[r] = vq[r] = splat(0.0f);
        vst(out + s * RBMAX, hsum16(vs));
        if (aout) vst(aout + s * RBMAX, hsum16(va));
        if (qout) vst(qout + s * RBMAX, hsum16(vq));
    }
}

/* Segment sums of R <= 16 rows of a column-major X (stride 1 along M): lane r is row r,
 * one part (lanes.h) at a time, parts without rows skipped. */
static void x_cols(const chk_ctx *c, const char *px, int dt, int64_t sx, int64_t rows, float *out, float *aout,
                   float *qout) {
    const int64_t esz = ESZ[dt];
    for (int64_t s = 0; s < c->nseg; s++) {
        int64_t w = seg_width(c->n, s);
        v16 tot = {0}, atot = {0}, qtot = {0};
        for (int pt = 0; pt < NPART && pt * PW < rows; pt++) {
            const char *ph = px + pt * PW * esz;
            int64_t nh = rows - pt * PW;
            vpart t = pget(&tot, pt), at = pget(&atot, pt), qt = pget(&qtot, pt);
            for (int64_t j0 = 0; j0 < w; j0 += 16) {
                int64_t j1 = j0 + 16 < w ? j0 + 16 : w;
                vpart p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};
                vpart e0 = {0}, e1 = {0}, e2 = {0}, e3 = {0};
#define XC(u, jj)                                     \
    {                                                 \
        int64_t col = s * SEG + (jj);                 \
        vpart v = pload(ph + col * sx * esz, dt, nh); \
        if (c->r) v = v * c->r[col];                  \
        p##u += v;                                    \
        q##u += pabs(v);                              \
        e##u += v * v;                                \
    }
                FOUR_PARTIALS(XC, j0, j1)
#undef XC
                t += (p0 + p1) + (p2 + p3);
                at += (q0 + q1) + (q2 + q3);
                qt += (e0 + e1) + (e2 + e3);
            }
            pset(&tot, pt, t);
            pset(&atot, pt, at);
            pset(&qtot, pt, qt);
        }
        for (int64_t r = 0; r < rows; r++) {
            out[s * RBMAX + r] = tot[r];
            if (aout) aout[s * RBMAX + r] = atot[r];
            if (qout) qout[s * RBMAX + r] = qtot[r];
        }
    }
}

/* segment sums of rows [m0, m0 + rows) of X (C or the bias) into out[s][r] (and aout,
 * qout) */
void vabft_x_block(const chk_ctx *c, scratch *w, const char *px, int dt, int64_t sm, int64_t sn, int64_t rows,
                   float *out, float *aout, float *qout) {
    if (sn != 1 && sm == 1) {
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
            x_cols(c, px + r0 * ESZ[dt], dt, sn, rows - r0 < 16 ? rows - r0 : 16, out + r0,
                   aout ? aout + r0 : NULL, qout ? qout + r0 : NULL);
        return;
    }
    if (sm == 0) { /* one row broadcast (a bias vector): its sums once */
        x_rows(c, px, dt, 0, sn, 1, w->cbuf, w->xvec, out, aout, qout);
        for (int64_t s = 0; s < c->nseg; s++)
            for (int64_t r = 1; r < rows; r++) {
                out[s * RBMAX + r] = out[s * RBMAX];
                if (aout) aout[s * RBMAX + r] = aout[s * RBMAX];
                if (qout) qout[s * RBMAX + r] = qout[s * RBMAX];
            }
        return;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        x_rows(c, px + r0 * sm * ESZ[dt], dt, sm, sn, rows - r0 < 16 ? rows - r0 : 16, w->cbuf, w->xvec, out + r0,
               aout ? aout + r0 : NULL, qout ? qout + r0 : NULL);
}
