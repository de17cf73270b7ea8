/*
 * check_a.c: the check's one pass over A, per work item of rows.
 *
 * For each row: sum / max / min (the row statistics the threshold and the non-finite
 * classification need) and the reference checksum A[row] . Br[:, s] of every segment,
 * from the same read of A. Row-major A (a_rows) reads each row as a contiguous run,
 * four rows per Br load, and reduces 16 rows' accumulators at once (lanes.h hsum16);
 * column-major A (a_cols, e.g. a weight gradient grad_out.t()) reads KCC long runs of up
 * to RBC rows per block instead of hundreds of short strided ones, each vector of A
 * loaded once for the statistics and every segment's dot (cols_fused, up to 4 segments).
 * Each row's arithmetic is its own (one lane or accumulator per row, in k order), so it
 * does not depend on the block's other rows, on M or on the layout's blocking.
 */
#include <math.h>
#include <string.h>

#include "check.h"

/* the absent rows of a group of four read these (zero bytes: 0 in every dtype) */
static const float ZEROS[KC];

/* sum / max / min of a contiguous run p[0..k) of dtype dt, converted in registers, as
 * vectors for finish16: the same lane assignment and order as acc_stats over consecutive
 * KC blocks (KC is a multiple of 64), with the 12 accumulators in registers for the
 * whole run. */
