/* CPU kernels for compile_rng: canonical stream v1 (compile_rng/stream.py).
 *
 * Element i of an output of shape `size` has the 64-bit counter
 *     n = base + sum_d idx_d(i) * strides[d]        (mod 2**64)
 * where idx(i) is the row-major multi-index of i.
 *
 * - cr_philox_words: the stream words of any layout (the generic eager path does the
 *   float transforms with torch ops, shared with the Inductor lowering);
 * - cr_fast_f32: float32 uniform/bernoulli/dropout of a contiguous stream, final values;
 * - cr_normal_f32: float32 normals of any layout, final values.
 * - cr_normal_f32_at: float32 normals at explicit counters.
 *
 * Built at first use by compile_rng/cpu_kernel.py with -ffp-contract=off and without
 * -ffast-math, so float results do not depend on vectorization.
 */
#include <pthread.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <sys/mman.h>

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

/* Walks the counters of elements begin, begin+1, ... of a layout (an odometer). */
typedef struct {
    int ndim;
    const int64_t *size, *strides;
    int64_t idx[MAX_DIMS];
    uint64_t n;  /* the current element's counter */
} walk_t;

static void walk_start(walk_t *w, uint64_t base, int ndim, const int64_t *size, const int64_t *strides,
                       int64_t begin) {
    w->ndim = ndim; w->size = size; w->strides = strides; w->n = base;
    for (int d = ndim - 1; d >= 0; d--) {
        w->idx[d] = size[d] ? begin % size[d] : 0;
        begin = size[d] ? begin / size[d] : 0;
        w->n += (uint64_t)w->idx[d] * (uint64_t)strides[d];
    }
}

static inline void walk_next(walk_t *w) {
    for (int d = w->ndim - 1; d >= 0; d--) {
        w->n += (uint64_t)w->strides[d];
        if (++w->idx[d] < w->size[d]) return;
        w->n -= (uint64_t)w->strides[d] * (uint64_t)w->idx[d];
        w->idx[d] = 0;
    }
}

/* Runs fn(ctx, begin, end) over [0, numel) split across up to nthreads threads
 * (at least min_per_thread elements each); the calling thread takes the first part.
 * Returns 0, or -2 if a thread could not start (then nothing was computed). */
typedef void (*range_fn)(const void *ctx, int64_t begin, int64_t end);
typedef struct { range_fn fn; const void *ctx; int64_t begin, end; } task_t;

static void *run_task(void *arg) {
    task_t *t = (task_t *)arg;
    t->fn(t->ctx, t->begin, t->end);
    return NULL;
}

