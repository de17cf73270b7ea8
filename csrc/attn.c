/*
 * attn.c: the native attention screen's driver (attn.h): the ISA chosen at run time, the
 * packing of K and V, the work items and their threads, and every per-row threshold
 * (the formulas of sdc_guard/core/attention.py, evaluated in fp64 from the fp32 sums the
 * kernels return; docs/ATTENTION.md derives them).
 *
 * Work item: a chunk of the query positions (256, or L / 8 for L > 2048: AT_CHUNK,
 * AT_CHUNKS) of one query head of one stacked head (batch element, key/value head). A thread packs the stacked head's K^T (and V^T in the
 * backward) into [S / 16][D][16] fp32 once for its consecutive items of that head, then
 * runs 16-row blocks: the strip S[16, keys] (prescaled Q times K^T: the micro-kernel),
 * per row the mask, -inf past the causal diagonal, the maximum, the exps and their sums.
 * The backward adds the strip dP = dO V^T and the dS pass, whose sums over the rows go to
 * per-item column partials; a second parallel pass adds each stacked head's partials in
 * item order and finishes the dK / dV rows.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "lanes.h"

#define U32 (1.0 / 16777216.0)
#define FTZ 1.1754943508222875e-38 /* 2^-126 */
#define SLACK (1.0 + 1.0 / 1048576.0)
#define EXP_RANGE 104.0

/* ---- the ISA, chosen at run time ----------------------------------------------------------- */

static int cpu_runs(int level) {
#ifdef AT_X86
    __builtin_cpu_init();
    if (level == 3) return __builtin_cpu_supports("avx512f");
    if (level == 2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    return level == 1;
}

const attn_isa *vabft_attn_isa(int isa) {
    if (isa == 0) {
        for (int level = 3; level >= 1; level--)
            if (cpu_runs(level)) return vabft_attn_isa(level);
        return NULL;
    }
    if (isa < 1 || isa > 3 || !cpu_runs(isa)) return NULL;
#ifdef AT_X86
    if (isa == 3) return &attn_isa_avx512;
    if (isa == 2) return &attn_isa_avx2;
#endif
    return &attn_isa_generic;
}

/* ---- one call's geometry and shared buffers ------------------------------------------------ */

typedef struct {
    const attn_call *c;
    const attn_isa *isa;
    int bwd;
    int64_t g, chunk, nch, per_head, items, s_pad, ld;
    float *part;    /* backward: [items][5][s_pad] column partials */
    double *pscal;  /* backward: [items][2]: sum of flush |q|.1, sum of |dO|.1 over the item's rows */
    uint8_t *pflag; /* backward: [items]: 1 some row is unverifiable, 2 K or V is not finite */
} job;

/* One thread's scratch, and the stacked head packed in it. */
typedef struct {
    float *kp, *vp, *ksum, *kabs, *kas, *kn, *vsum, *vabs, *vas, *vn, *qp, *op, *sb, *dpb, *row;
    int64_t head;
    double kmax, vmax, kabs_tot, vabs_tot;
    int kfin, vfin;
    void *mem;
} scratch;

static int64_t up64(int64_t n) { return (n + 15) & ~(int64_t)15; } /* floats, to 64 bytes */

static int scratch_alloc(scratch *w, const job *J) {
    const attn_call *c = J->c;
    int64_t dm = c->d > c->dv ? c->d : c->dv;
    int64_t sizes[15] = {J->s_pad * c->d, J->bwd ? J->s_pad * c->dv : 0, J->s_pad, J->s_pad, J->s_pad, J->s_pad,
                         J->s_pad, J->s_pad, J->s_pad, J->s_pad, AT_RB * c->d, AT_RB * c->dv, AT_RB * J->ld,
                         J->bwd ? AT_RB * J->ld : 0, dm};
    int64_t total = 0;
    for (int i = 0; i < 15; i++) total += up64(sizes[i]);
    float *base = NULL;
    if (posix_memalign((void **)&base, 64, (size_t)total * 4)) return -1;
    float **slot[15] = {&w->kp, &w->vp, &w->ksum, &w->kabs, &w->kas, &w->kn, &w->vsum, &w->vabs, &w->vas, &w->vn,
                        &w->qp, &w->op, &w->sb, &w->dpb, &w->row};
    for (int i = 0; i < 15; i++) {
        *slot[i] = base;
        base += up64(sizes[i]);
    }
    w->mem = *slot[0];
    w->head = -1;
    return 0;
}

/* element (b, h, r, 0) of t */
static inline const char *at_row(const at_tensor *t, int64_t b, int64_t h, int64_t r) {
    return t->p + (b * t->sb + h * t->sh + r * t->sr) * ESZ[t->dt];
}

/* Row statistics: sum, sum of |x|, sum of squares, each in 16 fp32 lanes (lane l sums
 * elements l, l + 16, ...) reduced by lanes.h's fixed tree, and the largest |x| (out[3]). */
static void row_stats(const float *x, int64_t n, double out[4]) {
    v16 s = {0}, a = {0}, q = {0}, m = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v = vld(x + i);
        s += v;
        a += vabs(v);
        q += v * v;
        m = vmax(vabs(v), m);
    }
    if (i < n) {
        float t[16] = {0};
        memcpy(t, x + i, (size_t)(n - i) * 4);
        v16 v = vld(t);
        s += v;
        a += vabs(v);
        q += v * v;
        m = vmax(vabs(v), m);
    }
    out[0] = hsum(s);
    out[1] = hsum(a);
    out[2] = hsum(q);
    out[3] = hmax(m);
}

