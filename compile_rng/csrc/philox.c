/* Eager CPU kernel for compile_rng: Philox4x32-10 words at per-element counters.
 *
 * Element i of an output of shape `size` has the 64-bit counter
 *     n = base + sum_d idx_d(i) * strides[d]        (mod 2**64)
 * where idx(i) is the row-major multi-index of i. The kernel writes the stream
 * words the canonical transforms need (compile_rng/stream.py); the float math is
 * done by the caller so that eager and Inductor share one transform definition.
 *
 * Built at first use by compile_rng/cpu_kernel.py. Only integer arithmetic, so
 * compiler flags cannot change results.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_DIMS 16

static void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = (uint32_t)p1;
        c[2] = n2;
        c[3] = (uint32_t)p0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
}

typedef struct {
    int64_t *words;   /* numel words (mode 0) or 2*numel words (pair mode) */
    int64_t *lanes;   /* optional: numel lanes (n & 3) */
    int64_t begin, end;
    uint64_t seed, base;
    int ndim;
    int64_t size[MAX_DIMS], strides[MAX_DIMS];
    uint32_t c2;
    int pair;
} job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    int64_t idx[MAX_DIMS];
    int64_t rem = j->begin;
    uint64_t n = j->base;
    for (int d = j->ndim - 1; d >= 0; d--) {
        idx[d] = j->size[d] ? rem % j->size[d] : 0;
        rem = j->size[d] ? rem / j->size[d] : 0;
        n += (uint64_t)idx[d] * (uint64_t)j->strides[d];
    }
    uint64_t cached_block = ~(uint64_t)0;
    int have_block = 0;
    uint32_t w[4];
    for (int64_t i = j->begin; i < j->end; i++) {
        uint64_t block = n >> 2;
        unsigned lane = (unsigned)(n & 3);
        if (!have_block || block != cached_block) {
            w[0] = (uint32_t)block;
            w[1] = (uint32_t)(block >> 32);
            w[2] = j->c2;
            w[3] = 0;
            philox4x32_10(w, (uint32_t)j->seed, (uint32_t)(j->seed >> 32));
            cached_block = block;
            have_block = 1;
        }
        if (j->pair) {
            unsigned p = lane >> 1;
            j->words[2 * i] = w[2 * p];
            j->words[2 * i + 1] = w[2 * p + 1];
        } else {
            j->words[i] = w[lane];
        }
        if (j->lanes) j->lanes[i] = lane;
        /* odometer step: advance the multi-index and the counter together */
        for (int d = j->ndim - 1; d >= 0; d--) {
            n += (uint64_t)j->strides[d];
            if (++idx[d] < j->size[d]) break;
            n -= (uint64_t)j->strides[d] * (uint64_t)idx[d];
            idx[d] = 0;
        }
    }
    return NULL;
}

/* Returns 0 on success, -1 if ndim is too large, -2 if a thread could not start. */
int cr_philox_words(int64_t *words, int64_t *lanes, int64_t numel, uint64_t seed,
                    uint64_t base, int ndim, const int64_t *size, const int64_t *strides,
                    uint32_t c2, int pair, int nthreads) {
    if (ndim > MAX_DIMS) return -1;
    const int64_t min_per_thread = 1 << 16;
    if (nthreads < 1) nthreads = 1;
    if (numel / min_per_thread < nthreads) nthreads = (int)(numel / min_per_thread);
    if (nthreads < 1) nthreads = 1;
    job_t *jobs = (job_t *)calloc((size_t)nthreads, sizeof(job_t));
    pthread_t *tids = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!jobs || !tids) { free(jobs); free(tids); return -2; }
    int rc = 0, started = 0;
    for (int t = 0; t < nthreads; t++) {
        job_t *j = &jobs[t];
        j->words = words; j->lanes = lanes;
        j->begin = numel * t / nthreads; j->end = numel * (t + 1) / nthreads;
        j->seed = seed; j->base = base; j->ndim = ndim; j->c2 = c2; j->pair = pair;
        for (int d = 0; d < ndim; d++) { j->size[d] = size[d]; j->strides[d] = strides[d]; }
        if (t == 0) continue;
        if (pthread_create(&tids[t], NULL, run_job, j) != 0) { rc = -2; break; }
        started = t;
    }
    if (rc == 0) run_job(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    free(jobs); free(tids);
    return rc;
}