static int parallel_for(int64_t numel, int nthreads, int64_t min_per_thread, range_fn fn, const void *ctx) {
    if (numel / min_per_thread < nthreads) nthreads = (int)(numel / min_per_thread);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    task_t tasks[64];
    pthread_t tids[64];
    int started = 0;
    for (int t = 0; t < nthreads; t++) {
        tasks[t] = (task_t){fn, ctx, numel * t / nthreads, numel * (t + 1) / nthreads};
        if (t == 0) continue;
        if (pthread_create(&tids[t], NULL, run_task, &tasks[t]) != 0) {
            for (int u = 1; u <= started; u++) pthread_join(tids[u], NULL);
            return -2;
        }
        started = t;
    }
    run_task(&tasks[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    return 0;
}

typedef struct {
    int64_t *words;   /* numel words (mode 0) or 2*numel words (pair mode) */
    int64_t *lanes;   /* optional: numel lanes (n & 3) */
    uint64_t seed, base;
    int ndim;
    const int64_t *size, *strides;
    uint32_t c2;
    int pair;
} words_t;

static void words_range(const void *ctx, int64_t begin, int64_t end) {
    const words_t *j = (const words_t *)ctx;
    walk_t walk;
    walk_start(&walk, j->base, j->ndim, j->size, j->strides, begin);
    uint64_t cached = ~(uint64_t)0;
    uint32_t w[4];
    for (int64_t i = begin; i < end; i++, walk_next(&walk)) {
        uint64_t block = walk.n >> 2;
        unsigned lane = (unsigned)(walk.n & 3);
        if (block != cached) {  /* ~0 is never a block index (< 2**62) */
            w[0] = (uint32_t)block; w[1] = (uint32_t)(block >> 32); w[2] = j->c2; w[3] = 0;
            philox4x32_10(w, (uint32_t)j->seed, (uint32_t)(j->seed >> 32));
            cached = block;
        }
        if (j->pair) {
            unsigned p = lane >> 1;
            j->words[2 * i] = w[2 * p];
            j->words[2 * i + 1] = w[2 * p + 1];
        } else {
            j->words[i] = w[lane];
        }
        if (j->lanes) j->lanes[i] = lane;
    }
}

/* Returns 0 on success, -1 if ndim is too large, -2 if a thread could not start. */
int cr_philox_words(int64_t *words, int64_t *lanes, int64_t numel, uint64_t seed,
                    uint64_t base, int ndim, const int64_t *size, const int64_t *strides,
                    uint32_t c2, int pair, int nthreads) {
    if (ndim > MAX_DIMS) return -1;
    words_t ctx = {words, lanes, seed, base, ndim, size, strides, c2, pair};
    return parallel_for(numel, nthreads, 1 << 16, words_range, &ctx);
}

/* ---- Fast paths: contiguous streams (counter = base + i), final float32 values ---------
 *
 * Each Philox block yields four words, used by four consecutive elements, and blocks are
 * generated VB at a time in structure-of-arrays form so the compiler vectorizes the
 * 32x32->64-bit multiplies across blocks. The float transforms are the canonical ones
 * (compile_rng/stream.py) with separate multiply and add (built with -ffp-contract=off),
 * so results are bitwise equal to the generic path and to the Inductor lowering.
 */
#define VB 32

/* Eight blocks per vector, NV vectors per call: words held in 64-bit lanes (values
 * < 2**32), so the 32x32->64 multiply is one vector multiply and hi/lo are a shift and a
 * mask. The NV vectors are independent dependency chains interleaved in every round,
 * which is what keeps the multiplier busy (one chain is latency-bound). */
typedef uint64_t u64x8 __attribute__((vector_size(64)));
#define NV (VB / 8)

static inline u64x8 mul32(u64x8 a, uint64_t m) {
#ifdef __AVX512F__
    return (u64x8)_mm512_mul_epu32((__m512i)a, _mm512_set1_epi64((long long)m));  /* vpmuludq */
#else
    return a * m;
#endif
}

typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));

/* Words of 8 blocks (one vector per word index) -> the 32 values in element order
 * (block-major, lane-minor), with two rounds of interleaving shuffles. */
static inline void interleave(u64x8 w0, u64x8 w1, u64x8 w2, u64x8 w3, uint32_t *dst) {
    u32x8 a = __builtin_convertvector(w0, u32x8), b = __builtin_convertvector(w1, u32x8);
    u32x8 c = __builtin_convertvector(w2, u32x8), d = __builtin_convertvector(w3, u32x8);
    const u32x8 lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
    u64x4 ab0 = (u64x4)__builtin_shuffle(a, b, lo), ab1 = (u64x4)__builtin_shuffle(a, b, hi);
    u64x4 cd0 = (u64x4)__builtin_shuffle(c, d, lo), cd1 = (u64x4)__builtin_shuffle(c, d, hi);
    const u64x4 lo64 = {0, 4, 1, 5}, hi64 = {2, 6, 3, 7};
    u64x4 out[4] = {
        __builtin_shuffle(ab0, cd0, lo64), __builtin_shuffle(ab0, cd0, hi64),
        __builtin_shuffle(ab1, cd1, lo64), __builtin_shuffle(ab1, cd1, hi64),
    };
    __builtin_memcpy(dst, out, sizeof(out));
}

