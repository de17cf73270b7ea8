/*
 * vabft_cpu.h: the "cpu" backend of sdc_guard, V-ABFT (docs/ALGORITHM.md) in plain C;
 * what its files share: dtype codes, the segment width, the two kernels' contexts and
 * the functions one file calls in another (prefixed vabft_).
 *
 * Two entry points, both one read of each operand, sums accumulated in fp32, every
 * square and product of statistics in fp64 (docs/ALGORITHM.md, "Range"):
 *   weight_side  B [Bt, K, N] -> Br, Babs [Bt, nseg, K] (segment-major) and the per-segment
 *                aggregates P1, P2, V, col_norm (fp64), bad and the four threshold factors
 *                of sdc_guard.abft.WeightSide._factors (fp64);
 *   check        A [.., M, K], C [.., M, N] (and a bias broadcast to C) -> D, T, ok per
 *                (row, segment), the row mean / max / min of A, and whether every segment
 *                passed with everything finite.
 * Operands are bf16 / fp16 / fp32 with any strides (fast paths for row-major and
 * column-major); bf16 / fp16 are converted to fp32 a block at a time, never as a copy of
 * a whole operand.
 *
 * Files, one concept each:
 *   lanes.h        16-lane fp32 vectors, dtype conversion, fixed reduction trees, and
 *                  the parts hot loops compute them in (AVX2: two halves);
 *   runs.h         sum / max / min of a contiguous run in a fixed lane order;
 *   parallel.c     the per-call split (on torch's OpenMP pool, else pthreads) and when;
 *   weight_side.c  B -> Br, its statistics, aggregates and threshold factors;
 *   check.h        the check's blocking, scratch and internal interface;
 *   check_a.c      the check's pass over A: row statistics and A Br per segment;
 *   check_sums.c   the check's segment sums of C and the bias;
 *   check.c        the check's work items, thresholds and verdicts;
 *   coll_sums.c    a collective's checksums (the collective checks, not V-ABFT);
 *   attn*.c / .h   the fused-attention screen (attn.h maps its files; ISA chosen at run
 *                  time, not by these build flags);
 *   module.c       the CPython bindings (sdc_guard._vabft_cpu).
 *
 * Determinism and batch invariance: every value of a row (D, T, the verdict) is computed
 * by the same sequence of fp32 operations whatever M is, whichever thread runs it and
 * whichever other rows share its block: sums use a fixed assignment of element index to
 * accumulator lane (index mod 64 for a contiguous run; one lane per row, in index order,
 * for column-major blocks), then a fixed reduction tree. Contraction into FMA is disabled
 * at build time (-ffp-contract=off) so that two code paths computing the same expression
 * round it the same way, whichever file they are in.
 *
 * Memory order: column-major operands are read as few long sequential streams (512 rows
 * of a column-major A per k; 16 columns of a column-major B, 64 k at a time), never as
 * hundreds of short strided runs. Horizontal sums / max / min of runs are reduced 16
 * runs at a time (lanes.h hsum16 and friends: the same tree as one run alone).
 *
 * NaN semantics follow torch: max / min of a run that holds a NaN is NaN (a rare path
 * rescans a run whose sum is NaN), so the Python side can build inputs_bad /
 * possible_overflow from these statistics exactly as the torch backend does.
 */
#ifndef VABFT_CPU_H
#define VABFT_CPU_H

#include <stdint.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define SEG 256 /* columns per checksum segment */
/* Elements read below which a call runs on one thread. With torch's OpenMP pool
 * (parallel.c) a split costs a few microseconds, the time to read ~64 Ki elements. With
 * pthreads a thread started right after a torch op competes with torch's OpenMP workers,
 * which spin (libgomp) for a while before they sleep: on a small machine that costs more
 * than the split saves unless the call runs for milliseconds. A negative thread count
 * forces the split (tests). */
#define OMP_MIN (1 << 16)
#define PAR_MIN (1 << 24)

