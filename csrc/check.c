/*
 * check.c: the check of one GEMM, C == alpha A B + beta bias, by work items of rows.
 *
 * chk_work runs an item: A's pass (check_a.c) and C's and the bias's segment sums
 * (check_sums.c) into the thread's scratch, then chk_rows turns them into D = |C sum -
 * reference| and the threshold T of docs/ALGORITHM.md per (row, segment), 16 rows per
 * vector, and the verdict D <= T. vabft_check splits the items over threads and reduces the largest
 * D / T. A row's D, T and verdict go through the same lane-wise operations whichever
 * lane, item or thread it lands in (batch invariance).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- lane-wise helpers of the threshold, on parts (lanes.h) ------------------------------ */

/* flags[j] = 1 where lane j of m is set, else 0 (PW bytes) */
static inline void pst_flags(uint8_t *flags, vpmask m) {
#ifdef VABFT_AVX2
    __m256i t = (__m256i)m; /* -1 / 0 per lane: saturating packs keep them, negated to 1 / 0 */
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    _mm_storel_epi64((__m128i *)flags, _mm_sub_epi8(_mm_setzero_si128(), _mm_packs_epi16(w, w)));
#else
    typedef uint8_t v16b __attribute__((vector_size(16)));
    v16b b = __builtin_convertvector(-m, v16b);
    memcpy(flags, &b, 16);
#endif
}

/* PW lanes of fp64: the threshold's arithmetic (docs/ALGORITHM.md, "Range") */
typedef double vdpart __attribute__((vector_size(PW * 8)));

static inline vdpart pd(vpart x) { return __builtin_convertvector(x, vdpart); }
static inline vdpart dsplat(double x) {
    vdpart v = {0};
    return v + x;
}
static inline vdpart dsqrt(vdpart x) { /* IEEE sqrt, lane-wise (vsqrtpd: -fno-math-errno) */
    for (int j = 0; j < PW; j++) x[j] = sqrt(x[j]);
    return x;
}

/* D, T and the verdict of rows [0, rows) of a work item (row0: their flat index), 16
 * rows per vector, a part at a time (parts without rows skipped): every row goes through
 * the same lane-wise operations whichever lane, part and group it lands in (padding lanes
 * are computed and dropped). T is computed in fp64 from the fp32 statistics (sd from the
 * exact fp64 product of the Bhatia-Davis factors, the bracket's products and the hypot
 * without any intermediate underflow or overflow) and rounded to fp32 once, to compare
 * with the fp32 D. Stores mu / hi / lo, diff / thr / ok / zero; *worst = the largest
 * finite-verdict D / T. Returns whether every segment passed with D and T finite. */