static void philox_blocks(uint64_t first, uint32_t k0, uint32_t k1, uint32_t *lin) {
    const uint64_t mask32 = 0xFFFFFFFFull;
    const u64x8 iota = {0, 1, 2, 3, 4, 5, 6, 7};
    u64x8 c0[NV], c1[NV], c2[NV], c3[NV];
    for (int v = 0; v < NV; v++) {
        u64x8 b = (first + (uint64_t)(8 * v) + iota) & ((1ULL << 62) - 1);  /* counters wrap mod 2**64 */
        c0[v] = b & mask32;
        c1[v] = b >> 32;
        c2[v] = (u64x8){0};
        c3[v] = (u64x8){0};
    }
    uint64_t kk0 = k0, kk1 = k1;
    for (int r = 0; r < 10; r++) {
        for (int v = 0; v < NV; v++) {
            u64x8 p0 = mul32(c0[v], 0xD2511F53ull);
            u64x8 p1 = mul32(c2[v], 0xCD9E8D57ull);
            u64x8 n0 = (p1 >> 32) ^ c1[v] ^ kk0;
            u64x8 n2 = (p0 >> 32) ^ c3[v] ^ kk1;
            c0[v] = n0;
            c1[v] = p1 & mask32;
            c2[v] = n2;
            c3[v] = p0 & mask32;
        }
        kk0 = (kk0 + 0x9E3779B9u) & mask32;
        kk1 = (kk1 + 0xBB67AE85u) & mask32;
    }
    for (int v = 0; v < NV; v++) interleave(c0[v], c1[v], c2[v], c3[v], lin + 32 * v);
}

enum { OP_UNIFORM = 0, OP_BERNOULLI = 1, OP_DROPOUT = 2 };

typedef struct {
    int op;
    float *out;
    uint8_t *mask;     /* dropout: keep mask */
    const float *x;    /* dropout: input */
    uint64_t seed, base;
    float low, range, high_f;                  /* uniform */
    uint64_t threshold;                        /* bernoulli / dropout keep */
    float scale;                               /* dropout */
} fjob_t;

/* w < threshold (threshold <= 2**32) with 32-bit operations only, so it vectorizes in
 * the 32-bit lanes of the words. */
static inline int below(uint32_t w, uint64_t threshold) {
    return (int)(threshold > 0xFFFFFFFFu) | (int)(w < (uint32_t)threshold);
}

/* out/mask/x are restrict: a store through the byte mask could otherwise alias the job
 * and force reloads that stop the batch loop from vectorizing. */
static inline void emit(const fjob_t *j, float *restrict out, uint8_t *restrict mask, const float *restrict x,
                        int64_t i, uint32_t w) {
    switch (j->op) {
    case OP_UNIFORM: {
        float u = (float)(w >> 8) * 0x1p-24f;
        float v = u * j->range;
        v = v + j->low;
        out[i] = (v >= j->high_f) ? j->low : v;  /* high_f == high exactly (caller checks) */
        break;
    }
    case OP_BERNOULLI:
        out[i] = below(w, j->threshold) ? 1.0f : 0.0f;
        break;
    default: {
        int keep = below(w, j->threshold);
        float kept = x[i] * (keep ? 1.0f : 0.0f);
        out[i] = kept * j->scale;
        mask[i] = (uint8_t)keep;
    }
    }
}

/* One op per instantiation (op is a constant after inlining), so the emit loop vectorizes. */
static inline __attribute__((always_inline)) void fast_range_op(const fjob_t *j, int64_t i, int64_t end,
                                                                 const int op) {
    uint32_t k0 = (uint32_t)j->seed, k1 = (uint32_t)(j->seed >> 32);
    uint32_t lin[4 * VB];
    fjob_t job = *j;
    job.op = op;
    float *restrict out = j->out;
    uint8_t *restrict mask = j->mask;
    const float *restrict x = j->x;
    /* head: up to the next block boundary; body: VB blocks at a time; tail: the rest */
    while (i < end) {
        uint64_t n = j->base + (uint64_t)i;
        uint64_t block = n >> 2;
        unsigned lane = (unsigned)(n & 3);
        if (lane == 0 && end - i >= 4 * VB) {
            philox_blocks(block, k0, k1, lin);
            for (int k = 0; k < 4 * VB; k++) emit(&job, out, mask, x, i + k, lin[k]);
            i += 4 * VB;
            continue;
        }
        uint32_t c[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0, 0};
        philox4x32_10(c, k0, k1);
        for (; lane < 4 && i < end; lane++, i++) emit(&job, out, mask, x, i, c[lane]);
    }
}

static void fast_range(const void *ctx, int64_t begin, int64_t end) {
    const fjob_t *j = (const fjob_t *)ctx;
    switch (j->op) {
    case OP_UNIFORM: fast_range_op(j, begin, end, OP_UNIFORM); break;
    case OP_BERNOULLI: fast_range_op(j, begin, end, OP_BERNOULLI); break;
    default: fast_range_op(j, begin, end, OP_DROPOUT); break;
    }
}

