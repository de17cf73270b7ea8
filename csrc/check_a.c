/*
 * check_a.c: the check's reading of A, per work item of rows.
 *
 * For each row: sum / max / min (the row statistics the threshold and the non-finite
 * classification need), the reference checksum A[row] . Br[:, s] of every segment and
 * |A[row]| . Babs[:, s], the magnitude C's rounding term follows.
 * Row-major A (a_rows) reads each row as a contiguous run:
 * with one segment, statistics and dot from the same loads (row_pass); with more, the
 * statistics first and then the dots, four rows per Br load; 16 rows' accumulators are
 * reduced at once (lanes.h hsum16);
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

/* How far ahead row_pass prefetches A, in bytes (into the next row past a row's end: a
 * prefetch never faults). Why: with a dozen vector operations per line, the loop keeps
 * fewer lines in flight than a plain sum does, and the hardware prefetchers alone left
 * it reading A at 11-14 GB/s where torch.sum reads 16-17 (2 threads, AVX2 host). 8 KiB
 * ahead made the fp32 MOE-gate checks 10-20 % faster: 4096x4096x8 (A from DRAM) and
 * 512x4096x8 (A from L3); 2, 4 and 16 KiB were no better. */
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif

/* sum / max / min of a contiguous run p[0..k) of dtype dt, converted in registers, as
 * vectors for finish16: the sums in the same lanes and order as acc_stats over
 * consecutive KC blocks (KC is a multiple of 64). With DOT, from the same loads, its dot
 * with b[0..k) too (one segment): *dot lane q = the sum over i = q (mod 16), in i order, of
 * p[i] * b[i], as dot4 accumulates it over consecutive KC blocks (vectors of 16, then the
 * scalar tail). Why: with one segment (N <= 256: the MOE gate, a small model's
 * projections) a separate dot pass read each row a second time and cost about a fifth of
 * the check. DOT is a constant where inlined: without it the dot compiles away.
 *
 * Every part is read in one pass over the row, and max / min keep one accumulator for all
 * lanes and partials: a max or min is exact whatever the grouping (the one freedom left is
 * which of +0 / -0 a tie keeps, and chk_rows makes every zero max / min +0). That
 * leaves 12 accumulators with AVX2, all in registers. Before, each part had its own pass
 * (the row read twice, the second from L1 or L2) with four max and four min accumulators,
 * and the dot's one dependency chain per pass had nothing to overlap with: the check of
 * a 512x4096x8 fp32 MOE gate (A in L3) took 252-308 us hot, 209-225 us now. */
static inline __attribute__((always_inline)) void row_pass(const char *p, int dt, int64_t k, int DOT,
                                                           const float *b, const float *ba, v16 *sum, v16 *hi,
                                                           v16 *lo, v16 *dot, v16 *dota) {
    int64_t esz = ESZ[dt], kv = k & ~(int64_t)15, i = 0;
    v16 S[4], H[4], L[4], D, DA;
    vpart s[NPART][4], d[NPART], da[NPART], h = psplat(-INFINITY), l = psplat(INFINITY);
    for (int pt = 0; pt < NPART; pt++) {
        d[pt] = da[pt] = psplat(0.0f);
        for (int u = 0; u < 4; u++) s[pt][u] = psplat(0.0f);
    }
    for (i = 0; i + 64 <= k; i += 64) {
        for (int64_t o = 0; o < 64 * esz; o += 64) /* the lines of the block PF_BYTES ahead */
            __builtin_prefetch(p + i * esz + PF_BYTES + o);
        for (int u = 0; u < 4; u++)
            for (int pt = 0; pt < NPART; pt++) { /* element j: lane j % 16 of partial u */
                int64_t j = i + 16 * u + pt * PW;
                vpart v = pload(p + j * esz, dt, PW);
                s[pt][u] += v;
                h = pmax(v, h); /* operands in this order: a NaN is ignored */
                l = pmin(v, l);
                if (DOT) {
                    d[pt] += v * pld(b + j);
                    da[pt] += pabs(v) * pld(ba + j);
                }
            }
    }
    if (i == k) { /* no tail: comb_stats' values straight from the registers (H / L 1..3 would be -inf / +inf) */
        for (int pt = 0; pt < NPART; pt++) {
            pset(sum, pt, (s[pt][0] + s[pt][1]) + (s[pt][2] + s[pt][3]));
            pset(hi, pt, h);
            pset(lo, pt, l);
            if (DOT) pset(dot, pt, d[pt]), pset(dota, pt, da[pt]);
        }
        return;
    }
    for (int pt = 0; pt < NPART; pt++) {
        for (int64_t j = i + pt * PW; DOT && j - pt * PW < kv; j += 16) { /* full vectors past the last 64 */
            vpart v = pload(p + j * esz, dt, PW);
            d[pt] += v * pld(b + j);
            da[pt] += pabs(v) * pld(ba + j);
        }
        for (int u = 0; u < 4; u++) {
            pset(&S[u], pt, s[pt][u]);
            pset(&H[u], pt, u ? psplat(-INFINITY) : h);
            pset(&L[u], pt, u ? psplat(INFINITY) : l);
        }
        pset(&D, pt, d[pt]);
        pset(&DA, pt, da[pt]);
    }
    if (i < k) {
        float tmp[64];
        cvt(p + i * esz, dt, 1, k - i, tmp);
        acc_stats(tmp, NULL, k - i, S, H, L);
    }
    comb_stats(S, H, L, sum, hi, lo);
    if (DOT) {
        for (int64_t j = kv; j < k; j++) {
            float x = ld(p, dt, j);
            D[j & 15] += x * b[j];
            DA[j & 15] += fabsf(x) * ba[j];
        }
        *dot = D;
        *dota = DA;
    }
}
static void row_stats(const char *p, int dt, int64_t k, v16 *sum, v16 *hi, v16 *lo) {
    row_pass(p, dt, k, 0, NULL, NULL, sum, hi, lo, NULL, NULL);
}
static void row_stats_dot(const char *p, int dt, int64_t k, const float *b, const float *ba, v16 *sum, v16 *hi,
                          v16 *lo, v16 *dot, v16 *dota) {
    row_pass(p, dt, k, 1, b, ba, sum, hi, lo, dot, dota);
}

