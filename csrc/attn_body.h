/*
 * attn_body.h: the attention screen's kernels for one ISA (attn.h, attn_isa; AT_LEVEL and
 * AT_NAME set by the including attn_isa_*.c). Everything but the micro-kernel is written
 * once on the VF layer of attn_simd.h, so every ISA computes the same bits.
 */
#include "attn_simd.h"

/* ---- micro-kernel: A [16, d] (packed transposed, at[d'][16]) times B^T (packed
 * bp[nkb][d][16]): c[r][16 kb + l] = sum_d' at[d'][r] bp[kb][d'][l].
 * Each output is the fma chain over d' = 0, 1, ..., d - 1 starting from 0 (the first step
 * is the rounded product), whichever ISA and register blocking computes it. */
#if AT_LEVEL == 3
#define AT_ROW(r) __m512 c##r = _mm512_setzero_ps();
#define AT_FMA(r) c##r = _mm512_fmadd_ps(_mm512_set1_ps(a[16 * i + (r)]), bv, c##r);
#define AT_ST(r) _mm512_storeu_ps(c + (r) * ldc + 16 * kb, c##r);
#define AT_16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
static void gemm(const float *a, int64_t d, const float *bp, int64_t nkb, float *c, int64_t ldc) {
    for (int64_t kb = 0; kb < nkb; kb++) {
        const float *b = bp + kb * d * 16;
        AT_16(AT_ROW)
#pragma GCC unroll 2
        for (int64_t i = 0; i < d; i++) {
            __m512 bv = _mm512_loadu_ps(b + 16 * i);
            AT_16(AT_FMA)
        }
        AT_16(AT_ST)
    }
}
#elif AT_LEVEL == 2
/* rows in groups of 6, 6 and 4: 12 (or 8) accumulators, two halves per row */
#define AT_ROW(r) __m256 c##r##a = _mm256_setzero_ps(), c##r##b = _mm256_setzero_ps();
#define AT_FMA(r)                                                  \
    {                                                              \
        __m256 x = _mm256_broadcast_ss(a + 16 * i + r0 + r);       \
        c##r##a = _mm256_fmadd_ps(x, b0, c##r##a);                 \
        c##r##b = _mm256_fmadd_ps(x, b1, c##r##b);                 \
    }