static void row_stats(const char *p, int dt, int64_t k, v16 *sum, v16 *hi, v16 *lo) {
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
    comb_stats(S, H, L, sum, hi, lo);
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
void vabft_a_rows(const chk_ctx *c, const char *pa, int64_t rows, const float *br, float *buf, v16 *acc,
                  float *sum, float *hi, float *lo, float *ref) {
    int64_t nseg = c->nseg, padded = (rows + 3) & ~(int64_t)3;
    /* contiguous rows: the statistics in one pass per row, accumulators in registers;
     * strided rows: per block of K from the gathered copy. Either way each row ends as
     * three vectors, reduced 16 rows at once (absent rows: zeros, dropped later). */
    int contig = c->sak == 1;
    v16 s[RB][4], h[RB][4], l[RB][4], vs[16], vh[16], vl[16];
    for (int64_t r = rows; r < 16; r++) vs[r] = vh[r] = vl[r] = splat(0.0f);
    if (contig) {
        for (int64_t r = 0; r < rows; r++)
            row_stats(pa + r * c->sam * ESZ[c->adt], c->adt, c->k, &vs[r], &vh[r], &vl[r]);
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
    if (!contig)
        for (int64_t r = 0; r < rows; r++) comb_stats(s[r], h[r], l[r], &vs[r], &vh[r], &vl[r]);
    if (rows < 4) { /* a row or two (decoding): one tree each, the same values */
        for (int64_t r = 0; r < rows; r++) {
            sum[r] = hsum(vs[r]);
            hi[r] = hmax(vh[r]);
            lo[r] = hmin(vl[r]);
            for (int64_t sg = 0; sg < nseg; sg++) ref[sg * RBMAX + r] = hsum(acc[4 * sg + r]);
        }
        return;
    }
    finish16(vs, vh, vl, sum, hi, lo);
    for (int64_t sg = 0; sg < nseg; sg++) {
        for (int64_t r = 0; r < rows; r++) vs[r] = acc[(r & ~(int64_t)3) * nseg + 4 * sg + (r & 3)];
        vst(ref + sg * RBMAX, hsum16(vs));
    }
}

/* One group of 16 rows of a column-major block (x[q * ld], q < kc) for NS segments at
 * once: each vector of A is loaded once and feeds the statistics and every segment's dot.
 * The same operations in the same order as the unfused loops of vabft_a_cols (per block
 * of 16 k: four interleaved partials, then into the total). */
static inline __attribute__((always_inline)) void cols_fused(const float *x, int64_t ld, int64_t kc,
                                                             const float *b, int64_t sbrs, int NS, v16 *t,
                                                             v16 *hg, v16 *lg, v16 *acc) {
    v16 tt = *t, hh = *hg, ll = *lg, a[4];
    for (int s = 0; s < NS; s++) a[s] = acc[s];
    for (int64_t q0 = 0; q0 < kc; q0 += 16) {
        int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
        v16 p0 = splat(0.0f), p1 = p0, p2 = p0, p3 = p0, d0[4], d1[4], d2[4], d3[4];
        for (int s = 0; s < NS; s++) d0[s] = d1[s] = d2[s] = d3[s] = splat(0.0f);
#define FUSED(pj, dj, q)                                                      \
    {                                                                         \
        v16 v = vld(x + ld * (q));                                            \
        pj += v;                                                              \
        hh = vmax(v, hh);                                                     \
        ll = vmin(v, ll);                                                     \
        for (int s = 0; s < NS; s++) dj[s] += v * splat(b[s * sbrs + (q)]); \
    }
        int64_t q = q0;
        for (; q + 4 <= q1; q += 4) {
            FUSED(p0, d0, q) FUSED(p1, d1, q + 1) FUSED(p2, d2, q + 2) FUSED(p3, d3, q + 3)
        }
        if (q < q1) FUSED(p0, d0, q)
        if (q + 1 < q1) FUSED(p1, d1, q + 1)
        if (q + 2 < q1) FUSED(p2, d2, q + 2)
#undef FUSED
        tt += (p0 + p1) + (p2 + p3);
        for (int s = 0; s < NS; s++) a[s] += (d0[s] + d1[s]) + (d2[s] + d3[s]);
    }
    *t = tt;
    *hg = hh;
    *lg = ll;
    for (int s = 0; s < NS; s++) acc[s] = a[s];
}

/* R <= RBC rows of a column-major A (stride 1 along M): lane r % 16 of group r / 16 is row
 * r; each row sums in k order, 4 interleaved partials per block of 16 k (k0 a multiple of
 * 16), then into the total. A block of KCC k is KCC contiguous runs of R elements: read
 * in place (fp32, R a multiple of 16) or converted into buf[q][RBC] (zeros past R), the
 * same values either way. Up to 4 segments, one pass per group (cols_fused); more, a
 * pass for the statistics and one per segment. A row's arithmetic depends neither on R,
 * on its group nor on the path. */
void vabft_a_cols(const chk_ctx *c, const char *pa, int64_t rows, const float *br, float *buf, v16 *acc,
                  float *sum, float *hi, float *lo, float *ref) {
    /* c's fields in locals: the stores into buf and acc could alias *c, and reloading them
     * in the loops (the dtype test of load16 in particular) costs ~10 % of the pass */
    const int adt = c->adt;
    const int64_t ng = (rows + 15) / 16, nseg = c->nseg, esz = ESZ[adt], k = c->k, sak = c->sak, sbrs = c->sbrs;
    v16 tot[RBC / 16], h[RBC / 16], l[RBC / 16];
    for (int64_t g = 0; g < ng; g++) {
        tot[g] = splat(0.0f);
        h[g] = splat(-INFINITY);
        l[g] = splat(INFINITY);
    }
    memset(acc, 0, sizeof(v16) * ng * nseg);
    /* fp32 is read in place (ld: the distance between consecutive k) when the rows fill
     * whole vectors; bf16 / fp16 and a partial last vector go through buf[q][RBC], a
     * block at a time */
    const int direct = adt == DT_F32 && rows % 16 == 0;
    const int64_t ld = direct ? sak : RBC;
    for (int64_t k0 = 0; k0 < k; k0 += KCC) {
        int64_t kc = k - k0 < KCC ? k - k0 : KCC;
        const float *xb = direct ? (const float *)(pa + k0 * sak * esz) : buf;
        for (int64_t q = 0; q < kc && !direct; q++) {
            const char *p = pa + (k0 + q) * sak * esz;
            for (int64_t g = 0; g < ng; g++) {
                int64_t n = rows - 16 * g;
                vst(buf + RBC * q + 16 * g, load16(p + 16 * g * esz, adt, n < 16 ? n : 16));
            }
        }
        if (nseg <= 4) {
            const float *b = br + k0;
            for (int64_t g = 0; g < ng; g++) {
                v16 *t = &tot[g], *hg = &h[g], *lg = &l[g], *a = acc + g * nseg;
                if (nseg == 1)
                    cols_fused(xb + 16 * g, ld, kc, b, sbrs, 1, t, hg, lg, a);
                else if (nseg == 2)
                    cols_fused(xb + 16 * g, ld, kc, b, sbrs, 2, t, hg, lg, a);
                else if (nseg == 3)
                    cols_fused(xb + 16 * g, ld, kc, b, sbrs, 3, t, hg, lg, a);
                else
                    cols_fused(xb + 16 * g, ld, kc, b, sbrs, 4, t, hg, lg, a);
            }
            continue;
        }
        for (int64_t g = 0; g < ng; g++) {
            const float *x = xb + 16 * g;
            v16 t = tot[g], hg = h[g], lg = l[g];
            for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
#define COL(pj, q)                        \
    {                                     \
        v16 v = vld(x + ld * (q));       \
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
                const float *b = br + sg * sbrs + k0;
                v16 a = acc[g * nseg + sg];
                for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                    int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                    v16 p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
                    int64_t q = q0;
                    for (; q + 4 <= q1; q += 4) {
                        p0 += vld(x + ld * q) * splat(b[q]);
                        p1 += vld(x + ld * (q + 1)) * splat(b[q + 1]);
                        p2 += vld(x + ld * (q + 2)) * splat(b[q + 2]);
                        p3 += vld(x + ld * (q + 3)) * splat(b[q + 3]);
                    }
                    if (q < q1) p0 += vld(x + ld * q) * splat(b[q]);
                    if (q + 1 < q1) p1 += vld(x + ld * (q + 1)) * splat(b[q + 1]);
                    if (q + 2 < q1) p2 += vld(x + ld * (q + 2)) * splat(b[q + 2]);
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