static int chk_rows(const chk_ctx *c, const scratch *w, int64_t rows, int64_t row0, const double *fm,
                    const double *fcm, const double *fcs, const double *fsp, float *worst_out) {
    int64_t nseg = c->nseg;
    const vpmask lane = pindex();
    vpmask all_ok[NPART]; /* lanes of present rows: every segment good */
    vpart worst[NPART];
    for (int pt = 0; pt < NPART; pt++) {
        all_ok[pt] = psplat(0.0f) == psplat(0.0f);
        worst[pt] = psplat(0.0f);
    }
    const vpart kf = psplat((float)c->k), alpha = psplat(c->alpha), beta = psplat(c->beta);
    const vpart inf = psplat(INFINITY);
    const vdpart scale = dsplat(c->scale), round = dsplat(c->round), cabs = dsplat(c->cabs);
    const vdpart csq = dsplat(c->csq), ccoh = dsplat(c->ccoh);
    const vdpart bias_round = dsplat((double)c->bias_round * fabs((double)c->beta));
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        for (int pt = 0; pt < NPART && pt * PW < rows - r0; pt++) {
            int64_t rp = r0 + pt * PW, nr = rows - rp < PW ? rows - rp : PW;
            const vpmask present = lane < (int32_t)nr;
            /* + 0: a zero max / min is +0, whichever zero a tie kept (row_pass and
             * acc_stats group the lanes differently; only the bits of a zero differ) */
            vpart zero = psplat(0.0f), mu = pld(w->sum + rp) / kf;
            vpart hi = pld(w->hi + rp) + zero, lo = pld(w->lo + rp) + zero;
            vdpart mu64 = pd(mu), var = (pd(hi) - mu64) * (mu64 - pd(lo)), mua = mu64;
            for (int j = 0; j < PW; j++) { /* a mean rounded past max or min makes the product negative */
                var[j] = fabs(var[j]);
                mua[j] = fabs(mua[j]);
            }
            vdpart sd = dsqrt(var);
            if (nr == PW) {
                pst(c->mu + row0 + rp, mu);
                pst(c->hi + row0 + rp, hi);
                pst(c->lo + row0 + rp, lo);
            } else {
                for (int64_t j = 0; j < nr; j++) {
                    c->mu[row0 + rp + j] = mu[j];
                    c->hi[row0 + rp + j] = hi[j];
                    c->lo[row0 + rp + j] = lo[j];
                }
            }
            for (int64_t s = 0; s < nseg; s++) {
                int64_t q = s * RBMAX + rp;
                vpart ref = pld(w->ref + q) * alpha;
                vdpart floor = dsplat((double)seg_width(c->n, s) * c->floor);
                if (c->bias) {
                    ref = ref + beta * pld(w->bsum + q);
                    floor = floor + bias_round * pd(pld(w->babs + q));
                }
                vdpart x = mua * dsplat(fcm[s]), y = sd * dsplat(fcs[s]);
                vdpart bracket = mua * dsplat(fm[s]) + dsqrt(x * x + y * y) + sd * dsplat(fsp[s]);
                vdpart t64 = floor + scale * bracket + round * pd(pld(w->rabs + q));
                vpart csum = pld(w->csum + q);
                /* C's own rounding, read from C (docs/ALGORITHM.md, "Reading C"; abft.c_round64) */
                vdpart cterm = dsplat(0.0);
                if (c->cabs != 0.0) cterm = cabs * pd(pld(w->cabs + q)); /* w->cabs is filled only then */
                if (c->csq != 0.0) {
                    vpart sq = pld(w->csq + q);
                    vdpart prob = csq * dsqrt(pd(sq)) + ccoh * pd(pabs(csum));
                    for (int j = 0; j < PW; j++) /* where Q is normal: the smaller of the two */
                        if (sq[j] >= FLT_MIN && sq[j] < INFINITY && prob[j] < cterm[j]) cterm[j] = prob[j];
                } else if (c->ccoh != 0.0) {
                    cterm = cterm + ccoh * pd(pabs(csum));
                }
                t64 = t64 + cterm;
                vpart t = __builtin_convertvector(t64, vpart);
                vpart d = pabs(csum - ref);
                vpmask okv = (d <= t) & (d < inf) & (pabs(t) < inf); /* T reads C: infinite only where C's sums are */
                vpmask good = okv & (pabs(t) < inf);
                vpart ratio = d / t;
                /* lane-wise, no scalar writes into a vector that is read back whole */
                worst[pt] = psel((ratio > worst[pt]) & present, ratio, worst[pt]);
                all_ok[pt] &= good | ~present;
                if (nseg == 1 && nr == PW) { /* [rows][1]: PW consecutive values */
                    int64_t o = row0 + rp;
                    pst(c->diff + o, d);
                    pst(c->thr + o, t);
                    pst_flags(c->ok + o, okv);
                    memset(c->zero + o, 0, PW);
                } else {
                    for (int64_t j = 0; j < nr; j++) {
                        int64_t o = (row0 + rp + j) * nseg + s;
                        c->diff[o] = d[j];
                        c->thr[o] = t[j];
                        c->ok[o] = (uint8_t)(okv[j] != 0);
                        c->zero[o] = 0;
                    }
                }
            }
        }
    }
    v16 wv;
    int32_t ok[16];
    for (int pt = 0; pt < NPART; pt++) {
        pset(&wv, pt, worst[pt]);
        memcpy(ok + pt * PW, &all_ok[pt], sizeof all_ok[pt]);
    }
    *worst_out = hmax(wv);
    for (int j = 0; j < 16; j++)
        if (!ok[j]) return 0;
    return 1;
}

/* Work items [i0, i1) on one thread (a work_fn of parallel.c), one scratch for all of
 * them; c->worst[item] gets each item's largest finite D / T. */
