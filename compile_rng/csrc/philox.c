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
 * Built at first use by compile_rng/cpu_kernel.py, once per instruction set, with
 * -ffp-contract=off and without -ffast-math, so float results do not depend on
 * vectorization or on the instruction set.
 */
#include <pthread.h>
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
 * generated VB at a time in structure-of-arrays form, vectorized across blocks. The float
 * transforms are the canonical ones (compile_rng/stream.py) with separate multiply and
 * add (built with -ffp-contract=off), so results are bitwise equal to the generic path,
 * to the Inductor lowering, and across the instruction-set builds below.
 *
 * One source, one build per instruction set (compile_rng/cpu_kernel.py picks the build
 * at run time). Every path runs the same Philox rounds and differs only in how many
 * blocks a vector holds (LANES), how many independent chains are interleaved per round
 * (NV: one chain is latency-bound; more than the registers hold spills) and which
 * instruction does the 32x32->64-bit multiply.
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#define CR_ISA "avx512"
#define LANES 8
#define NV 4  /* 16 state vectors + temporaries of the 32 zmm registers */
#elif defined(__AVX2__)
#include <immintrin.h>
#define CR_ISA "avx2"
#define LANES 4
#define NV 3  /* 12 state vectors + 2 multipliers + temporaries of the 16 ymm registers */
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define CR_ISA "neon"
#define CR_NEON 1
#define LANES 4
#define NV 4  /* 16 state vectors + temporaries of the 32 q registers */
#else
/* portable: SSE2's pmuludq on x86-64 (part of its baseline), plain C elsewhere */
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#define CR_ISA "baseline"
#define LANES 2
#define NV 3  /* 12 state vectors of the 16 xmm registers */
#endif

/* blocks per batch: whole rounds of all chains, at least 32 blocks so the emit loops
 * run long vectorized stretches */
#define CHAIN_BLOCKS (LANES * NV)
#define VB (CHAIN_BLOCKS * ((32 + CHAIN_BLOCKS - 1) / CHAIN_BLOCKS))

/* The instruction set this build was compiled for (checked by cpu_kernel.py). */
const char *cr_isa(void) { return CR_ISA; }

static const uint64_t BLOCK_MASK = (1ULL << 62) - 1;  /* block indices of counters mod 2**64 */

#ifdef CR_NEON
/* NEON: one 32-bit lane per block. vmull_u32 / vmull_high_u32 give the 64-bit products
 * of the low and high lane pairs; vuzp1/vuzp2 gather their low and high halves. vst4q
 * stores the four word vectors interleaved, which is element order. */
typedef uint32x4_t kv;

static inline kv splat(uint32_t k) { return vdupq_n_u32(k); }

static inline void mulhilo(uint32x4_t a, uint32_t m, uint32x4_t *hi, uint32x4_t *lo) {
    uint32x4_t p_low = vreinterpretq_u32_u64(vmull_u32(vget_low_u32(a), vdup_n_u32(m)));
    uint32x4_t p_high = vreinterpretq_u32_u64(vmull_high_u32(a, vdupq_n_u32(m)));
    *lo = vuzp1q_u32(p_low, p_high);
    *hi = vuzp2q_u32(p_low, p_high);
}
#else
/* x86 and plain C: one 64-bit lane per block, the word in its low half. The multiply
 * reads only the low halves (vpmuludq / pmuludq, or a mask in plain C), so the high
 * halves may carry garbage and the rounds need no masking: the high product is a shift,
 * the low product is the lane as is. */
typedef uint64_t uv __attribute__((vector_size(8 * LANES)));
typedef uv kv;
#if LANES == 8
#define INTERLEAVE_LO ((uv){0, 8, 1, 9, 2, 10, 3, 11})
#define INTERLEAVE_HI ((uv){4, 12, 5, 13, 6, 14, 7, 15})
#elif LANES == 4
#define INTERLEAVE_LO ((uv){0, 4, 1, 5})
#define INTERLEAVE_HI ((uv){2, 6, 3, 7})
#else
#define INTERLEAVE_LO ((uv){0, 2})
#define INTERLEAVE_HI ((uv){1, 3})
#endif