/* K or V of one stacked head: per key the sum, |.| sum, |sum| and norm (fp32, zero past S),
 * the largest row norm, the total |.| sum, whether all is finite; packed transposed when
 * pack. */
static void pack_kv(const at_tensor *t, int64_t b, int64_t h, int64_t s, int64_t d, int64_t s_pad, float *pack,
                    float *sum, float *abs_, float *asum, float *norm, double *maxnorm, double *abstot, int *fin,
                    float *row) {
    double mx = 0, tot = 0;
    int ok = 1;
    for (int64_t j = 0; j < s; j++) {
        cvt(at_row(t, b, h, j), t->dt, 1, d, row);
        double st[4];
        row_stats(row, d, st);
        ok &= isfinite(st[1]) != 0;
        sum[j] = (float)st[0];
        abs_[j] = (float)st[1];
        asum[j] = fabsf(sum[j]);
        norm[j] = sqrtf((float)st[2]);
        double nrm = sqrt(st[2]);
        if (nrm > mx) mx = nrm;
        tot += st[1];
        if (pack) {
            float *dst = pack + (j / 16) * d * 16 + (j % 16);
            for (int64_t i = 0; i < d; i++) dst[16 * i] = row[i];
        }
    }
    for (int64_t j = s; j < s_pad; j++) {
        sum[j] = abs_[j] = asum[j] = norm[j] = 0.0f;
        if (pack) {
            float *dst = pack + (j / 16) * d * 16 + (j % 16);
            for (int64_t i = 0; i < d; i++) dst[16 * i] = 0.0f;
        }
    }
    *maxnorm = mx;
    *abstot = tot;
    *fin = ok;
}

static void pack_head(const job *J, scratch *w, int64_t n) {
    const attn_call *c = J->c;
    int64_t b = n / c->hkv, h = n % c->hkv;
    pack_kv(&c->k, b, h, c->s, c->d, J->s_pad, w->kp, w->ksum, w->kabs, w->kas, w->kn, &w->kmax, &w->kabs_tot,
            &w->kfin, w->row);
    pack_kv(&c->v, b, h, c->s, c->dv, J->s_pad, J->bwd ? w->vp : NULL, w->vsum, w->vabs, w->vas, w->vn, &w->vmax,
            &w->vabs_tot, &w->vfin, w->row);
    w->head = n;
}

/* ---- the threshold's per-row parts (core/attention.py: s_error, p_error, grad_terms) ------- */

static double finite_or(double m) { /* torch's nan_to_num(0.0) */
    if (isnan(m)) return 0.0;
    if (isinf(m)) return m > 0 ? FLT_MAX : -FLT_MAX;
    return m;
}

/* rho: the relative error bound of the row's P (both copies) */
static double row_rho(const attn_call *c, double qnorm, double kmax, double rowmax) {
    double dot = fabs(c->c[AC_SCALE]) * qnorm * kmax;
    double eta = dot * c->c[AC_ECOEF] + 16 * U32 * (fabs(finite_or(rowmax)) + EXP_RANGE + dot);
    return 2 * (expm1(2 * eta) + c->c[AC_G2S]);
}

static inline double nan_inf(double x) { return isnan(x) ? INFINITY : x; }

/* ---- the blocks of one work item -------------------------------------------------------------- */

typedef struct {
    int64_t b, h, hq, g, i0, i1, n; /* batch, kv head, query head, group index, positions, stacked head */
} item;