#define AT_ST(r)                                                   \
    _mm256_storeu_ps(c + (r0 + r) * ldc + 16 * kb, c##r##a);       \
    _mm256_storeu_ps(c + (r0 + r) * ldc + 16 * kb + 8, c##r##b);
#define AT_4(M) M(0) M(1) M(2) M(3)
#define AT_6(M) M(0) M(1) M(2) M(3) M(4) M(5)
#define AT_GROUP(N)                                                                        \
    {                                                                                      \
        AT_##N(AT_ROW) for (int64_t i = 0; i < d; i++) {                                   \
            __m256 b0 = _mm256_loadu_ps(b + 16 * i), b1 = _mm256_loadu_ps(b + 16 * i + 8); \
            AT_##N(AT_FMA)                                                                 \
        }                                                                                  \
        AT_##N(AT_ST)                                                                      \
    }
static void gemm(const float *a, int64_t d, const float *bp, int64_t nkb, float *c, int64_t ldc) {
    for (int64_t kb = 0; kb < nkb; kb++) {
        const float *b = bp + kb * d * 16;
        int r0 = 0;
        AT_GROUP(6)
        r0 = 6;
        AT_GROUP(6)
        r0 = 12;
        AT_GROUP(4)
    }
}
#else
static void gemm(const float *a, int64_t d, const float *bp, int64_t nkb, float *c, int64_t ldc) {
    for (int64_t kb = 0; kb < nkb; kb++) {
        const float *b = bp + kb * d * 16;
        float acc[AT_RB][16];
        memset(acc, 0, sizeof acc);
        for (int64_t i = 0; i < d; i++)
            for (int r = 0; r < AT_RB; r++) {
                float x = a[16 * i + r];
                for (int l = 0; l < 16; l++) acc[r][l] = fmaf(x, b[16 * i + l], acc[r][l]);
            }
        for (int r = 0; r < AT_RB; r++) memcpy(c + r * ldc + 16 * kb, acc[r], sizeof acc[r]);
    }
}
#endif

/* ---- one row's S: the mask added, -inf from lim on, its maximum -------------------------- */
static float prep(float *s, int64_t n, const char *mask, int mdt, int64_t lim) {
    VF m = vset(-INFINITY);
    int64_t esz = mdt == DT_F32 ? 4 : mdt == DT_BOOL ? 1 : 2;
    for (int64_t j = 0; j < n; j += 16) {
        if (j >= lim) {
            vst(s + j, vset(-INFINITY));
            continue;
        }
        VF x = vld(s + j);
        int full = j + 16 <= lim;
        if (mask) {
            if (full) {
                x = vadd(x, vmask(mask + j * esz, mdt));
            } else { /* never read past the row's last key */
                char tmp[64] = {0};
                memcpy(tmp, mask + j * esz, (size_t)((lim - j) * esz));
                x = vadd(x, vmask(tmp, mdt));
            }
        }
        if (!full) x = vcut(x, j, lim);
        if (mask || !full) vst(s + j, x);
        m = vmax(m, x);
    }
    return vhmax(m);
}

/* ---- exps of one row and their weighted sums -------------------------------------------- */
static void expsum(float *s, int64_t n, float m, const float *w1, const float *w2, const float *w3, int keep,
                   float out[4]) {
    VF vm = vset(m), a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    if (w1) {
        for (int64_t j = 0; j < n; j += 16) {
            VF e = vexp(vsub(vld(s + j), vm));
            if (keep) vst(s + j, e);
            a0 = vadd(a0, e);
            a1 = vfma(e, vld(w1 + j), a1);
            a2 = vfma(e, vld(w2 + j), a2);
            a3 = vfma(e, vld(w3 + j), a3);
        }
    } else {
        for (int64_t j = 0; j < n; j += 16) {
            VF e = vexp(vsub(vld(s + j), vm));
            if (keep) vst(s + j, e);
            a0 = vadd(a0, e);
        }
    }
    out[0] = vhsum(a0);
    out[1] = vhsum(a1);
    out[2] = vhsum(a2);
    out[3] = vhsum(a3);
}

/* ---- the backward's dS pass over a block of rows (attn.h, ds_block) ---------------------- */
static void dsblock(ds_block *b) {
    VF racc[AT_RB][AT_RACC];
    for (int r = 0; r < AT_RB; r++)
        for (int t = 0; t < AT_RACC; t++) racc[r][t] = vzero();
    const int64_t ld = b->ld, cl = b->colld;
    for (int64_t j = 0; j < 16 * b->nkv; j += 16) {
        VF ks = vld(b->ksum + j), ka = vld(b->kabs + j), kz = vld(b->kas + j), kn = vld(b->kn + j);
        float *col = b->col + j;
        VF c[AT_COLS];
        for (int t = 0; t < AT_COLS; t++) c[t] = vld(col + t * cl);
        for (int r = 0; r < AT_RB; r++) {
            if (!b->ok[r]) continue;
            VF p = vmul(vld(b->e + r * ld + j), vset(b->inv[r]));
            VF ds = vmul(vsub(vld(b->dp + r * ld + j), vset(b->delta[r])), p);
            VF ads = vabs(ds);
            VF adk = vmul(ads, kn);
            racc[r][0] = vfma(ds, ks, racc[r][0]);
            racc[r][1] = vfma(ads, ka, racc[r][1]);
            racc[r][2] = vfma(p, ka, racc[r][2]);
            racc[r][3] = vfma(ads, kz, racc[r][3]);
            racc[r][4] = vfma(p, kz, racc[r][4]);
            racc[r][5] = vadd(racc[r][5], adk);
            racc[r][6] = vmax(adk, racc[r][6]);
            c[0] = vfma(p, vset(b->w[0][r]), c[0]);
            c[1] = vfma(p, vset(b->w[1][r]), c[1]);
            c[2] = vfma(p, vset(b->w[2][r]), c[2]);
            c[3] = vfma(ds, vset(b->w[3][r]), c[3]);
            c[4] = vfma(ads, vset(b->w[4][r]), c[4]);
            VF pw = vmul(p, vset(b->w[5][r])), dw = vmul(ads, vset(b->w[6][r]));
            c[5] = vadd(c[5], pw);
            c[6] = vmax(pw, c[6]);
            c[7] = vadd(c[7], dw);
            c[8] = vmax(dw, c[8]);
        }
        for (int t = 0; t < AT_COLS; t++) vst(col + t * cl, c[t]);
    }
    for (int r = 0; r < AT_RB; r++) {
        for (int t = 0; t < AT_RACC - 1; t++) b->racc[r][t] = vhsum(racc[r][t]);
        b->racc[r][AT_RACC - 1] = vhmax(racc[r][AT_RACC - 1]);
    }
}

/* ---- the exp alone (tests) ---------------------------------------------------------------- */
static void expn(const float *x, float *y, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        float in[16] = {0}, out[16];
        int64_t w = n - j < 16 ? n - j : 16;
        memcpy(in, x + j, (size_t)w * 4);
        vst(out, vexp(vld(in)));
        memcpy(y + j, out, (size_t)w * 4);
    }
}

const attn_isa AT_NAME = {AT_LABEL, gemm, prep, expsum, dsblock, expn};
