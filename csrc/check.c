/*
 * check.c: the check of one GEMM, C == alpha A B + beta bias, by work items of rows.
 *
 * chk_work runs an item: A's pass (check_a.c) and C's and the bias's segment sums
 * (check_sums.c) into the thread's scratch, then chk_rows turns them into D = |C sum -
 * reference| and the threshold T of VABFT.md per (row, segment), 16 rows per vector, and
 * the verdict D <= T. vabft_check splits the items over threads and reduces the largest
 * D / T. A row's D, T and verdict go through the same lane-wise operations whichever
 * lane, item or thread it lands in (batch invariance).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- lane-wise helpers of the threshold ---------------------------------------------- */

static inline v16 vsqrt(v16 x) {
#ifdef __AVX512F__
    return (v16)_mm512_sqrt_ps((__m512)x);
#else
    for (int j = 0; j < 16; j++) x[j] = sqrtf(x[j]);
    return x;
#endif
}
typedef uint8_t v16b __attribute__((vector_size(16)));
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
    v16i all_ok = splat(0.0f) == splat(0.0f); /* lanes of present rows: every segment good */
    v16 worst = splat(0.0f);
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 kf = splat((float)c->k), alpha = splat(c->alpha), beta = splat(c->beta);
    const v16 beta_abs = splat(fabsf(c->beta)), bias_round = splat(c->bias_round);
    const v16 mu_scale = splat(c->mu_scale), scale = splat(c->scale), inf = splat(INFINITY);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
        const v16i present = lane < (int32_t)nr;
        v16 mu = vld(w->sum + r0) / kf, hi = vld(w->hi + r0), lo = vld(w->lo + r0);
        v16 sd = vsqrt(vabs((hi - mu) * (mu - lo))), mua = vabs(mu);
        if (nr == 16) {
            vst(c->mu + row0 + r0, mu);
            vst(c->hi + row0 + r0, hi);
            vst(c->lo + row0 + r0, lo);
        } else {
            for (int64_t j = 0; j < nr; j++) {
                c->mu[row0 + r0 + j] = mu[j];
                c->hi[row0 + r0 + j] = hi[j];
                c->lo[row0 + r0 + j] = lo[j];
            }
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
            /* lane-wise, no scalar writes into a vector that is read back whole */
            worst = vsel((ratio > worst) & present, ratio, worst);
            all_ok &= good | ~present;
            if (nseg == 1 && nr == 16) { /* [rows][1]: 16 consecutive values */
                int64_t o = row0 + r0;
                vst(c->diff + o, d);
                vst(c->thr + o, t);
                v16b okb = __builtin_convertvector(-okv, v16b);
                memcpy(c->ok + o, &okb, 16);
                memset(c->zero + o, 0, 16);
            } else {
                for (int64_t j = 0; j < nr; j++) {
                    int64_t o = (row0 + r0 + j) * nseg + s;
                    c->diff[o] = d[j];
                    c->thr[o] = t[j];
                    c->ok[o] = (uint8_t)(okv[j] != 0);
                    c->zero[o] = 0;
                }
            }
        }
    }
    *worst_out = hmax(worst);
    for (int j = 0; j < 16; j++)
        if (!all_ok[j]) return 0;
    return 1;
}

/* Work items [i0, i1) on one thread (a work_fn of parallel.c), one scratch for all of
 * them; c->worst[item] gets each item's largest finite D / T. */
static int chk_work(void *vctx, int64_t i0, int64_t i1) {
    const chk_ctx *c = (const chk_ctx *)vctx;
    scratch w;
    int64_t nseg = c->nseg;
    size_t per = (size_t)RBMAX * nseg * sizeof(float);
    char *mem = (char *)aligned_alloc(64, ABUF * 4 + SEG * 16 * 4 + ACCN * nseg * sizeof(v16) + 32 * nseg * sizeof(v16) + 4 * per + nseg * sizeof(float) + 256);
    if (!mem) return -1;
    w.abuf = (float *)mem;
    w.cbuf = w.abuf + ABUF;
    w.acc = (v16 *)(w.cbuf + SEG * 16);
    w.xvec = w.acc + ACCN * nseg;
    w.ref = (float *)(w.xvec + 32 * nseg);
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
        if (c->acols) {
            vabft_a_cols(c, pa, rows, br, w.abuf, w.acc, w.sum, w.hi, w.lo, w.ref);
        } else {
            vabft_a_rows(c, pa, rows, br, w.abuf, w.acc, w.sum, w.hi, w.lo, w.ref);
        }
        const char *pc = c->c + (b0 * c->sc0 + b1 * c->sc1 + m0 * c->scm) * ESZ[c->cdt];
        vabft_x_block(c, &w, pc, c->cdt, c->scm, c->scn, rows, w.csum, NULL);
        if (c->bias) {
            const char *pb = c->bias + (b0 * c->sb0 + b1 * c->sb1 + m0 * c->sbm) * ESZ[c->bdt];
            vabft_x_block(c, &w, pb, c->bdt, c->sbm, c->sbn, rows, w.bsum, w.babs);
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