static item item_of(const job *J, int64_t it) {
    const attn_call *c = J->c;
    item x;
    x.n = it / J->per_head;
    int64_t rest = it % J->per_head;
    x.g = rest / J->nch;
    int64_t ch = rest % J->nch;
    x.b = x.n / c->hkv;
    x.h = x.n % c->hkv;
    x.hq = x.h * J->g + x.g;
    x.i0 = ch * J->chunk;
    x.i1 = x.i0 + J->chunk < c->l ? x.i0 + J->chunk : c->l;
    return x;
}

/* Rows [i0, i0 + rows) of t's head (b, h) in fp32, times scale, transposed into
 * dst[d][AT_RB] (zero columns after rows: the micro-kernel's A); stats[r] = (sum, |.| sum,
 * sum of squares) of the unscaled row. row: scratch of d floats. */
static void pack_rows(const at_tensor *t, int64_t b, int64_t h, int64_t i0, int rows, int64_t d, float scale,
                      float *dst, double (*stats)[4], float *row) {
    for (int r = 0; r < AT_RB; r++) {
        if (r >= rows) {
            for (int64_t i = 0; i < d; i++) dst[AT_RB * i + r] = 0.0f;
            continue;
        }
        cvt(at_row(t, b, h, i0 + r), t->dt, 1, d, row);
        row_stats(row, d, stats[r]);
        for (int64_t i = 0; i < d; i++) dst[AT_RB * i + r] = row[i] * scale;
    }
}

/* row r of t's head (b, h): row_stats into st (sum, |.| sum, squares, max |.|) */
static void row_of(const at_tensor *t, int64_t b, int64_t h, int64_t r, int64_t d, float *tmp, double st[4]) {
    cvt(at_row(t, b, h, r), t->dt, 1, d, tmp);
    row_stats(tmp, d, st);
}

/* An output's own share of its threshold, read from its row st (row_of): its final
 * rounding, out_c sum |x| (core/attention.py, _out_rounding), and, with blk != 0, the
 * partial sums' roundings blk sqrt(e_in + max |x| sum |x|) (_blocks, energy) */
static double own_part(const double st[4], double out_c, double blk, double e_in) {
    double t = out_c * st[1];
    if (blk != 0.0) t += blk * sqrt(e_in + st[3] * st[1]);
    return t;
}

/* a verdict within a finite threshold (core/attention.py, _check) */
static inline int within(double dd, double t) { return (float)dd <= (float)t && isfinite((float)t); }

/* keys the rows [i0, i0 + rows) need, rounded up to whole vectors; the row's own limit */
static int64_t block_keys(const attn_call *c, int64_t i0, int rows) {
    int64_t nk = c->causal ? (i0 + rows < c->s ? i0 + rows : c->s) : c->s;
    return (nk + 15) / 16;
}
static int64_t row_limit(const attn_call *c, int64_t i) { return c->causal ? (i + 1 < c->s ? i + 1 : c->s) : c->s; }

static const char *mask_row(const attn_call *c, const item *x, int64_t i) {
    if (!c->mask) return NULL;
    int64_t esz = c->mdt == DT_F32 ? 4 : c->mdt == DT_BOOL ? 1 : 2;
    return c->mask + (x->b * c->smb + x->hq * c->smh + i * c->smi) * esz;
}