static inline kv splat(uint32_t k) { return (uv){0} + k; }

static inline uv mul32(uv a, uv m) {
#if defined(__AVX512F__)
    return (uv)_mm512_mul_epu32((__m512i)a, (__m512i)m);
#elif defined(__AVX2__)
    return (uv)_mm256_mul_epu32((__m256i)a, (__m256i)m);
#elif defined(__SSE2__)
    return (uv)_mm_mul_epu32((__m128i)a, (__m128i)m);
#else
    return (a & 0xFFFFFFFFu) * m;
#endif
}

/* Two words (low halves of lanes) -> one 64-bit lane holding both in memory order. */
static inline uv pack_pair(uv first, uv second) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return (first & 0xFFFFFFFFu) | (second << 32);
#else
    return (first << 32) | (second & 0xFFFFFFFFu);
#endif
}
#endif

/* The round keys of a seed as vectors, made once per range rather than once per round
 * of every batch (their broadcasts were a tenth of the AVX2 instructions). */
typedef struct { kv k0[10], k1[10]; } keys_t;

static void key_schedule(uint64_t seed, keys_t *ks) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++, k0 += 0x9E3779B9u, k1 += 0xBB67AE85u) {
        ks->k0[r] = splat(k0);
        ks->k1[r] = splat(k1);
    }
}

/* Blocks first .. first + CHAIN_BLOCKS - 1 (mod 2**62), NV interleaved chains, their
 * words written to lin in element order (block-major, lane-minor). */
static void philox_chains(uint64_t first, const keys_t *ks, uint32_t *lin) {
#ifdef CR_NEON
    uint32x4_t c0[NV], c1[NV], c2[NV], c3[NV];
    for (int v = 0; v < NV; v++) {
        uint32_t lo[LANES], hi[LANES];
        for (int l = 0; l < LANES; l++) {
            uint64_t b = (first + (uint64_t)(LANES * v + l)) & BLOCK_MASK;
            lo[l] = (uint32_t)b;
            hi[l] = (uint32_t)(b >> 32);
        }
        c0[v] = vld1q_u32(lo);
        c1[v] = vld1q_u32(hi);
        c2[v] = vdupq_n_u32(0);
        c3[v] = vdupq_n_u32(0);
    }
    for (int r = 0; r < 10; r++) {
        for (int v = 0; v < NV; v++) {
            uint32x4_t hi0, lo0, hi1, lo1;
            mulhilo(c0[v], 0xD2511F53u, &hi0, &lo0);
            mulhilo(c2[v], 0xCD9E8D57u, &hi1, &lo1);
            c0[v] = veorq_u32(veorq_u32(hi1, c1[v]), ks->k0[r]);
            c1[v] = lo1;
            c2[v] = veorq_u32(veorq_u32(hi0, c3[v]), ks->k1[r]);
            c3[v] = lo0;
        }
    }
    for (int v = 0; v < NV; v++) vst4q_u32(lin + 4 * LANES * v, (uint32x4x4_t){{c0[v], c1[v], c2[v], c3[v]}});
#else
    const uv m0 = splat(0xD2511F53u), m1 = splat(0xCD9E8D57u);
    uv iota;
    for (int l = 0; l < LANES; l++) iota[l] = (uint64_t)l;
    uv c0[NV], c1[NV], c2[NV], c3[NV];
    for (int v = 0; v < NV; v++) {
        uv b = (first + (uint64_t)(LANES * v) + iota) & BLOCK_MASK;
        c0[v] = b;  /* high half ignored by the multiply */
        c1[v] = b >> 32;
        c2[v] = (uv){0};
        c3[v] = (uv){0};
    }
    for (int r = 0; r < 10; r++) {
        for (int v = 0; v < NV; v++) {
            uv p0 = mul32(c0[v], m0);
            uv p1 = mul32(c2[v], m1);
            uv n0 = (p1 >> 32) ^ c1[v] ^ ks->k0[r];
            uv n2 = (p0 >> 32) ^ c3[v] ^ ks->k1[r];
            c0[v] = n0;
            c1[v] = p1;
            c2[v] = n2;
            c3[v] = p0;
        }
    }
    for (int v = 0; v < NV; v++) {
        /* lane l of w01 is (block l: word 0, word 1), of w23 (word 2, word 3): element
         * order is w01[0], w23[0], w01[1], w23[1], ... */
        uv w01 = pack_pair(c0[v], c1[v]), w23 = pack_pair(c2[v], c3[v]);
        uv out[2] = {__builtin_shuffle(w01, w23, INTERLEAVE_LO), __builtin_shuffle(w01, w23, INTERLEAVE_HI)};
        __builtin_memcpy(lin + 4 * LANES * v, out, sizeof(out));
    }
#endif
}

