/*
 * check_sums.c: the check's segment sums of C (and of the bias, with its absolute sums),
 * per work item of rows.
 *
 * The observed checksum of row r and segment s is the sum of r[j] C[r, j] over the
 * segment's columns; the bias enters the reference the same way (and its absolute sum
 * the rounding floor). A row-major X sums each segment as a contiguous run (runs.h
 * order); a column-major X (stride 1 along M) puts one row per lane and sums 16 rows at
 * once in column order, reading 16 consecutive rows per column instead of one element
 * per cache line.
 */
#include <stddef.h>

#include "check.h"

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
static void x_cols(const chk_ctx *c, const char *px, int dt, int64_t sx, int64_t rows, float *out, float *aout) {
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
void vabft_x_block(const chk_ctx *c, scratch *w, const char *px, int dt, int64_t sm, int64_t sn, int64_t rows,
                   float *out, float *aout) {
    if (sn != 1 && sm == 1) {
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
            x_cols(c, px + r0 * ESZ[dt], dt, sn, rows - r0 < 16 ? rows - r0 : 16, out + r0,
                   aout ? aout + r0 : NULL);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        x_row(c, px + r * sm * ESZ[dt], dt, sn, w->cbuf, out + r, aout ? aout + r : NULL);
}