static int forward_items(void *ctx, int64_t i0, int64_t i1) {
    const job *J = (const job *)ctx;
    const attn_call *c = J->c;
    scratch w;
    if (scratch_alloc(&w, J)) return -1;
    const int64_t nq = c->b * c->hq * c->l, d = c->d;
    float *diff = c->out, *thr = c->out + nq;
    uint8_t *okf = c->flags, *badf = c->flags + nq;
    const float scale = (float)c->c[AC_SCALE];
    int all = 1;
    for (int64_t it = i0; it < i1; it++) {
        item x = item_of(J, it);
        if (w.head != x.n) pack_head(J, &w, x.n);
        for (int64_t p0 = x.i0; p0 < x.i1; p0 += AT_RB) {
            int rows = x.i1 - p0 < AT_RB ? (int)(x.i1 - p0) : AT_RB;
            double qs[AT_RB][4];
            pack_rows(&c->q, x.b, x.hq, p0, rows, d, scale, w.qp, qs, w.row);
            int64_t nkv = block_keys(c, p0, rows);
            J->isa->gemm(w.qp, d, w.kp, nkv, w.sb, J->ld);
            for (int r = 0; r < rows; r++) {
                int64_t i = p0 + r, o = (x.b * c->hq + x.hq) * c->l + i;
                float *s = w.sb + r * J->ld, sums[4];
                float m = J->isa->prep(s, 16 * nkv, mask_row(c, &x, i), c->mdt, row_limit(c, i));
                J->isa->expsum(s, 16 * nkv, m, w.vsum, w.vas, w.vabs, 0, sums);
                float total = sums[0];
                int bad = !isfinite(m) || !isfinite(total) || total == 0.0f || !w.vfin;
                float ref = sums[1] / total, a1 = sums[2] / total, a2 = sums[3] / total;
                double ost[4];
                row_of(&c->o, x.b, x.hq, i, c->dv, w.row, ost);
                double rho = row_rho(c, sqrt(qs[r][2]), w.kmax, m);
                double psi = (1 + rho) * (1 + c->c[AC_P]) - 1;
                double t = (psi * a1 + (1 + psi) * (c->c[AC_TAIL] - 1) * a2 + own_part(ost, c->c[AC_OUT], 0.0, 0.0) +
                            c->c[AC_FLOOR] + (c->c[AC_TINY] + FTZ) * w.vabs_tot) * SLACK;
                double dd = bad ? 0.0 : nan_inf(fabs(ost[0] - (double)ref));
                diff[o] = (float)dd;
                thr[o] = (float)t;
                badf[o] = (uint8_t)bad;
                okf[o] = !bad && within(dd, t);
                all &= okf[o];
            }
        }
    }
    free(w.mem);
    return all;
}

/* ---- backward --------------------------------------------------------------------------------- */