/* columns of segment s of N (the last one may be narrower) */
static inline int64_t seg_width(int64_t n, int64_t s) {
    int64_t w = n - s * SEG;
    return w < SEG ? w : SEG;
}

/* ---- threads (parallel.c) ------------------------------------------------------------- */

typedef int (*work_fn)(void *ctx, int64_t i0, int64_t i1); /* returns an AND-able flag */

int vabft_parallel(work_fn fn, void *ctx, int64_t n, int threads);
int vabft_threads(int threads, int64_t elements);
const char *vabft_runtime(void);

/* ---- a collective's checksums (coll_sums.c) ------------------------------------------- */

/* per segment of 2048 elements of each of rows rows of n fp32 / bf16 elements: the even and
 * odd sums [rows, nseg, 2] then (with_abs) the magnitudes [rows, nseg], fp64, into out */
void vabft_coll_sums(const void *x, int dt, int64_t n, int64_t rows, int with_abs, double *out);
/* each row's (plain, weighted) sums of its 32-bit (wide) or 16-bit words modulo 2^32, [rows, 2] fp64 */
void vabft_coll_bits(const void *x, int wide, int64_t words, int64_t rows, double *out);

/* ---- weight side (weight_side.c) ------------------------------------------------------ */

typedef struct {
    const char *b;
    int dt;
    int64_t bt, k, n, nseg, sbb, sbk, sbn;
    const float *r;
    float *br, *babs, *hi, *lo; /* [bt][nseg][k] */
    int colwise;                /* set by vabft_weight_side */
    int64_t items_per_batch;
} ws_ctx;

/* Fills br / babs / hi / lo, agg [8][bt][nseg] (fp64) and bad [bt][nseg] of c (its operand
 * fields set; nseg included). Returns -1 when memory ran out, else 1. No Python. */
int vabft_weight_side(ws_ctx *c, double *agg, uint8_t *bad, int threads);

/* ---- check (check.c) ------------------------------------------------------------------ */

typedef struct {
    int64_t m, n, k, nseg, nb0, nb1, items_per_batch, rb;
    int acols; /* set by vabft_check: A column-major, read in blocks of rb <= RBC rows */
    const char *a;
    int adt;
    int64_t sa0, sa1, sam, sak;
    const char *c;
    int cdt;
    int64_t sc0, sc1, scm, scn;
    const char *bias; /* NULL: no bias term */
    int bdt;
    int64_t sb0, sb1, sbm, sbn;
    const float *r;
    const float *br, *babs;   /* Babs at the same offsets as Br */
    int64_t sbr0, sbr1, sbrs; /* Br[k, s] at br + b0 sbr0 + b1 sbr1 + s sbrs + k */
    const double *fm, *fcm, *fcs, *fsp;
    int64_t sf0, sf1;         /* factors: batch strides, segment stride 1 */
    double scale;             /* |alpha| e_eff */
    double round;             /* |alpha| u_acc (+ 3 u_fp32 with an epilogue): the factor of |A| @ Babs */
    double floor;             /* per element of a segment: precision.element_floor(K, C's dtype) */
    double cabs, csq, ccoh;   /* the factors of sum |r C|, sqrt(sum (r C)^2) and |sum r C|
                               * (precision.ScreenTerms.coefficients) */
    float alpha, beta, bias_round;
    float *diff, *thr, *mu, *hi, *lo; /* [nb][m][nseg], [nb][m] */
    uint8_t *ok, *zero;               /* [nb][m][nseg] */
    float *worst;                     /* [work items]: largest D / T of each item's rows */
} chk_ctx;

/* Fills diff / thr / mu / hi / lo / ok / zero of c (every other field but rb, acols,
 * items_per_batch and worst set) and *worst, the largest D / T over segments whose
 * verdict is finite. Returns whether every segment passed with D and T finite, or -1
 * when memory ran out. No Python. */
int vabft_check(chk_ctx *c, int threads, float *worst);

#endif /* VABFT_CPU_H */