/* acc[r * nseg + (r & 3)] += x[r][0..kc) * b (lane i % 16, in i order) for rows r < padded,
 * four rows per Br load; |x[r]| when ABS (for |A| @ Babs); x[r] holds dtype dt (a
 * constant where inlined). Every dtype converts to the same fp32 values, so a row's
 * arithmetic does not depend on dt here. */
static inline __attribute__((always_inline)) void dot4(const char *const *x, int dt, int ABS, const float *b,
                                                       int64_t kc, int64_t padded, v16 *acc, int64_t nseg) {
    int64_t kv = kc & ~(int64_t)15, esz = ESZ[dt];
    for (int64_t r = 0; r < padded; r += 4) {
        const char *x0 = x[r], *x1 = x[r + 1], *x2 = x[r + 2], *x3 = x[r + 3];
        v16 *a = acc + r * nseg;
        vpart a0[NPART], a1[NPART], a2[NPART], a3[NPART];
        for (int pt = 0; pt < NPART; pt++)
            a0[pt] = pget(&a[0], pt), a1[pt] = pget(&a[1], pt), a2[pt] = pget(&a[2], pt), a3[pt] = pget(&a[3], pt);
        for (int64_t i = 0; i < kv; i += 16)
            for (int pt = 0; pt < NPART; pt++) { /* both parts per step: 8 independent chains with AVX2 */
                int64_t j = i + pt * PW;
                vpart bv = pld(b + j);
#define XV(xr) (ABS ? pabs(pload(xr + j * esz, dt, PW)) : pload(xr + j * esz, dt, PW))
                a0[pt] += XV(x0) * bv;
                a1[pt] += XV(x1) * bv;
                a2[pt] += XV(x2) * bv;
                a3[pt] += XV(x3) * bv;
#undef XV
            }
        for (int pt = 0; pt < NPART; pt++)
            pset(&a[0], pt, a0[pt]), pset(&a[1], pt, a1[pt]), pset(&a[2], pt, a2[pt]), pset(&a[3], pt, a3[pt]);
        for (int64_t i = kv; i < kc; i++) {
            int q = (int)(i & 15);
#define XS(xr) (ABS ? fabsf(ld(xr, dt, i)) : ld(xr, dt, i))
            a[0][q] += XS(x0) * b[i];
            a[1][q] += XS(x1) * b[i];
            a[2][q] += XS(x2) * b[i];
            a[3][q] += XS(x3) * b[i];
#undef XS
        }
    }
}

/* R <= 16 rows of A, each contiguous after conversion (row-major, or gathered): sum / max
 * / min of each row, A[row] . Br[:, s] and |A[row]| . Babs[:, s]. Rows go through the dot
 * four at a time (each Br load serves four rows; absent rows read zeros), but each row's
 * arithmetic is its own: lane k % 16 of one accumulator per (row, segment), in k order. */