static int backward_items(void *ctx, int64_t i0, int64_t i1) {
    const job *J = (const job *)ctx;
    const attn_call *c = J->c;
    scratch w;
    if (scratch_alloc(&w, J)) return -1;
    const int64_t nq = c->b * c->hq * c->l, d = c->d, dv = c->dv;
    float *diff = c->out, *thr = c->out + nq;
    uint8_t *okf = c->flags, *badf = c->flags + nq;
    const float scale = (float)c->c[AC_SCALE];
    const double sc = fabs(c->c[AC_SCALE]), p_in = c->c[AC_P], tiny = c->c[AC_TINY];
    const double tail_q = c->c[AC_TAILQ], tail_kv = c->c[AC_TAILKV], tail_v = c->c[AC_TAILV];
    int all = 1;
    ds_block blk;
    blk.ld = J->ld;
    blk.colld = J->s_pad;
    for (int64_t it = i0; it < i1; it++) {
        item x = item_of(J, it);
        if (w.head != x.n) pack_head(J, &w, x.n);
        float *col = J->part + it * AT_COLS * J->s_pad;
        memset(col, 0, (size_t)(AT_COLS * J->s_pad) * 4);
        double fsum = 0, dabs = 0;
        int anybad = 0, kvbad = !w.kfin || !w.vfin;
        blk.col = col;
        blk.ksum = w.ksum;
        blk.kabs = w.kabs;
        blk.kas = w.kas;
        blk.kn = w.kn;
        blk.e = w.sb;
        blk.dp = w.dpb;
        for (int64_t p0 = x.i0; p0 < x.i1; p0 += AT_RB) {
            int rows = x.i1 - p0 < AT_RB ? (int)(x.i1 - p0) : AT_RB;
            double qs[AT_RB][4], gs[AT_RB][4];
            pack_rows(&c->q, x.b, x.hq, p0, rows, d, scale, w.qp, qs, w.row);
            pack_rows(&c->go, x.b, x.hq, p0, rows, dv, 1.0f, w.op, gs, w.row);
            int64_t nkv = block_keys(c, p0, rows);
            J->isa->gemm(w.qp, d, w.kp, nkv, w.sb, J->ld);
            J->isa->gemm(w.op, dv, w.vp, nkv, w.dpb, J->ld);
            blk.nkv = nkv;
            double kappa[AT_RB], beta[AT_RB], flush[AT_RB];
            for (int r = 0; r < AT_RB; r++) {
                blk.ok[r] = 0;
                if (r >= rows) continue;
                int64_t i = p0 + r;
                float *s = w.sb + r * J->ld, sums[4];
                float m = J->isa->prep(s, 16 * nkv, mask_row(c, &x, i), c->mdt, row_limit(c, i));
                J->isa->expsum(s, 16 * nkv, m, NULL, NULL, NULL, 1, sums);
                float total = sums[0];
                /* the saved output's row: its norm and Delta = dO . O */
                cvt(at_row(&c->o, x.b, x.hq, i), c->o.dt, 1, dv, w.row);
                double delta = 0, onorm = 0;
                int ofin;
                for (int64_t t = 0; t < dv; t++) {
                    delta += (double)w.op[AT_RB * t + r] * w.row[t];
                    onorm += (double)w.row[t] * w.row[t];
                }
                ofin = isfinite(onorm) && isfinite(gs[r][1]);
                int bad = !isfinite(m) || !isfinite(total) || total == 0.0f || !ofin;
                anybad |= bad;
                double rho = row_rho(c, sqrt(qs[r][2]), w.kmax, m);
                double wn = sqrt(gs[r][2]) * (w.vmax + sqrt(onorm));
                double grow = (1 + rho) * (1 + p_in) * (1 + U32), psi = (1 + rho) * (1 + p_in) - 1;
                kappa[r] = grow - 1;
                beta[r] = 2 * (c->c[AC_GDV] + 2 * c->c[AC_UPROD]) * wn * grow;
                flush[r] = 2 * FTZ * wn + tiny;
                fsum += flush[r] * qs[r][1];
                dabs += gs[r][1];
                blk.ok[r] = (uint8_t)!bad;
                blk.inv[r] = 1.0f / total;
                blk.delta[r] = (float)delta;
                /* the weights of the column sums (core/attention.py, backward_screen) */
                blk.w[0][r] = (float)gs[r][0];
                blk.w[1][r] = (float)(psi * fabs((double)(float)gs[r][0]) + (1 + psi) * (tail_v - 1) * gs[r][1]);
                blk.w[2][r] = (float)(beta[r] * (fabs((double)(float)qs[r][0]) + (tail_kv - 1) * qs[r][1]));
                blk.w[3][r] = (float)qs[r][0];
                blk.w[4][r] = (float)(kappa[r] * fabs((double)(float)qs[r][0]) + (1 + kappa[r]) * (tail_kv - 1) * qs[r][1]);
                blk.w[5][r] = sqrtf((float)gs[r][2]);
                blk.w[6][r] = sqrtf((float)qs[r][2]);
            }
            J->isa->dsblock(&blk);
            for (int r = 0; r < rows; r++) {
                int64_t i = p0 + r, o = (x.b * c->hq + x.hq) * c->l + i;
                int bad = !blk.ok[r] || kvbad;
                const float *ra = blk.racc[r];
                double ref = (double)(scale * ra[0]);
                double qst[4];
                row_of(&c->dq, x.b, x.hq, i, d, w.row, qst);
                double e_in = sc * sc * ((double)ra[6] * (double)ra[5]);
                double t = sc * (kappa[r] * ra[3] + (1 + kappa[r]) * (tail_q - 1) * ra[1] +
                                 beta[r] * (ra[4] + (tail_q - 1) * ra[2]) + tail_q * flush[r] * w.kabs_tot) +
                           own_part(qst, c->c[AC_OUTQ], c->c[AC_BLKQ], e_in) + c->c[AC_FQ];
                t *= SLACK;
                double dd = bad ? 0.0 : nan_inf(fabs(qst[0] - ref));
                diff[o] = (float)dd;
                thr[o] = (float)t;
                badf[o] = (uint8_t)bad;
                okf[o] = !bad && within(dd, t);
                all &= okf[o];
            }
        }
        J->pscal[2 * it] = fsum;
        J->pscal[2 * it + 1] = dabs;
        J->pflag[it] = (uint8_t)(anybad | (kvbad << 1));
    }
    free(w.mem);
    return all;
}

/* The dK / dV rows of stacked heads [n0, n1): each key's column partials added in item
 * order, the gradients' row sums, the thresholds. */
