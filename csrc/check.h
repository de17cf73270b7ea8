/*
 * check.h: what the three files of the check share (check_a.c, check_sums.c, check.c).
 *
 * A work item is one block of rows of one batch entry: RB rows when A is row-major (or
 * strided), up to RBC rows when A is column-major (read as long streams of that many
 * elements per k; fewer when a small M would leave a thread without an item). For its
 * rows the item computes the statistics of A and the reference checksum
 * A Br per segment (check_a.c), the segment sums of C and the bias (check_sums.c), then
 * D, T and the verdicts (check.c), all into one scratch laid out [segment][row], so that
 * the verdict runs over 16 rows per vector.
 */
#ifndef VABFT_CHECK_H
#define VABFT_CHECK_H

#include "runs.h"

#define KC 256   /* K per block of A (a multiple of 64) */
#define RB 16    /* rows per work item of the check (row-major A) */
#define RBC 512  /* rows per work item of the check, column-major A (<= RBMAX): 2 KiB runs per k in fp32 */
#define KCC 16   /* K per block of a column-major A (a multiple of 16) */
#define RBMAX 512
#define ABUF (KC * RB > KCC * RBC ? KC * RB : KCC * RBC) /* floats of abuf */
#define ACCN (RB > RBC / 16 ? RB : RBC / 16) /* accumulator vectors per segment */
_Static_assert(RBC <= RBMAX && RBC % 16 == 0 && KCC % 16 == 0, "column-major blocks of whole vectors");

/* per-thread scratch of the check, reused by every work item of the thread */
typedef struct {
    float *abuf;  /* ABUF: a converted block of A (KC * RB, or KCC * RBC) */
    float *cbuf;  /* SEG * 16 */
    v16 *acc, *acca; /* ACCN * nseg each: the dots with Br and with Babs */
    v16 *xvec;    /* 3 * 16 * nseg: per-run vectors of the segment sums (plain, |.|, squares) of C and the bias */
    float *ref, *rabs, *csum, *cabs, *csq, *bsum, *babs; /* [nseg][RBMAX] each: segment s of row r at s * RBMAX + r */
    float sum[RBMAX], hi[RBMAX], lo[RBMAX];
} scratch;

/* check_a.c: sum / max / min of each of `rows` rows of A at pa, ref[s * RBMAX + r] =
 * A[r] . Br[:, s] and rabs[s * RBMAX + r] = |A[r]| . Babs[:, s]; row-major / strided A
 * (rows <= RB) or column-major A (rows <= RBC). */
void vabft_a_rows(const chk_ctx *c, const char *pa, int64_t rows, const float *br, const float *babs, float *buf,
                  v16 *acc, v16 *acca, float *sum, float *hi, float *lo, float *ref, float *rabs);
void vabft_a_cols(const chk_ctx *c, const char *pa, int64_t rows, const float *br, const float *babs, float *buf,
                  v16 *acc, v16 *acca, float *sum, float *hi, float *lo, float *ref, float *rabs);

/* check_sums.c: segment sums of `rows` rows of X (C or the bias) into out[s * RBMAX + r],
 * of |X| into aout and of X^2 into qout when given */
void vabft_x_block(const chk_ctx *c, scratch *w, const char *px, int dt, int64_t sm, int64_t sn, int64_t rows,
                   float *out, float *aout, float *qout);

#endif /* VABFT_CHECK_H */