/* Fresh output buffers are not yet backed by memory; faulting them in 4 KiB pages costs
 * several times the generation itself. Ask for transparent huge pages on the aligned
 * interior before the first write (advisory: a no-op where THP is unavailable). */
static void prefer_huge_pages(void *p, size_t bytes) {
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end <= begin) return;
    madvise((void *)begin, end - begin, MADV_HUGEPAGE);
    /* Fault the huge pages in from this one thread: worker threads faulting concurrently
     * contend on the address-space lock (measured: erratic 0.4-5 ns/element with 2). */
    for (uintptr_t a = begin; a < end; a += huge) *(volatile char *)a = 0;
}

/* Contiguous float32 outputs. op: 0 uniform, 1 bernoulli(threshold), 2 dropout. */
int cr_fast_f32(int op, float *out, uint8_t *mask, const float *x, int64_t numel, uint64_t seed, uint64_t base,
                float low, float range, float high, uint64_t threshold, float scale, int nthreads) {
    prefer_huge_pages(out, (size_t)numel * sizeof(float));
    if (mask) prefer_huge_pages(mask, (size_t)numel);
    fjob_t ctx = {op, out, mask, x, seed, base, low, range, high, threshold, scale};
    return parallel_for(numel, nthreads, 1 << 16, fast_range, &ctx);
}

/* ---- normal: float32, any counter layout ---------------------------------------------
 *
 * The one implementation of float32 normals (eager and compiled both call it), so a
 * value never depends on tensor size, layout or compiler. log and sin/cos are the
 * Cephes single-precision algorithms written branch-free in plain C: the batch loop
 * vectorizes, and scalar and vector execution give the same bits (no -ffast-math, no
 * contraction).
 */
#define NB (4 * VB)

static inline float cr_logf(float x) {  /* x in (0, 1] */
    uint32_t ix;
    __builtin_memcpy(&ix, &x, 4);
    int e = (int)((ix >> 23) & 0xff) - 126;
    uint32_t mi = (ix & 0x7fffffu) | 0x3f000000u;  /* mantissa in [0.5, 1) */
    float m;
    __builtin_memcpy(&m, &mi, 4);
    int small = m < 0.707106781186547524f;
    e -= small;
    m = small ? m + m - 1.0f : m - 1.0f;
    float z = m * m;
    float y = 7.0376836292E-2f;
    y = y * m - 1.1514610310E-1f;
    y = y * m + 1.1676998740E-1f;
    y = y * m - 1.2420140846E-1f;
    y = y * m + 1.4249322787E-1f;
    y = y * m - 1.6668057665E-1f;
    y = y * m + 2.0000714765E-1f;
    y = y * m - 2.4999993993E-1f;
    y = y * m + 3.3333331174E-1f;
    y = y * m * z;
    float fe = (float)e;
    y = y + -2.12194440e-4f * fe;
    y = y + -0.5f * z;
    float r = m + y;
    return r + 0.693359375f * fe;
}

/* (cos a, sin a) for a in [0, 2*pi]: quadrant reduction by pi/2 in three parts. */
static inline void cr_sincosf(float a, float *c_out, float *s_out) {
    int q = (int)(a * 0.63661977236758134f + 0.5f);
    float fq = (float)q;
    float r = ((a - fq * 1.5703125f) - fq * 4.837512969970703125e-4f) - fq * 7.54978995489188216e-8f;
    float z = r * r;
    float s = r + r * z * ((-1.9515295891E-4f * z + 8.3321608736E-3f) * z - 1.6666654611E-1f);
    float c = 1.0f - 0.5f * z + z * z * ((2.443315711809948E-5f * z - 1.388731625493765E-3f) * z + 4.166664568298827E-2f);
    int k = q & 3;
    float sin_v = k == 0 ? s : k == 1 ? c : k == 2 ? -s : -c;
    float cos_v = k == 0 ? c : k == 1 ? -s : k == 2 ? -c : s;
    *c_out = cos_v;
    *s_out = sin_v;
}

/* Box-Muller of one word pair: radius and (cos, sin) of the angle. Element 2i of the
 * pair's lanes is radius * cos, element 2i + 1 is radius * sin. */