static int finish_kv(void *ctx, int64_t n0, int64_t n1) {
    const job *J = (const job *)ctx;
    const attn_call *c = J->c;
    const int64_t nq = c->b * c->hq * c->l, nk = c->b * c->hkv * c->s, dm = c->d > c->dv ? c->d : c->dv;
    float *kd = c->out + 2 * nq, *kt = kd + nk, *vd = kt + nk, *vt = vd + nk;
    uint8_t *kok = c->flags + 2 * nq, *vok = kok + nk, *kvbad = vok + nk;
    const double sc = fabs(c->c[AC_SCALE]), scale = c->c[AC_SCALE], tail_kv = c->c[AC_TAILKV];
    float *tmp = (float *)malloc((size_t)dm * 4);
    if (!tmp) return -1;
    int all = 1;
    for (int64_t n = n0; n < n1; n++) {
        int64_t it0 = n * J->per_head, it1 = it0 + J->per_head, b = n / c->hkv, h = n % c->hkv;
        double fsum = 0, dabs = 0;
        int bad = 0;
        for (int64_t it = it0; it < it1; it++) {
            fsum += J->pscal[2 * it];
            dabs += J->pscal[2 * it + 1];
            bad |= J->pflag[it] != 0;
        }
        for (int64_t j = 0; j < c->s; j++) {
            float s9[AT_COLS];
            for (int t = 0; t < AT_COLS; t++) {
                const float *p = J->part + it0 * AT_COLS * J->s_pad + t * J->s_pad + j;
                float acc = p[0];
                for (int64_t it = 1; it < J->per_head; it++) {
                    float x = p[it * AT_COLS * J->s_pad];
                    acc = (t == 6 || t == 8) ? (x > acc ? x : acc) : acc + x; /* 6, 8: maxima */
                }
                s9[t] = acc;
            }
            int64_t o = n * c->s + j;
            double kst[4], vst_[4];
            row_of(&c->dk, b, h, j, c->d, tmp, kst);
            row_of(&c->dvg, b, h, j, c->dv, tmp, vst_);
            double ek = sc * sc * ((double)s9[8] * (double)s9[7]), ev = (double)s9[6] * (double)s9[5];
            double tk = (sc * (s9[4] + s9[2] + tail_kv * fsum) + own_part(kst, c->c[AC_OUTK], c->c[AC_BLKKV], ek) +
                         c->c[AC_FK]) * SLACK;
            double tv = (s9[1] + (c->c[AC_TINY] + FTZ) * dabs + c->c[AC_FV] +
                         own_part(vst_, c->c[AC_OUTV], c->c[AC_BLKKV], ev)) * SLACK;
            double dk = bad ? 0.0 : nan_inf(fabs(kst[0] - (double)s9[3] * scale));
            double dvv = bad ? 0.0 : nan_inf(fabs(vst_[0] - (double)s9[0]));
            kd[o] = (float)dk;
            kt[o] = (float)tk;
            vd[o] = (float)dvv;
            vt[o] = (float)tv;
            kvbad[o] = (uint8_t)bad;
            kok[o] = !bad && within(dk, tk);
            vok[o] = !bad && within(dvv, tv);
            all &= kok[o] && vok[o];
        }
    }
    free(tmp);
    return all;
}

/* ---- entry points ------------------------------------------------------------------------------ */

static int and_results(int a, int b) { return (a < 0 || b < 0) ? -1 : (a && b); }

static int run(const attn_call *c, int threads, int bwd) {
    job J;
    memset(&J, 0, sizeof J);
    J.c = c;
    J.isa = vabft_attn_isa(c->isa);
    if (!J.isa) return -2;
    J.bwd = bwd;
    J.g = c->hq / c->hkv;
    J.nch = (c->l + AT_CHUNK - 1) / AT_CHUNK;
    if (J.nch > AT_CHUNKS) J.nch = AT_CHUNKS;
    J.chunk = ((c->l + J.nch - 1) / J.nch + AT_RB - 1) / AT_RB * AT_RB; /* whole row blocks */
    J.nch = (c->l + J.chunk - 1) / J.chunk;
    J.per_head = J.g * J.nch;
    J.items = c->b * c->hkv * J.per_head;
    J.s_pad = (c->s + 15) & ~(int64_t)15;
    J.ld = J.s_pad + 16; /* rows of a strip never 4 KiB apart */
    if (!bwd) return vabft_parallel(forward_items, &J, J.items, threads);
    J.part = (float *)malloc((size_t)(J.items * AT_COLS * J.s_pad) * 4);
    J.pscal = (double *)malloc((size_t)J.items * 2 * sizeof(double));
    J.pflag = (uint8_t *)malloc((size_t)J.items);
    int rc = -1;
    if (J.part && J.pscal && J.pflag) {
        rc = vabft_parallel(backward_items, &J, J.items, threads);
        if (rc >= 0) rc = and_results(rc, vabft_parallel(finish_kv, &J, c->b * c->hkv, threads));
    }
    free(J.part);
    free(J.pscal);
    free(J.pflag);
    return rc;
}

int vabft_attn_forward(const attn_call *c, int threads) { return run(c, threads, 0); }
int vabft_attn_backward(const attn_call *c, int threads) { return run(c, threads, 1); }