void vabft_a_rows(const chk_ctx *c, const char *pa, int64_t rows, const float *br, const float *babs, float *buf,
                  v16 *acc, v16 *acca, float *sum, float *hi, float *lo, float *ref, float *rabs) {
    int64_t nseg = c->nseg, padded = (rows + 3) & ~(int64_t)3;
    /* contiguous rows: the statistics in one pass per row, accumulators in registers;
     * strided rows: per block of K from the gathered copy. Either way each row ends as
     * three vectors, reduced 16 rows at once (absent rows: zeros, dropped later). */
    int contig = c->sak == 1;
    v16 s[RB][4], h[RB][4], l[RB][4], vs[16], vh[16], vl[16];
    for (int64_t r = rows; r < 16; r++) vs[r] = vh[r] = vl[r] = splat(0.0f);
    memset(acc, 0, sizeof(v16) * padded * nseg);
    memset(acca, 0, sizeof(v16) * padded * nseg);
    int fused = contig && nseg == 1; /* one segment: its dots in the statistics' pass */
    if (fused) {
        for (int64_t r = 0; r < rows; r++)
            row_stats_dot(pa + r * c->sam * ESZ[c->adt], c->adt, c->k, br, babs, &vs[r], &vh[r], &vl[r], &acc[r],
                          &acca[r]);
    } else if (contig) {
        for (int64_t r = 0; r < rows; r++)
            row_stats(pa + r * c->sam * ESZ[c->adt], c->adt, c->k, &vs[r], &vh[r], &vl[r]);
    } else {
        for (int64_t r = 0; r < rows; r++) init_stats(s[r], h[r], l[r]);
    }
    /* rows read in place (fp32; or bf16 / fp16 converted in registers when few segments
     * reuse them), else converted once per block into buf */
    int direct = contig && (c->adt == DT_F32 || nseg <= 2);
    int xdt = direct ? c->adt : DT_F32;
    const char *x[RB];
    for (int64_t k0 = 0; k0 < c->k && !fused; k0 += KC) {
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
            const float *b = br + sg * c->sbrs + k0, *ba = babs + sg * c->sbrs + k0;
            v16 *a = acc + 4 * sg, *aa = acca + 4 * sg;
            if (xdt == DT_F32) {
                dot4(x, DT_F32, 0, b, kc, padded, a, nseg);
                dot4(x, DT_F32, 1, ba, kc, padded, aa, nseg);
            } else if (xdt == DT_BF16) {
                dot4(x, DT_BF16, 0, b, kc, padded, a, nseg);
                dot4(x, DT_BF16, 1, ba, kc, padded, aa, nseg);
            } else {
                dot4(x, DT_F16, 0, b, kc, padded, a, nseg);
                dot4(x, DT_F16, 1, ba, kc, padded, aa, nseg);
            }
        }
    }
    if (!contig)
        for (int64_t r = 0; r < rows; r++) comb_stats(s[r], h[r], l[r], &vs[r], &vh[r], &vl[r]);
    if (rows < 4) { /* a row or two (decoding): one tree each, the same values */
        for (int64_t r = 0; r < rows; r++) {
            sum[r] = hsum(vs[r]);
            hi[r] = hmax(vh[r]);
            lo[r] = hmin(vl[r]);
            for (int64_t sg = 0; sg < nseg; sg++) {
                ref[sg * RBMAX + r] = hsum(acc[4 * sg + r]);
                rabs[sg * RBMAX + r] = hsum(acca[4 * sg + r]);
            }
        }
        return;
    }
    finish16(vs, vh, vl, sum, hi, lo);
    for (int64_t sg = 0; sg < nseg; sg++) {
        for (int64_t r = 0; r < rows; r++) vs[r] = acc[(r & ~(int64_t)3) * nseg + 4 * sg + (r & 3)];
        vst(ref + sg * RBMAX, hsum16(vs));
        for (int64_t r = 0; r < rows; r++) vs[r] = acca[(r & ~(int64_t)3) * nseg + 4 * sg + (r & 3)];
        vst(rabs + sg * RBMAX, hsum16(vs));
    }
}

/* One part (lanes.h) of a group of 16 rows of a column-major block (x[q * ld], q < kc;
 * x at the part's first row) for NS segments at once: each vector of A is loaded once and
 * feeds the statistics (when ST) and every segment's dot. The same operations in the same
 * order as the unfused loops of vabft_a_cols (per block of 16 k: four interleaved
 * partials, then into the total). */
