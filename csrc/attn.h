/*
 * attn.h: the native screen of fused attention (docs/ATTENTION.md), what its files share.
 *
 * The screen needs, per query row i, P_i = softmax(scale q_i K^T + mask) and a few sums
 * of it (forward: sum_j P_ij (V 1)_j and sum_j P_ij |V_j|.1; backward: also dP = dO V^T,
 * dS = P * (dP - Delta), their products with K 1, |K| 1 and, summed over the rows, with
 * dO 1, Q 1, |Q| 1 and the threshold's per-row weights). The torch path builds S for
 * chunks of whole heads in memory and passes over it several times; here a block of 16
 * query rows at a time computes its strip S[16, keys] (64 KiB at 1 Ki keys: in cache)
 * with a register-blocked micro-kernel, then the row maxima, the exps and every sum in
 * two passes over that strip. Causal rows stop at the diagonal. No L x S matrix exists.
 *
 * Files:
 *   attn.h        this interface: blocking constants, one ISA's kernels (attn_isa);
 *   attn_simd.h   the 16-lane vector layer of each ISA (AVX-512, AVX2 halves, plain C)
 *                 and the fp32 exp every path shares, operation for operation;
 *   attn_body.h   the kernels of one ISA, written once on that layer (included by each
 *                 attn_isa_*.c with its ISA selected);
 *   attn_isa_*.c  one translation unit per ISA (avx512, avx2: compiled for that ISA with
 *                 a target pragma whatever the build flags; generic: the build's flags);
 *   attn.c        packing, the work items and their threads, the per-row thresholds
 *                 (plain C, shared by every ISA), the ISA dispatch at run time.
 *
 * Every ISA computes the same bits (tests/unit/backends/test_native_attention.py compares them): each
 * S_ij is an fma chain over the head dim in index order starting from 0, every sum over
 * keys accumulates key j into lane j mod 16 in key order and reduces the 16 lanes with
 * one fixed tree, every sum over query rows adds the rows in order (16-row blocks, then
 * the work items of a head in order), and the exp is one sequence of fp32 operations.
 * The split into work items depends on the shape only (AT_CHUNK, AT_CHUNKS), so the
 * thread count never changes a result.
 */
#ifndef VABFT_ATTN_H
#define VABFT_ATTN_H

#include <stdint.h>

#include "vabft_cpu.h"

#define DT_BOOL 3   /* mask dtype code: bool (1 byte, nonzero = attend) */
#define AT_KB 16    /* keys per vector and per packed block of K^T / V^T */
#define AT_RB 16    /* query rows per block (the micro-kernel's rows) */
#define AT_CHUNK 256 /* query positions per work item, at least */
#define AT_CHUNKS 8  /* work items per query head, at most (bounds the backward's column partials) */

/* One block of the backward's dS pass (attn_body.h, dsblock): rows r < AT_RB with ok[r]
 * set, key vectors v < nkv. In: e (unnormalised exps, 0 where masked) and dp = dO V^T,
 * [AT_RB][ld]; per row: inv (1 / the row's sum of e), delta, and the weights w0..w6 of
 * the column sums; per key: ksum, kabs, kas (|ksum|), kn (the row norm). Adds, for each key
 * j, to col[c * colld + j]: c = 0: P w0, 1: P w1, 2: P w2, 3: dS w3, 4: |dS| w4, 5: P w5,
 * 7: |dS| w6 (rows in order), and takes the maxima c = 6: P w5, 8: |dS| w6; writes
 * racc[r]: the row sums of dS ksum, |dS| kabs, P kabs, |dS| kas, P kas, |dS| kn and the
 * row maximum of |dS| kn. */
#define AT_COLS 9
#define AT_RACC 7
typedef struct {
    int64_t nkv, ld, colld;
    const float *e, *dp, *ksum, *kabs, *kas, *kn;
    float *col;
    float inv[AT_RB], delta[AT_RB], w[7][AT_RB];
    uint8_t ok[AT_RB];
    float racc[AT_RB][AT_RACC];
} ds_block;

/* One ISA's kernels (attn_body.h says what each computes). */
typedef struct {
    const char *name;
    /* c[r * ldc + 16 kb + l] = sum_d' a[16 d' + r] bp[(kb * d + d') * 16 + l], r < AT_RB, kb < nkb */
    void (*gemm)(const float *a, int64_t d, const float *bp, int64_t nkb, float *c, int64_t ldc);
    /* s[j] += mask[j] (j < lim), s[j] = -inf (lim <= j < n); returns the maximum */
    float (*prep)(float *s, int64_t n, const char *mask, int mdt, int64_t lim);
    /* e_j = exp(s[j] - m), j < n (n a multiple of 16), written over s when keep; out: the
     * sums of e, of e w1, of e w2 and of e w3 (w1, w2, w3 NULL: only the first) */
    void (*expsum)(float *s, int64_t n, float m, const float *w1, const float *w2, const float *w3, int keep,
                   float out[4]);
    void (*dsblock)(ds_block *b);
    void (*exp)(const float *x, float *y, int64_t n); /* y = exp(x) as the kernels compute it */
} attn_isa;

extern const attn_isa attn_isa_generic;
#if defined(__x86_64__)
#define AT_X86 1
extern const attn_isa attn_isa_avx2, attn_isa_avx512;
#endif

/* ---- the entry points (attn.c; module.c binds them) ------------------------------------ */

/* A [B, H, R, C] operand: its data, dtype code and strides in elements (the last is 1). */
typedef struct {
    const char *p;
    int dt;
    int64_t sb, sh, sr;
} at_tensor;

/* Threshold constants (Python computes them from the rounding model; attn.c says how
 * each enters). */
enum {
    AC_SCALE, AC_ECOEF, AC_G2S, AC_P, AC_TINY, /* both directions */
    AC_TAIL, AC_FLOOR, AC_OUT,                 /* forward */
    AC_UPROD, AC_GDV, AC_TAILQ, AC_TAILKV, AC_TAILV, AC_FQ, AC_FK, AC_FV, /* backward */
    AC_OUTQ, AC_OUTK, AC_OUTV, AC_BLKQ, AC_BLKKV,
    AC_N
};

typedef struct {
    int64_t b, hq, hkv, l, s, d, dv;
    at_tensor q, k, v, o;      /* o: the forward's output (backward: the saved one) */
    at_tensor go, dq, dk, dvg; /* backward: grad_out and the three gradients */
    const char *mask;          /* [B, Hq, L, S] after broadcasting, key stride 1; NULL: none */
    int mdt;
    int64_t smb, smh, smi;
    int causal, isa;
    double c[AC_N];
    /* forward: out = diff, thr [B Hq L]; flags = ok, bad [B Hq L].
     * backward: out = dq diff, thr [B Hq L], dk diff, thr, dv diff, thr [B Hkv S];
     * flags = dq ok, bad [B Hq L], dk ok, dv ok, kv bad [B Hkv S]. */
    float *out;
    uint8_t *flags;
} attn_call;

/* Return whether every row passed, -1 when memory ran out, -2 for an ISA this CPU lacks. */
int vabft_attn_forward(const attn_call *c, int threads);
int vabft_attn_backward(const attn_call *c, int threads);
/* The kernels of ISA code `isa` (1 generic, 2 avx2, 3 avx512; 0: the best this CPU runs),
 * NULL when this CPU or build cannot run them. */
const attn_isa *vabft_attn_isa(int isa);

#endif /* VABFT_ATTN_H */