static int chk_work(void *vctx, int64_t i0, int64_t i1) {
    const chk_ctx *c = (const chk_ctx *)vctx;
    scratch w;
    int64_t nseg = c->nseg;
    size_t per = (size_t)RBMAX * nseg * sizeof(float);
    char *mem = (char *)aligned_alloc(64, ABUF * 4 + SEG * 16 * 4 + 2 * ACCN * nseg * sizeof(v16) + 48 * nseg * sizeof(v16) + 7 * per + 256);
    if (!mem) return -1;
    w.abuf = (float *)mem;
    w.cbuf = w.abuf + ABUF;
    w.acc = (v16 *)(w.cbuf + SEG * 16);
    w.acca = w.acc + ACCN * nseg;
    w.xvec = w.acca + ACCN * nseg;
    w.ref = (float *)(w.xvec + 48 * nseg);
    w.rabs = w.ref + RBMAX * nseg;
    w.csum = w.rabs + RBMAX * nseg;
    w.cabs = w.csum + RBMAX * nseg;
    w.csq = w.cabs + RBMAX * nseg;
    w.bsum = w.csq + RBMAX * nseg;
    w.babs = w.bsum + RBMAX * nseg;
    int all_ok = 1;
    for (int64_t it = i0; it < i1; it++) {
        int64_t bi = it / c->items_per_batch, m0 = (it % c->items_per_batch) * c->rb;
        int64_t b0 = bi / c->nb1, b1 = bi % c->nb1;
        int64_t rows = c->m - m0 < c->rb ? c->m - m0 : c->rb;
        const char *pa = c->a + (b0 * c->sa0 + b1 * c->sa1 + m0 * c->sam) * ESZ[c->adt];
        const float *br = c->br + b0 * c->sbr0 + b1 * c->sbr1, *babs = c->babs + b0 * c->sbr0 + b1 * c->sbr1;
        if (c->acols) {
            vabft_a_cols(c, pa, rows, br, babs, w.abuf, w.acc, w.acca, w.sum, w.hi, w.lo, w.ref, w.rabs);
        } else {
            vabft_a_rows(c, pa, rows, br, babs, w.abuf, w.acc, w.acca, w.sum, w.hi, w.lo, w.ref, w.rabs);
        }
        const char *pc = c->c + (b0 * c->sc0 + b1 * c->sc1 + m0 * c->scm) * ESZ[c->cdt];
        vabft_x_block(c, &w, pc, c->cdt, c->scm, c->scn, rows, w.csum, c->cabs != 0.0 ? w.cabs : NULL,
                      c->csq != 0.0 ? w.csq : NULL);
        if (c->bias) {
            const char *pb = c->bias + (b0 * c->sb0 + b1 * c->sb1 + m0 * c->sbm) * ESZ[c->bdt];
            vabft_x_block(c, &w, pb, c->bdt, c->sbm, c->sbn, rows, w.bsum, w.babs, NULL);
        }
        /* padding lanes of the last group of 16 rows: zeros (computed, then dropped) */
        for (int64_t r = rows; r < ((rows + 15) & ~(int64_t)15); r++) {
            w.sum[r] = w.hi[r] = w.lo[r] = 0.0f;
            for (int64_t s = 0; s < nseg; s++)
                w.ref[s * RBMAX + r] = w.rabs[s * RBMAX + r] = w.csum[s * RBMAX + r] = w.cabs[s * RBMAX + r] =
                    w.csq[s * RBMAX + r] = w.bsum[s * RBMAX + r] = w.babs[s * RBMAX + r] = 0.0f;
        }
        /* NaN in a row of A: max / min are NaN (torch semantics), found by a rescan */
        for (int64_t r = 0; r < rows; r++)
            if (isnan(w.sum[r]) && has_nan(pa + r * c->sam * ESZ[c->adt], c->adt, c->sak, c->k)) w.hi[r] = w.lo[r] = NAN;
        const double *fm = c->fm + b0 * c->sf0 + b1 * c->sf1, *fcm = c->fcm + b0 * c->sf0 + b1 * c->sf1;
        const double *fcs = c->fcs + b0 * c->sf0 + b1 * c->sf1, *fsp = c->fsp + b0 * c->sf0 + b1 * c->sf1;
        int64_t row0 = bi * c->m + m0;
        int ok_all = chk_rows(c, &w, rows, row0, fm, fcm, fcs, fsp, &c->worst[it]);
        all_ok = all_ok && ok_all;
    }
    free(mem);
    return all_ok;
}

int vabft_check(chk_ctx *c, int threads, float *worst) {
    int64_t nb = c->nb0 * c->nb1;
    threads = vabft_threads(threads, nb * c->m * (c->k + c->n));
    /* column-major A: blocks of up to RBC rows read as long streams per k; fewer rows per
     * block when the batch has too few blocks to give every thread one (M = 256 would
     * be one item, on one thread), in equal multiples of 16 (a row's arithmetic does
     * not depend on its block) */
    c->acols = c->sak != 1 && c->sam == 1;
    c->rb = c->acols ? RBC : RB;
    if (c->acols && threads > 1) {
        int64_t per = (threads + nb - 1) / nb, need = (c->m + RBC - 1) / RBC;
        if (per > need) need = per;
        int64_t rb = ((c->m + need - 1) / need + 15) & ~(int64_t)15;
        c->rb = rb < RBC ? rb : RBC;
    }
    c->items_per_batch = (c->m + c->rb - 1) / c->rb;
    int64_t items = nb * c->items_per_batch;
    c->worst = (float *)malloc((size_t)items * sizeof(float));
    if (!c->worst) return -1;
    int rc = vabft_parallel(chk_work, c, items, threads);
    float w = 0.0f;
    for (int64_t i = 0; i < items; i++)
        if (c->worst[i] > w) w = c->worst[i];
    free(c->worst);
    c->worst = NULL;
    *worst = w;
    return rc;
}