static inline __attribute__((always_inline)) void cols_fused(const float *x, int64_t ld, int64_t kc,
                                                             const float *b, int64_t sbrs, int NS, int ST, int ABS,
                                                             int pt, v16 *t, v16 *hg, v16 *lg, v16 *acc) {
    vpart tt = pget(t, pt), hh = pget(hg, pt), ll = pget(lg, pt), a[4];
    for (int s = 0; s < NS; s++) a[s] = pget(&acc[s], pt);
    for (int64_t q0 = 0; q0 < kc; q0 += 16) {
        int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
        vpart p0 = psplat(0.0f), p1 = p0, p2 = p0, p3 = p0, d0[4], d1[4], d2[4], d3[4];
        for (int s = 0; s < NS; s++) d0[s] = d1[s] = d2[s] = d3[s] = psplat(0.0f);
#define FUSED(u, q)                                                                \
    {                                                                              \
        vpart v = pld(x + ld * (q));                                               \
        if (ST) {                                                                  \
            p##u += v;                                                             \
            hh = pmax(v, hh);                                                      \
            ll = pmin(v, ll);                                                      \
        }                                                                          \
        vpart vd = ABS ? pabs(v) : v;                                              \
        for (int s = 0; s < NS; s++) d##u[s] += vd * psplat(b[s * sbrs + (q)]); \
    }
        FOUR_PARTIALS(FUSED, q0, q1)
#undef FUSED
        if (ST) tt += (p0 + p1) + (p2 + p3);
        for (int s = 0; s < NS; s++) a[s] += (d0[s] + d1[s]) + (d2[s] + d3[s]);
    }
    if (ST) {
        pset(t, pt, tt);
        pset(hg, pt, hh);
        pset(lg, pt, ll);
    }
    for (int s = 0; s < NS; s++) pset(&acc[s], pt, a[s]);
}

/* cols_fused for ns <= 4 segments from b (and the statistics when st; |A| when abs, for
 * |A| @ Babs), one variant each */
static void cols_chunk(const float *x, int64_t ld, int64_t kc, const float *b, int64_t sbrs, int64_t ns, int st,
                       int abs, int pt, v16 *t, v16 *hg, v16 *lg, v16 *acc) {
    if (abs) {
        switch (ns) {
        case 1: cols_fused(x, ld, kc, b, sbrs, 1, 0, 1, pt, t, hg, lg, acc); break;
        case 2: cols_fused(x, ld, kc, b, sbrs, 2, 0, 1, pt, t, hg, lg, acc); break;
        case 3: cols_fused(x, ld, kc, b, sbrs, 3, 0, 1, pt, t, hg, lg, acc); break;
        default: cols_fused(x, ld, kc, b, sbrs, 4, 0, 1, pt, t, hg, lg, acc); break;
        }
        return;
    }
    switch (ns * 2 + !!st) {
    case 2: cols_fused(x, ld, kc, b, sbrs, 1, 0, 0, pt, t, hg, lg, acc); break;
    case 3: cols_fused(x, ld, kc, b, sbrs, 1, 1, 0, pt, t, hg, lg, acc); break;
    case 4: cols_fused(x, ld, kc, b, sbrs, 2, 0, 0, pt, t, hg, lg, acc); break;
    case 5: cols_fused(x, ld, kc, b, sbrs, 2, 1, 0, pt, t, hg, lg, acc); break;
    case 6: cols_fused(x, ld, kc, b, sbrs, 3, 0, 0, pt, t, hg, lg, acc); break;
    case 7: cols_fused(x, ld, kc, b, sbrs, 3, 1, 0, pt, t, hg, lg, acc); break;
    case 8: cols_fused(x, ld, kc, b, sbrs, 4, 0, 0, pt, t, hg, lg, acc); break;
    default: cols_fused(x, ld, kc, b, sbrs, 4, 1, 0, pt, t, hg, lg, acc); break;
    }
}

/* Whether cols_fused takes every segment, in chunks of 4 (the statistics with the first):
 * with 32 registers of 16 lanes, up to 4 segments in one chunk, and more in a pass for the
 * statistics and one per segment. With AVX2 (parts of 8 lanes, 16 registers) chunks of 4
 * spill some partials but are still faster past 4 segments: a pass per segment reads the
 * group's KCC runs again, and with a column stride of 4 KiB (M = 1024, fp32) they share one
 * 8-way L1 set, so each pass reads them from L2 (nseg = 8: 730 -> 470 us). */
#define ALL_CHUNKS (PW == 8)

