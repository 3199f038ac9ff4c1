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
#ifdef __AVX512F__
#include <immintrin.h>
#endif
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

/* ---- Fast paths: contiguous streams (counter = base + i), final float32 values ---------
 *
 * Each Philox block yields four words, used by four consecutive elements, and blocks are
 * generated VB at a time in structure-of-arrays form so the compiler vectorizes the
 * 32x32->64-bit multiplies across blocks. The float transforms are the canonical ones
 * (compile_rng/stream.py) with separate multiply and add (built with -ffp-contract=off),
 * so results are bitwise equal to the generic path and to the Inductor lowering.
 */
#define VB 16

/* Eight blocks per vector: words held in 64-bit lanes (values < 2**32), so the
 * 32x32->64 multiply is one vector multiply and hi/lo are a shift and a mask. */
typedef uint64_t u64x8 __attribute__((vector_size(64)));

static void philox_blocks(uint64_t first, uint32_t k0, uint32_t k1, uint32_t w[4][VB]) {
    const uint64_t mask32 = 0xFFFFFFFFull;
    for (int half = 0; half < VB; half += 8) {
        u64x8 c0, c1, c2 = {0}, c3 = {0};
        for (int j = 0; j < 8; j++) {
            uint64_t b = (first + (uint64_t)(half + j)) & ((1ULL << 62) - 1);  /* counters wrap mod 2**64 */
            c0[j] = b & mask32;
            c1[j] = b >> 32;
        }
        uint64_t kk0 = k0, kk1 = k1;
        for (int r = 0; r < 10; r++) {
#ifdef __AVX512F__
            /* vpmuludq: the 32x32->64 multiply of the low halves, one uop (vs vpmullq's three) */
            u64x8 p0 = (u64x8)_mm512_mul_epu32((__m512i)c0, _mm512_set1_epi64(0xD2511F53ll));
            u64x8 p1 = (u64x8)_mm512_mul_epu32((__m512i)c2, _mm512_set1_epi64(0xCD9E8D57ll));
#else
            u64x8 p0 = c0 * 0xD2511F53ull;
            u64x8 p1 = c2 * 0xCD9E8D57ull;
#endif
            u64x8 n0 = (p1 >> 32) ^ c1 ^ kk0;
            u64x8 n2 = (p0 >> 32) ^ c3 ^ kk1;
            c0 = n0;
            c1 = p1 & mask32;
            c2 = n2;
            c3 = p0 & mask32;
            kk0 = (kk0 + 0x9E3779B9u) & mask32;
            kk1 = (kk1 + 0xBB67AE85u) & mask32;
        }
        for (int j = 0; j < 8; j++) {
            w[0][half + j] = (uint32_t)c0[j];
            w[1][half + j] = (uint32_t)c1[j];
            w[2][half + j] = (uint32_t)c2[j];
            w[3][half + j] = (uint32_t)c3[j];
        }
    }
}

enum { OP_UNIFORM = 0, OP_BERNOULLI = 1, OP_DROPOUT = 2 };

typedef struct {
    int op;
    float *out;
    uint8_t *mask;     /* dropout: keep mask */
    const float *x;    /* dropout: input */
    int64_t begin, end;
    uint64_t seed, base;
    float low, range, high_f;                  /* uniform */
    uint64_t threshold;                        /* bernoulli / dropout keep */
    float scale;                               /* dropout */
} fjob_t;

static inline void emit(const fjob_t *j, int64_t i, uint32_t w) {
    switch (j->op) {
    case OP_UNIFORM: {
        float u = (float)(w >> 8) * 0x1p-24f;
        float v = u * j->range;
        v = v + j->low;
        j->out[i] = (v >= j->high_f) ? j->low : v;  /* high_f == high exactly (caller checks) */
        break;
    }
    case OP_BERNOULLI:
        j->out[i] = ((uint64_t)w < j->threshold) ? 1.0f : 0.0f;
        break;
    default: {
        int keep = (uint64_t)w < j->threshold;
        float kept = j->x[i] * (keep ? 1.0f : 0.0f);
        j->out[i] = kept * j->scale;
        j->mask[i] = (uint8_t)keep;
    }
    }
}

/* One op per instantiation (op is a constant after inlining), so the emit loop vectorizes. */
static inline __attribute__((always_inline)) void run_range(fjob_t *j, const int op) {
    uint32_t k0 = (uint32_t)j->seed, k1 = (uint32_t)(j->seed >> 32);
    int64_t i = j->begin;
    uint32_t w[4][VB], lin[4 * VB];
    fjob_t job = *j;
    job.op = op;
    /* head: up to the next block boundary; body: VB blocks at a time; tail: the rest */
    while (i < j->end) {
        uint64_t n = j->base + (uint64_t)i;
        uint64_t block = n >> 2;
        unsigned lane = (unsigned)(n & 3);
        if (lane == 0 && j->end - i >= 4 * VB) {
            philox_blocks(block, k0, k1, w);
            for (int b = 0; b < VB; b++)
                for (int l = 0; l < 4; l++) lin[4 * b + l] = w[l][b];
            for (int k = 0; k < 4 * VB; k++) emit(&job, i + k, lin[k]);
            i += 4 * VB;
            continue;
        }
        uint32_t c[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0, 0};
        philox4x32_10(c, k0, k1);
        for (; lane < 4 && i < j->end; lane++, i++) emit(&job, i, c[lane]);
    }
}

static void *run_fjob(void *arg) {
    fjob_t *j = (fjob_t *)arg;
    switch (j->op) {
    case OP_UNIFORM: run_range(j, OP_UNIFORM); break;
    case OP_BERNOULLI: run_range(j, OP_BERNOULLI); break;
    default: run_range(j, OP_DROPOUT); break;
    }
    return NULL;
}

/* Contiguous float32 outputs. op: 0 uniform, 1 bernoulli(threshold), 2 dropout. */
int cr_fast_f32(int op, float *out, uint8_t *mask, const float *x, int64_t numel, uint64_t seed, uint64_t base,
                float low, float range, float high, uint64_t threshold, float scale, int nthreads) {
    const int64_t min_per_thread = 1 << 16;
    if (nthreads < 1) nthreads = 1;
    if (numel / min_per_thread < nthreads) nthreads = (int)(numel / min_per_thread);
    if (nthreads < 1) nthreads = 1;
    fjob_t jobs[64];
    pthread_t tids[64];
    if (nthreads > 64) nthreads = 64;
    int started = 0, rc = 0;
    for (int t = 0; t < nthreads; t++) {
        fjob_t *j = &jobs[t];
        j->op = op; j->out = out; j->mask = mask; j->x = x;
        j->begin = numel * t / nthreads;
        j->end = numel * (t + 1) / nthreads;
        j->seed = seed; j->base = base; j->low = low; j->range = range; j->high_f = high;
        j->threshold = threshold; j->scale = scale;
        if (t == 0) continue;
        if (pthread_create(&tids[t], NULL, run_fjob, j) != 0) { rc = -2; break; }
        started = t;
    }
    if (rc == 0) run_fjob(&jobs[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    return rc;
}