static inline void box_muller(uint32_t we, uint32_t wo, float *radius, float *c, float *s) {
    float u1 = (float)((uint64_t)we + 1u) * 0x1p-32f;
    float angle = ((float)wo * 0x1p-32f) * 6.2831854820251465f;
    *radius = __builtin_sqrtf(cr_logf(u1) * -2.0f);
    cr_sincosf(angle, c, s);
}

typedef struct {
    float *out;
    uint64_t seed, base;
    int ndim;
    const int64_t *size, *strides;
    float mean, std;
    const int64_t *counters; /* if set: element i has counter base + counters[i] */
} njob_t;

static void normal_range(const void *ctx, int64_t begin, int64_t end) {
    const njob_t *j = (const njob_t *)ctx;
    walk_t walk;
    walk_start(&walk, j->base, j->ndim, j->size, j->strides, begin);
    int contiguous = !j->counters;  /* counter = base + i: whole batches of blocks at once */
    for (int d = j->ndim - 1, expected = 1; d >= 0 && contiguous; d--) {
        if (j->size[d] != 1 && j->strides[d] != expected) contiguous = 0;
        expected *= (int)j->size[d];
    }
    uint64_t cached = ~(uint64_t)0;
    uint32_t w[4];
    uint32_t we[NB], wo[NB], lin[NB];
    int odd[NB];
    for (int64_t i0 = begin; i0 < end; i0 += NB) {
        int cnt = (int)(end - i0 < NB ? end - i0 : NB);
        if (contiguous && cnt == NB && (walk.n & 3) == 0) {
            /* whole pairs in order: one Box-Muller per pair gives both of its elements */
            philox_blocks(walk.n >> 2, (uint32_t)j->seed, (uint32_t)(j->seed >> 32), lin);
            float *o = j->out + i0;
            for (int p = 0; p < NB / 2; p++) {
                float radius, c, s;
                box_muller(lin[2 * p], lin[2 * p + 1], &radius, &c, &s);
                float zc = radius * c, zs = radius * s;
                o[2 * p] = zc * j->std + j->mean;
                o[2 * p + 1] = zs * j->std + j->mean;
            }
            walk.n += NB;  /* contiguous: the counter is all the walker needs */
            continue;
        }
        for (int k = 0; k < cnt; k++) {  /* words of each element (layout walk, block cache) */
            uint64_t n = j->counters ? j->base + (uint64_t)j->counters[i0 + k] : walk.n;
            uint64_t block = n >> 2;
            unsigned lane = (unsigned)(n & 3);
            if (block != cached) {
                w[0] = (uint32_t)block; w[1] = (uint32_t)(block >> 32); w[2] = 0; w[3] = 0;
                philox4x32_10(w, (uint32_t)j->seed, (uint32_t)(j->seed >> 32));
                cached = block;
            }
            unsigned p = lane >> 1;
            we[k] = w[2 * p];
            wo[k] = w[2 * p + 1];
            odd[k] = (int)(lane & 1);
            if (contiguous) walk.n += 1;
            else if (!j->counters) walk_next(&walk);
        }
        for (int k = 0; k < cnt; k++) {  /* Box-Muller per element (any lane), vectorizable */
            float radius, c, s;
            box_muller(we[k], wo[k], &radius, &c, &s);
            float z = radius * (odd[k] ? s : c);
            j->out[i0 + k] = z * j->std + j->mean;
        }
    }
}

int cr_normal_f32(float *out, int64_t numel, uint64_t seed, uint64_t base, int ndim, const int64_t *size,
                  const int64_t *strides, float mean, float std, int nthreads) {
    if (ndim > MAX_DIMS) return -1;
    prefer_huge_pages(out, (size_t)numel * sizeof(float));
    njob_t ctx = {out, seed, base, ndim, size, strides, mean, std, NULL};
    return parallel_for(numel, nthreads, 1 << 15, normal_range, &ctx);
}

/* float32 normals at the explicit counters base + counters[i] (a few scattered elements,
 * e.g. the redraws of a truncated normal), bitwise equal to cr_normal_f32 there. */
int cr_normal_f32_at(float *out, int64_t numel, uint64_t seed, uint64_t base, const int64_t *counters,
                     float mean, float std, int nthreads) {
    int64_t one = 1;
    njob_t ctx = {out, seed, base, 1, &numel, &one, mean, std, counters};
    return parallel_for(numel, nthreads, 1 << 15, normal_range, &ctx);
}