/* R <= RBC rows of a column-major A (stride 1 along M): lane r % 16 of group r / 16 is row
 * r; each row sums in k order, 4 interleaved partials per block of 16 k (k0 a multiple of
 * 16), then into the total. A block of KCC k is KCC contiguous runs of R elements: read
 * in place (fp32, R a multiple of 16) or converted into buf[q][RBC] (zeros past R), the
 * same values either way. Up to 4 segments (any number with AVX2: ALL_CHUNKS), a pass
 * per group and chunk of 4 (cols_fused); more, a pass for the statistics and one per
 * segment. Groups run a part at a time (parts without rows skipped). A row's arithmetic
 * depends neither on R, on its group, its part nor on the path. */
void vabft_a_cols(const chk_ctx *c, const char *pa, int64_t rows, const float *br, const float *babs, float *buf,
                  v16 *acc, v16 *acca, float *sum, float *hi, float *lo, float *ref, float *rabs) {
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
    memset(acca, 0, sizeof(v16) * ng * nseg);
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
            for (int64_t r = 0; r < 16 * ng; r += PW)
                pst(buf + RBC * q + r, pload(p + r * esz, adt, rows - r));
        }
        for (int64_t g = 0; g < ng; g++) {
            for (int pt = 0; pt < NPART && 16 * g + pt * PW < rows; pt++) {
                const float *x = xb + 16 * g + pt * PW;
                v16 *a = acc + g * nseg, *aa = acca + g * nseg;
                if (nseg <= 4 || ALL_CHUNKS) {
                    for (int64_t s0 = 0; s0 < nseg; s0 += 4) {
                        int64_t ns = nseg - s0 < 4 ? nseg - s0 : 4;
                        cols_chunk(x, ld, kc, br + s0 * sbrs + k0, sbrs, ns, s0 == 0, 0, pt, &tot[g], &h[g], &l[g],
                                   a + s0);
                        cols_chunk(x, ld, kc, babs + s0 * sbrs + k0, sbrs, ns, 0, 1, pt, &tot[g], &h[g], &l[g],
                                   aa + s0);
                    }
                    continue;
                }
                vpart t = pget(&tot[g], pt), hg = pget(&h[g], pt), lg = pget(&l[g], pt);
                for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                    int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                    vpart p0 = psplat(0.0f), p1 = p0, p2 = p0, p3 = p0;
#define COL(pj, q)                  \
    {                               \
        vpart v = pld(x + ld * (q)); \
        pj += v;                    \
        hg = pmax(v, hg);           \
        lg = pmin(v, lg);           \
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
                pset(&tot[g], pt, t);
                pset(&h[g], pt, hg);
                pset(&l[g], pt, lg);
                for (int64_t sg = 0; sg < 2 * nseg; sg++) { /* A @ Br, then |A| @ Babs */
                    int abs = sg >= nseg;
                    const float *b = (abs ? babs : br) + (sg % nseg) * sbrs + k0;
                    v16 *dst = abs ? &aa[sg - nseg] : &a[sg];
                    vpart as = pget(dst, pt);
#define XQ(q) (abs ? pabs(pld(x + ld * (q))) : pld(x + ld * (q)))
                    for (int64_t q0 = 0; q0 < kc; q0 += 16) {
                        int64_t q1 = q0 + 16 < kc ? q0 + 16 : kc;
                        vpart p0 = psplat(0.0f), p1 = p0, p2 = p0, p3 = p0;
                        int64_t q = q0;
                        for (; q + 4 <= q1; q += 4) {
                            p0 += XQ(q) * psplat(b[q]);
                            p1 += XQ(q + 1) * psplat(b[q + 1]);
                            p2 += XQ(q + 2) * psplat(b[q + 2]);
                            p3 += XQ(q + 3) * psplat(b[q + 3]);
                        }
                        if (q < q1) p0 += XQ(q) * psplat(b[q]);
                        if (q + 1 < q1) p1 += XQ(q + 1) * psplat(b[q + 1]);
                        if (q + 2 < q1) p2 += XQ(q + 2) * psplat(b[q + 2]);
                        as += (p0 + p1) + (p2 + p3);
                    }
#undef XQ
                    pset(dst, pt, as);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t g = r / 16, j = r % 16;
        sum[r] = tot[g][j];
        hi[r] = h[g][j];
        lo[r] = l[g][j];
        for (int64_t sg = 0; sg < nseg; sg++) {
            ref[sg * RBMAX + r] = acc[g * nseg + sg][j];
            rabs[sg * RBMAX + r] = acca[g * nseg + sg][j];
        }
    }
}