/* The words of blocks first .. first + VB - 1 (mod 2**62) in element order: 4 * VB values. */
static void philox_blocks(uint64_t first, const keys_t *ks, uint32_t *lin) {
    for (int g = 0; g < VB; g += CHAIN_BLOCKS) philox_chains(first + (uint64_t)g, ks, lin + 4 * g);
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
        float u = (float)(int32_t)(w >> 8) * 0x1p-24f;  /* < 2**24: signed converts in every ISA */
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
    keys_t ks;
    key_schedule(j->seed, &ks);
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
            philox_blocks(block, &ks, lin);
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
    /* quadrant q: sin = (s, c, -s, -c)[q & 3], cos = (c, -s, -c, s)[q & 3]; the signs as
     * bit flips, since a sign flip is what negation is (and cheaper than a select) */
    int odd = q & 1;
    uint32_t sin_sign = ((uint32_t)q & 2u) << 30, cos_sign = ((uint32_t)(q + 1) & 2u) << 30;
    float sin_v = odd ? c : s, cos_v = odd ? s : c;
    uint32_t sin_bits, cos_bits;
    __builtin_memcpy(&sin_bits, &sin_v, 4);
    __builtin_memcpy(&cos_bits, &cos_v, 4);
    sin_bits ^= sin_sign;
    cos_bits ^= cos_sign;
    __builtin_memcpy(s_out, &sin_bits, 4);
    __builtin_memcpy(c_out, &cos_bits, 4);
}

/* float(w + offset) for a word w and offset 0 or 1, rounded once: both 16-bit halves
 * (and the offset) convert exactly and the one addition rounds. Only signed 32-bit
 * integers convert to float in every vector instruction set (AVX2 has no unsigned or
 * 64-bit conversion), hence the halves. */
static inline float word_to_float(uint32_t w, float offset) {
    float high = (float)(int32_t)(w >> 16) * 65536.0f;
    float low = (float)(int32_t)(w & 0xFFFFu) + offset;
    return high + low;
}

/* Box-Muller of one word pair: radius and (cos, sin) of the angle. Element 2i of the
 * pair's lanes is radius * cos, element 2i + 1 is radius * sin. */
static inline void box_muller(uint32_t we, uint32_t wo, float *radius, float *c, float *s) {
    float u1 = word_to_float(we, 1.0f) * 0x1p-32f;
    float angle = (word_to_float(wo, 0.0f) * 0x1p-32f) * 6.2831854820251465f;
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
    keys_t ks;
    key_schedule(j->seed, &ks);
    int odd[NB];
    for (int64_t i0 = begin; i0 < end; i0 += NB) {
        int cnt = (int)(end - i0 < NB ? end - i0 : NB);
        if (contiguous && cnt == NB && (walk.n & 3) == 0) {
            /* whole pairs in order: one Box-Muller per pair gives both of its elements */
            philox_blocks(walk.n >> 2, &ks, lin);
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
