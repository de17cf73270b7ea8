/*
 * parallel.c: the per-call thread split of the native kernels.
 *
 * Plain pthreads created per call, only when the work is large (PAR_MIN elements, 16 Mi:
 * below that a call is well under a few ms and a second thread would fight torch's
 * spinning OpenMP workers for the cores); no OpenMP, whose idle workers would spin
 * beside torch's own pool. Work is split into contiguous ranges of items; what a thread
 * computes for an item does not depend on the split (batch invariance), so the thread
 * count never changes a result.
 */
#include <pthread.h>

#include "vabft_cpu.h"

typedef struct {
    work_fn fn;
    void *ctx;
    int64_t i0, i1;
    int result;
} job_t;

static void *run_job(void *p) {
    job_t *j = (job_t *)p;
    j->result = j->fn(j->ctx, j->i0, j->i1);
    return NULL;
}

/* Run fn over items [0, n) split into contiguous ranges on up to `threads` threads
 * (the caller's thread takes the first range). Returns the AND of the results, or -1
 * when memory ran out. */
int vabft_parallel(work_fn fn, void *ctx, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    if (threads <= 1) return fn(ctx, 0, n);
    job_t jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    if (threads > 64) threads = 64;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){fn, ctx, n * t / threads, n * (t + 1) / threads, 1};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    int all = jobs[0].result;
    for (int t = 1; t < threads; t++) {
        if (started[t]) {
            pthread_join(tid[t], NULL);
        } else {
            run_job(&jobs[t]); /* could not start a thread: do its share here */
        }
        if (jobs[t].result < 0 || all < 0)
            all = -1;
        else
            all = all && jobs[t].result;
    }
    return all;
}

/* The thread count for a call reading `elements` elements: one below PAR_MIN, at most
 * `threads` above; a negative `threads` forces the split (tests). */
int vabft_threads(int threads, int64_t elements) {
    if (threads < 0) return -threads;
    return elements < PAR_MIN ? 1 : threads;
}
