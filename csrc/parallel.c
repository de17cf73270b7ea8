/*
 * parallel.c: the per-call thread split of the native kernels.
 *
 * A call borrows the OpenMP thread pool torch itself runs on, when one is loaded in the
 * process (torch's CPU builds ship libgomp): right after a torch op its workers are
 * still spinning, so they pick our work up within microseconds instead of fighting a new
 * thread for the cores. The runtime is found among the loaded objects and called through
 * its GOMP_parallel entry point (the ABI `#pragma omp parallel` compiles to; LLVM's and
 * Intel's runtimes export it too), so the extension neither links an OpenMP runtime of
 * its own (two pools would spin against each other) nor needs torch to build.
 *
 * Without a loaded OpenMP runtime (or with SDC_GUARD_NATIVE_OPENMP=0) it falls back to plain pthreads created per call, and
 * only for large calls (PAR_MIN elements): a thread started right after a torch op
 * competes with torch's spinning workers for the cores.
 *
 * Work is split into contiguous ranges of items; what a thread computes for an item does
 * not depend on the split (batch invariance), so the thread count never changes a result.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "vabft_cpu.h"

#define MAX_THREADS 64

/* ---- the OpenMP runtime already in the process ----------------------------------------- */

typedef void (*gomp_parallel_t)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);

static struct {
    pthread_once_t once;
    gomp_parallel_t parallel;
    int (*thread_num)(void);
    int (*num_threads)(void);
    char name[256];
} omp = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, ""};

static int is_openmp_runtime(const char *path) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    return !strncmp(base, "libgomp", 7) || !strncmp(base, "libomp", 6) || !strncmp(base, "libiomp", 7);
}

/* the path of the first loaded OpenMP runtime, into omp.name (dlopen is called after the
 * walk, outside the loader lock dl_iterate_phdr holds) */
static int find_runtime(struct dl_phdr_info *info, size_t size, void *unused) {
    (void)size;
    (void)unused;
    const char *path = info->dlpi_name;
    if (!path || !*path || !is_openmp_runtime(path) || strlen(path) >= sizeof omp.name) return 0;
    strcpy(omp.name, path);
    return 1;
}

static void probe_runtime(void) {
    const char *use = getenv("SDC_GUARD_NATIVE_OPENMP"); /* "0": never borrow the pool */
    if (use && !strcmp(use, "0")) return;
    if (!dl_iterate_phdr(find_runtime, NULL)) return;
    void *h = dlopen(omp.name, RTLD_LAZY | RTLD_NOLOAD); /* a handle on the loaded copy, never a new one */
    if (!h) {
        omp.name[0] = 0;
        return;
    }
    gomp_parallel_t par = (gomp_parallel_t)dlsym(h, "GOMP_parallel");
    int (*num)(void) = (int (*)(void))dlsym(h, "omp_get_thread_num");
    int (*team)(void) = (int (*)(void))dlsym(h, "omp_get_num_threads");
    if (par && num && team) {
        omp.thread_num = num;
        omp.num_threads = team;
        omp.parallel = par;
    } else {
        omp.name[0] = 0;
    }
}

/* The OpenMP runtime the kernels run on ("" when they use pthreads). Probed once, at the
 * first call: by then torch, which loads the runtime, has been imported. */
const char *vabft_runtime(void) {
    pthread_once(&omp.once, probe_runtime);
    return omp.name;
}

typedef struct {
    work_fn fn;
    void *ctx;
    int64_t n;
    int team;
    int result[MAX_THREADS];
} omp_job_t;

static void omp_body(void *p) {
    omp_job_t *j = (omp_job_t *)p;
    int t = omp.thread_num(), team = omp.num_threads(); /* the team may be smaller than asked */
    if (t == 0) j->team = team;
    j->result[t] = j->fn(j->ctx, j->n * t / team, j->n * (t + 1) / team);
}

/* ---- pthreads fallback ------------------------------------------------------------------ */

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

static int and_results(int all, int r) { return (r < 0 || all < 0) ? -1 : (all && r); }

static int run_pthreads(work_fn fn, void *ctx, int64_t n, int threads) {
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) jobs[t] = (job_t){fn, ctx, n * t / threads, n * (t + 1) / threads, 1};
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tid[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    int all = jobs[0].result;
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_job(&jobs[t]); /* could not start a thread: do its share here */
        all = and_results(all, jobs[t].result);
    }
    return all;
}

/* Run fn over items [0, n) split into contiguous ranges on up to `threads` threads.
 * Returns the AND of the results, or -1 when memory ran out. */
int vabft_parallel(work_fn fn, void *ctx, int64_t n, int threads) {
    if (threads > n) threads = (int)n;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) return fn(ctx, 0, n);
    if (!*vabft_runtime()) return run_pthreads(fn, ctx, n, threads);
    omp_job_t job = {fn, ctx, n, 1, {0}};
    omp.parallel(omp_body, &job, (unsigned)threads, 0);
    int all = job.result[0];
    for (int t = 1; t < job.team; t++) all = and_results(all, job.result[t]);
    return all;
}

/* The thread count for a call reading `elements` elements: one below the split threshold
 * of the runtime in use (OMP_MIN with torch's OpenMP pool, PAR_MIN with pthreads), at most
 * `threads` above; a negative `threads` forces the split (tests). */
int vabft_threads(int threads, int64_t elements) {
    if (threads < 0) return -threads;
    return elements < (*vabft_runtime() ? OMP_MIN : PAR_MIN) ? 1 : threads;
}
