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
 * - cr_integers, cr_bernoulli_bits, cr_unit_uniform_bits, cr_open_unit_bits: integers, any
 *   float dtype's bernoulli and rand, the exponential's (0, 1] of a contiguous stream, one
 *   word per element.
 *
 * Built at first use by compile_rng/cpu_kernel.py, once per instruction set, with
 * -ffp-contract=off and without -ffast-math, so float results do not depend on
 * vectorization or on the instruction set.
 */
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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
 * (at least min_per_thread elements each). Returns 0, or -2 if a thread could not start
 * (then nothing was computed). Every kernel gives the same values however the range is
 * split.
 *
 * Built with OpenMP (cpu_kernel.py's default), the threads are OpenMP's: the process's one
 * libgomp, which torch's intra-op parallelism and Inductor's kernels use too, so its
 * workers are already running. Threads of our own would be created per call and, on a
 * machine with as many cores as threads, wait for cores that libgomp's workers keep
 * spinning on after every torch parallel region (measured, 2-core Zen 4, GPT training
 * step at 2 threads: 0.38-0.42 s/step with per-call pthreads, 0.32-0.33 with OpenMP).
 * pthreads are the fallback for compilers without it. */
typedef void (*range_fn)(const void *ctx, int64_t begin, int64_t end);
#ifndef _OPENMP
typedef struct { range_fn fn; const void *ctx; int64_t begin, end; } task_t;

static void *run_task(void *arg) {
    task_t *t = (task_t *)arg;
    t->fn(t->ctx, t->begin, t->end);
    return NULL;
}
#endif

static int parallel_for(int64_t numel, int nthreads, int64_t min_per_thread, range_fn fn, const void *ctx) {
    if (numel / min_per_thread < nthreads) nthreads = (int)(numel / min_per_thread);
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if (nthreads == 1) {
        fn(ctx, 0, numel);
        return 0;
    }
#ifdef _OPENMP
    /* Several parts per thread, handed out as threads come free: a thread that loses its
     * core for a while (a shared machine, a busy sibling) takes fewer parts instead of
     * holding everyone up at the join. Each part is at least a few microseconds of work. */
    int64_t parts = numel / (min_per_thread / 4) < 8 * nthreads ? numel / (min_per_thread / 4) : 8 * nthreads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t part = 0; part < parts; part++) fn(ctx, numel * part / parts, numel * (part + 1) / parts);
    return 0;
#else
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
    run_task(&tasks[0]);  /* the calling thread takes the first part */
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);
    return 0;
#endif
}

/* The words of counter n's Philox block, computed once per block: consecutive counters of a
 * walk mostly share one. */
typedef struct {
    uint64_t block;  /* ~0 before the first: never a block index (< 2**62) */
    uint32_t w[4];
} block_cache_t;

static inline const uint32_t *block_words(block_cache_t *cache, uint64_t seed, uint32_t c2, uint64_t n) {
    uint64_t block = n >> 2;
    if (block != cache->block) {
        cache->w[0] = (uint32_t)block; cache->w[1] = (uint32_t)(block >> 32); cache->w[2] = c2; cache->w[3] = 0;
        philox4x32_10(cache->w, (uint32_t)seed, (uint32_t)(seed >> 32));
        cache->block = block;
    }
    return cache->w;
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
    block_cache_t cache = {~(uint64_t)0, {0}};
    for (int64_t i = begin; i < end; i++, walk_next(&walk)) {
        const uint32_t *w = block_words(&cache, j->seed, j->c2, walk.n);
        unsigned lane = (unsigned)(walk.n & 3);
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

/* One word per element of a contiguous stream (counter = base + i), mapped, stored
 * elem_bytes wide:
 * - integers in [low, low + span), span <= 2**32: low + W mod span (canonical stream v1,
 *   section 5) as two's complement (the caller checked that every value fits the dtype);
 * - bernoulli: `one` (a float dtype's 1.0, as bits) where W < threshold, else 0 (its 0.0);
 * - unit uniform: (W >> (32 - bits)) * 2**-bits, rand's [0, 1) in a float dtype of `bits`
 *   bits (section 5's uniform with low 0 and high 1: exact in the dtype), as its bits;
 * - open unit: float32 or float64 (W + 1) * 2**-32 in (0, 1] (W + 1 rounded to nearest
 *   in float32), the exponential's argument of log. */
enum { MAP_INTEGERS, MAP_BERNOULLI, MAP_UNIT_UNIFORM, MAP_OPEN_UNIT };

typedef struct {
    void *out;
    int elem_bytes, map;
    uint64_t seed, base;
    uint64_t a, b;  /* integers: low, span; bernoulli: one, threshold; unit uniform: bits, - */
} word_values_t;

/* k * 2**-bits (k < 2**bits: exact) as the bits of the float format of `width` bytes and
 * `bits` bits: bfloat16 (2, 8), float16 (2, 11), float32 (4, 24), float64 (8, 32). */
static inline uint64_t unit_float_bits(uint64_t k, int width, int bits) {
    if (width == 8) {
        double d = (double)k / 4294967296.0;
        uint64_t x;
        __builtin_memcpy(&x, &d, sizeof x);
        return x;
    }
    float f = (float)k / (float)(1u << bits);
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    if (width == 4) return x;
    if (bits == 8) return x >> 16;  /* bfloat16: float32's top half, exact here */
    /* float16: exact and normal here (k >= 1 gives at least 2**-11 > 2**-14): rebias */
    return k == 0 ? 0 : (((x >> 23) - 112) << 10) | ((x >> 13) & 0x3FF);
}

static inline uint64_t open_unit_bits(uint64_t w, int width) {
    if (width == 8) {
        double d = (double)(int64_t)(w + 1) * (1.0 / 4294967296.0);  /* exact */
        uint64_t x;
        __builtin_memcpy(&x, &d, sizeof x);
        return x;
    }
    float f = (float)(int64_t)(w + 1) * (1.0f / 4294967296.0f);  /* rounded once, then exact */
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    return x;
}

static void word_values_range(const void *ctx, int64_t begin, int64_t end) {
    const word_values_t *j = (const word_values_t *)ctx;
    block_cache_t cache = {~(uint64_t)0, {0}};
    for (int64_t i = begin; i < end; i++) {
        uint64_t n = j->base + (uint64_t)i;
        uint64_t w = block_words(&cache, j->seed, 0, n)[n & 3], v;
        if (j->map == MAP_INTEGERS) {
            v = j->a + w % j->b;  /* mod 2**64 */
        } else if (j->map == MAP_BERNOULLI) {
            v = w < j->b ? j->a : 0;
        } else if (j->map == MAP_UNIT_UNIFORM) {
            v = unit_float_bits(w >> (32 - j->a), j->elem_bytes, (int)j->a);
        } else {
            v = open_unit_bits(w, j->elem_bytes);
        }
        switch (j->elem_bytes) {
            case 8: ((uint64_t *)j->out)[i] = v; break;
            case 4: ((uint32_t *)j->out)[i] = (uint32_t)v; break;
            case 2: ((uint16_t *)j->out)[i] = (uint16_t)v; break;
            default: ((uint8_t *)j->out)[i] = (uint8_t)v; break;
        }
    }
}

static int word_values(word_values_t *ctx, int64_t numel, int nthreads) {
    int width = ctx->elem_bytes;
    if (width != 1 && width != 2 && width != 4 && width != 8) return -1;
    return parallel_for(numel, nthreads, 1 << 16, word_values_range, ctx);
}

/* Returns 0 on success, -1 for a span or element width it does not take, -2 if a thread
 * could not start. */
int cr_integers(void *out, int elem_bytes, int64_t numel, uint64_t seed, uint64_t base, uint64_t low,
                uint64_t span, int nthreads) {
    if (span == 0 || span > (1ULL << 32)) return -1;
    word_values_t ctx = {out, elem_bytes, MAP_INTEGERS, seed, base, low, span};
    return word_values(&ctx, numel, nthreads);
}

/* bernoulli(p) in any float dtype: threshold = threshold32(p) (<= 2**32), `one` the dtype's
 * 1.0 as elem_bytes-wide bits. Returns as cr_integers. */
int cr_bernoulli_bits(void *out, int elem_bytes, int64_t numel, uint64_t seed, uint64_t base, uint64_t one,
                      uint64_t threshold, int nthreads) {
    word_values_t ctx = {out, elem_bytes, MAP_BERNOULLI, seed, base, one, threshold};
    return word_values(&ctx, numel, nthreads);
}

/* rand's [0, 1) in the float dtype of elem_bytes and `bits` (see unit_float_bits); `unused`
 * keeps the other word kernels' signature. Returns as cr_integers (-1: a format it lacks). */
int cr_unit_uniform_bits(void *out, int elem_bytes, int64_t numel, uint64_t seed, uint64_t base, uint64_t bits,
                         uint64_t unused, int nthreads) {
    (void)unused;
    int known = (elem_bytes == 2 && (bits == 8 || bits == 11)) || (elem_bytes == 4 && bits == 24) ||
                (elem_bytes == 8 && bits == 32);
    if (!known) return -1;
    word_values_t ctx = {out, elem_bytes, MAP_UNIT_UNIFORM, seed, base, bits, 0};
    return word_values(&ctx, numel, nthreads);
}

/* the exponential's (0, 1] in float32 (elem_bytes 4) or float64 (8), see open_unit_bits; `a`
 * and `b` unused. Returns as cr_integers. */
int cr_open_unit_bits(void *out, int elem_bytes, int64_t numel, uint64_t seed, uint64_t base, uint64_t a,
                      uint64_t b, int nthreads) {
    (void)a, (void)b;
    if (elem_bytes != 4 && elem_bytes != 8) return -1;
    word_values_t ctx = {out, elem_bytes, MAP_OPEN_UNIT, seed, base, 0, 0};
    return word_values(&ctx, numel, nthreads);
}

/* ---- Fast paths: contiguous streams (counter = base + i), final float32 values ---------
 *
 * Philox runs on blocks in structure-of-arrays form, LANES blocks per vector, NV
 * independent chains interleaved per round (one chain is latency-bound: a round is a
 * 3-cycle multiply, a shift and an xor in sequence; more chains than the registers hold
 * spill). Each chain's four word vectors then go straight from registers to the float
 * transforms and the stores (no word buffer in memory: its unaligned reloads stalled on
 * store forwarding and cost as much as the rounds).
 *
 * One source, one build per instruction set (compile_rng/cpu_kernel.py picks the build at
 * run time). The float work uses GCC vector types of WL 32-bit lanes, one register of the
 * instruction set; every operation on them is an IEEE operation on each lane (built with
 * -ffp-contract=off, no -ffast-math), so each build and each path (vector or per-element)
 * gives the same bits, and uniform/bernoulli/dropout equal the generic path and the
 * Inductor lowering. Intrinsics only where GCC's generic lowering is poor (blendv, the
 * keep-mask narrowing, the 32x32->64 multiply, sqrt).
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
#define NV 3  /* 12 state vectors + temporaries of the 16 ymm registers (multipliers and keys from memory) */
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

/* 32-bit lanes of a float vector: one register. x86 keeps a block per 64-bit lane, so a
 * chain's words fill two such vectors; NEON keeps a block per 32-bit lane (four words of
 * four blocks: four vectors). GCC splits wider generic vectors on NEON badly (lane by lane
 * conversions), hence no wider ones there. */
#ifdef CR_NEON
#define WL 4
#else
#define WL (2 * LANES)
#endif
#define PAIR (2 * WL)               /* elements of one (e, o) pair of word vectors */
#define GROUP (NV * 4 * LANES)      /* elements of one batch of interleaved chains */
#define NPAIRS (GROUP / PAIR)       /* word-vector pairs of a batch */

/* The instruction set this build was compiled for (checked by cpu_kernel.py). */
const char *cr_isa(void) { return CR_ISA; }

static const uint64_t BLOCK_MASK = (1ULL << 62) - 1;  /* block indices of counters mod 2**64 */

typedef uint32_t vu __attribute__((vector_size(4 * WL)));
typedef int32_t vi __attribute__((vector_size(4 * WL)));
typedef float vf __attribute__((vector_size(4 * WL)));
typedef uint8_t vb __attribute__((vector_size(WL)));

/* Lane-index vectors for __builtin_shuffle. UNPACK_LO/HI interleave two vectors within
 * each 128-bit part (one unpck instruction on x86, one zip on NEON); crossing the parts
 * would cost a permute more, so the blocks are placed in the lanes to make these two
 * interleaves give element order directly (see block_of_lane). */
#if WL == 16
#define UNPACK_LO ((vi){0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29})
#define UNPACK_HI ((vi){2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31})
#define EVEN_PAIRS(L) ((vi){L, 16 + L, 2 + L, 18 + L, 4 + L, 20 + L, 6 + L, 22 + L, 8 + L, 24 + L, 10 + L, 26 + L, \
                            12 + L, 28 + L, 14 + L, 30 + L})
#elif WL == 8
#define UNPACK_LO ((vi){0, 8, 1, 9, 4, 12, 5, 13})
#define UNPACK_HI ((vi){2, 10, 3, 11, 6, 14, 7, 15})
#define EVEN_PAIRS(L) ((vi){L, 8 + L, 2 + L, 10 + L, 4 + L, 12 + L, 6 + L, 14 + L})
#else
#define UNPACK_LO ((vi){0, 4, 1, 5})
#define UNPACK_HI ((vi){2, 6, 3, 7})
#define EVEN_PAIRS(L) ((vi){L, 4 + L, 2 + L, 6 + L})
#endif

/* The block (relative to the chain's first) that lane l computes. On x86 a chain's words
 * e and o hold lane l's pairs at 32-bit lanes 2l and 2l + 1, so 128-bit part k holds lanes
 * 2k and 2k + 1; UNPACK_LO takes lane 2k from every part and UNPACK_HI lane 2k + 1. With
 * lane 2k computing block k and lane 2k + 1 block LANES/2 + k, those are blocks 0 ..
 * LANES/2 - 1 and then the rest, in order: element order with no permute across parts.
 * (NEON: each word vector is one 128-bit part already.) */
static inline int block_of_lane(int l) {
#ifdef CR_NEON
    return l;
#else
    return (l >> 1) + (l & 1) * (LANES / 2);
#endif
}

static inline vf v_sqrt(vf x) {
#if defined(__AVX512F__)
    return (vf)_mm512_sqrt_ps((__m512)x);
#elif defined(__AVX2__)
    return (vf)_mm256_sqrt_ps((__m256)x);
#elif defined(CR_NEON)
    return (vf)vsqrtq_f32((float32x4_t)x);
#elif defined(__SSE2__)
    return (vf)_mm_sqrt_ps((__m128)x);
#else
    vf r;
    for (int l = 0; l < WL; l++) r[l] = __builtin_sqrtf(x[l]);
    return r;
#endif
}

/* m ? a : b for lane masks m of all ones or zeros. */
static inline vf v_select(vi m, vf a, vf b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    return (vf)_mm256_blendv_ps((__m256)b, (__m256)a, (__m256)m);  /* one instruction, not and/andnot/or */
#else
    return (vf)(((vi)a & m) | ((vi)b & ~m));
#endif
}

/* The same where only the sign bit of each lane of m says (blendv reads nothing else). */
static inline vf v_select_sign(vi m, vf a, vf b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    return v_select(m, a, b);
#else
    return v_select(m >> 31, a, b);
#endif
}

static inline void store_f(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* Unsigned w < t per lane. */
static inline vi below_v(vu w, uint32_t t) {
#if defined(__AVX512F__) || defined(CR_NEON) || !defined(__SSE2__)
    return (vi)(w < t);  /* native unsigned compares */
#else
    /* SSE2/AVX2 compare signed only: flip the sign bits (two instructions, where GCC's
     * unsigned lowering takes three) */
    return (vi)(w ^ 0x80000000u) < (vi)(vu){0} + (int32_t)(t ^ 0x80000000u);
#endif
}

/* The keep bytes (0 or 1) of 2 * WL elements, from their lane masks k0, k1 (all ones or
 * zero), stored at p. GCC's generic narrowing extracts every lane to a general register
 * on x86; the packs do eight or sixteen lanes per instruction. */
static inline void store_mask(uint8_t *p, vi k0, vi k1) {
#if defined(__AVX2__) && !defined(__AVX512F__)
    /* per 128-bit part: packs give k0's, then k1's lanes of that part; the dword
     * permute puts the parts' groups of four in element order */
    __m256i w = _mm256_packs_epi32((__m256i)k0, (__m256i)k1);
    __m256i b = _mm256_packs_epi16(w, w);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
    _mm_storeu_si128((__m128i *)p, _mm_and_si128(_mm256_castsi256_si128(b), _mm_set1_epi8(1)));
#elif defined(__SSE2__) && !defined(__AVX512F__)
    __m128i w = _mm_packs_epi32((__m128i)k0, (__m128i)k1);
    _mm_storel_epi64((__m128i *)p, _mm_and_si128(_mm_packs_epi16(w, w), _mm_set1_epi8(1)));
#else
    vb b0 = __builtin_convertvector(k0 & 1, vb), b1 = __builtin_convertvector(k1 & 1, vb);
    __builtin_memcpy(p, &b0, sizeof b0);
    __builtin_memcpy(p + WL, &b1, sizeof b1);
#endif
}

#ifdef CR_NEON
/* NEON: one 32-bit lane per block. vmull_u32 / vmull_high_u32 give the 64-bit products
 * of the low and high lane pairs; vuzp1/vuzp2 gather their low and high halves. */
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
#endif

/* The round keys of a seed as vectors, made once per range rather than once per round
 * of every batch. The multipliers ride along so the rounds read them from memory too
 * (a memory operand costs no register; AVX2 has only 16). */
typedef struct { kv k0[10], k1[10], m0, m1; } keys_t;

static void key_schedule(uint64_t seed, keys_t *ks) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++, k0 += 0x9E3779B9u, k1 += 0xBB67AE85u) {
        ks->k0[r] = splat(k0);
        ks->k1[r] = splat(k1);
    }
    ks->m0 = splat(0xD2511F53u);
    ks->m1 = splat(0xCD9E8D57u);
}

/* The words of WL / 2 blocks as two vectors, e holding words (0, 2) and o words (1, 3) of
 * each block: e[2b + p] = W[2p], o[2b + p] = W[2p + 1] (b: the block's place in the pair).
 * Box-Muller pair p of the block is (e, o) at lane 2b + p, and UNPACK_LO/HI of (e, o) are
 * the PAIR elements of these blocks in order. */
typedef struct { vu e, o; } words_t2;

/* Blocks first .. first + NV * LANES - 1 (mod 2**62), NV interleaved chains, as NPAIRS
 * word-vector pairs in element order. */
static inline __attribute__((always_inline)) void philox_group(uint64_t first, const keys_t *ks, words_t2 *w) {
#ifdef CR_NEON
    uint32x4_t c0[NV], c1[NV], c2[NV], c3[NV];
    for (int v = 0; v < NV; v++) {
        uint32_t lo[LANES], hi[LANES];
        for (int l = 0; l < LANES; l++) {
            uint64_t b = (first + (uint64_t)(LANES * v + block_of_lane(l))) & BLOCK_MASK;
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
            c0[v] = veorq_u32(hi1, veorq_u32(c1[v], ks->k0[r]));
            c1[v] = lo1;
            c2[v] = veorq_u32(hi0, veorq_u32(c3[v], ks->k1[r]));
            c3[v] = lo0;
        }
    }
    for (int v = 0; v < NV; v++) {  /* blocks 0, 1 of the chain, then 2, 3 */
        w[2 * v] = (words_t2){(vu)vzip1q_u32(c0[v], c2[v]), (vu)vzip1q_u32(c1[v], c3[v])};
        w[2 * v + 1] = (words_t2){(vu)vzip2q_u32(c0[v], c2[v]), (vu)vzip2q_u32(c1[v], c3[v])};
    }
#else
    uv iota;
    for (int l = 0; l < LANES; l++) iota[l] = (uint64_t)block_of_lane(l);
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
            uv p0 = mul32(c0[v], ks->m0);
            uv p1 = mul32(c2[v], ks->m1);
            /* the key first: c ^ k does not wait for the multiply, the shifted product
             * then needs one xor (the round's critical path is multiply, shift, xor) */
            uv n0 = (p1 >> 32) ^ (c1[v] ^ ks->k0[r]);
            uv n2 = (p0 >> 32) ^ (c3[v] ^ ks->k1[r]);
            c0[v] = n0;
            c1[v] = p1;
            c2[v] = n2;
            c3[v] = p0;
        }
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define LOW_HALF 0
#else
#define LOW_HALF 1
#endif
    for (int v = 0; v < NV; v++) {  /* the low halves of the 64-bit lanes, paired */
        w[v].e = __builtin_shuffle((vu)c0[v], (vu)c2[v], EVEN_PAIRS(LOW_HALF));
        w[v].o = __builtin_shuffle((vu)c1[v], (vu)c3[v], EVEN_PAIRS(LOW_HALF));
    }
#endif
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

/* Scalar transforms: the heads and tails of a range (less than a block group). */
static inline void emit(const fjob_t *j, int64_t i, uint32_t w) {
    switch (j->op) {
    case OP_UNIFORM: {
        float u = (float)(int32_t)(w >> 8) * 0x1p-24f;  /* < 2**24: signed converts in every ISA */
        float v = u * j->range;
        v = v + j->low;
        j->out[i] = (v >= j->high_f) ? j->low : v;  /* high_f == high exactly (caller checks) */
        break;
    }
    case OP_BERNOULLI:
        j->out[i] = below(w, j->threshold) ? 1.0f : 0.0f;
        break;
    default: {
        int keep = below(w, j->threshold);
        float kept = j->x[i] * (keep ? 1.0f : 0.0f);
        j->out[i] = kept * j->scale;
        j->mask[i] = (uint8_t)keep;
    }
    }
}

/* The same transforms on WL consecutive elements (words w in element order); returns
 * the keep lanes (bernoulli, dropout). `unit`: uniform on [0, 1), where u * 1 + 0 is u and
 * u < 1 always, so the range arithmetic is skipped without changing a bit. */
static inline __attribute__((always_inline)) vi emit_vec(const fjob_t *j, int64_t i, vu w, const int op,
                                                        const int unit) {
    if (op == OP_UNIFORM) {
        vf u = __builtin_convertvector((vi)(w >> 8), vf) * 0x1p-24f;
        if (!unit) {
            vf v = u * j->range;
            v = v + j->low;
            u = v_select(v >= j->high_f, (vf){0} + j->low, v);
        }
        store_f(j->out + i, u);
        return (vi){0};
    }
    const int32_t all = j->threshold > 0xFFFFFFFFu ? -1 : 0;  /* threshold 2**32: every word is below */
    vi keep = below_v(w, (uint32_t)j->threshold) | all;
    vf keep_f = (vf)(keep & (vi)((vf){0} + 1.0f));  /* 1.0f or 0.0f */
    if (op == OP_BERNOULLI) {
        store_f(j->out + i, keep_f);
        return keep;
    }
    vf x;
    __builtin_memcpy(&x, j->x + i, sizeof x);
    vf kept = x * keep_f;  /* a multiply, not a mask: -0, inf and NaN inputs as the scalar path */
    store_f(j->out + i, kept * j->scale);
    return keep;
}

/* One op per instantiation (op and unit are constants after inlining). */
static inline __attribute__((always_inline)) void fast_range_op(const fjob_t *ctx, int64_t i, int64_t end,
                                                                 const int op, const int unit) {
    /* a local copy: the caller's job could alias the output as far as the compiler
     * knows, and every store would reload the parameters */
    const fjob_t job = *ctx, *j = &job;
    uint32_t k0 = (uint32_t)j->seed, k1 = (uint32_t)(j->seed >> 32);
    keys_t ks;
    key_schedule(j->seed, &ks);
    /* head: up to the next block boundary; body: GROUP elements at a time; tail: the rest */
    while (i < end) {
        uint64_t n = j->base + (uint64_t)i;
        uint64_t block = n >> 2;
        unsigned lane = (unsigned)(n & 3);
        if (lane == 0 && end - i >= GROUP) {
            words_t2 w[NPAIRS];
            philox_group(block, &ks, w);
            for (int v = 0; v < NPAIRS; v++) {
                vi keep_lo = emit_vec(j, i + PAIR * v, __builtin_shuffle(w[v].e, w[v].o, UNPACK_LO), op, unit);
                vi keep_hi = emit_vec(j, i + PAIR * v + WL, __builtin_shuffle(w[v].e, w[v].o, UNPACK_HI), op, unit);
                if (op == OP_DROPOUT) store_mask(j->mask + i + PAIR * v, keep_lo, keep_hi);
            }
            i += GROUP;
            continue;
        }
        uint32_t c[4] = {(uint32_t)block, (uint32_t)(block >> 32), 0, 0};
        philox4x32_10(c, k0, k1);
        for (; lane < 4 && i < end; lane++, i++) emit(j, i, c[lane]);
    }
}

static void fast_range(const void *ctx, int64_t begin, int64_t end) {
    const fjob_t *j = (const fjob_t *)ctx;
    switch (j->op) {
    case OP_UNIFORM:
        if (j->low == 0.0f && j->range == 1.0f && j->high_f == 1.0f) fast_range_op(j, begin, end, OP_UNIFORM, 1);
        else fast_range_op(j, begin, end, OP_UNIFORM, 0);
        break;
    case OP_BERNOULLI: fast_range_op(j, begin, end, OP_BERNOULLI, 0); break;
    default: fast_range_op(j, begin, end, OP_DROPOUT, 0); break;
    }
}

/* Fresh output buffers are not yet backed by memory; faulting them in 4 KiB pages costs
 * several times the generation itself. Ask for transparent huge pages on the aligned
 * interior before the first write (advisory: a no-op where THP is unavailable). The
 * workers then fault their own parts in as they write them, in parallel: the kernel's
 * zeroing of a huge page is most of a fresh output's cost (64 MiB uniform, AVX2, Linux
 * 6.18: 0.50 ns/element into warm memory, 0.83 fresh; with 2 threads 0.25 warm, 0.45
 * fresh, where faulting everything first from the calling thread gave 0.57). */
static void prefer_huge_pages(void *p, size_t bytes) {
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1), end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > begin) madvise((void *)begin, end - begin, MADV_HUGEPAGE);
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
 * Cephes single-precision algorithms written branch-free on vectors; contiguous streams
 * and any other layout go through the same vector code (the latter after gathering each
 * element's word pair), so the bits never depend on the path.
 */

/* RN(w + offset) for offset 0 or 1: both 16-bit halves (and the offset) convert exactly
 * and the one addition rounds. Only signed 32-bit integers convert to float in every
 * vector instruction set (AVX2 has no unsigned conversion), hence the halves. */
static inline vf word_to_float(vu w, const int offset) {
    vf high = __builtin_convertvector((vi)(w >> 16), vf) * 65536.0f;
    vf low = __builtin_convertvector((vi)(w & 0xFFFFu), vf);
    if (offset) low = low + 1.0f;  /* (adding +0.0f to a non-negative value changes nothing) */
    return high + low;
}

/* Box-Muller runs on K vectors of word pairs side by side: one vector's steps are a long
 * dependent chain (Horner polynomials, a square root) that leaves the pipelines idle
 * waiting on latencies, so every step below runs over all K vectors before the next. */
#define EACH(K) for (int k = 0; k < (K); k++)
/* Vectors side by side. Measured on AVX2 (Zen 4): 3 -> 1.29, 4 -> 1.25, 6 -> 1.31, 8 -> 1.35
 * ns/element (beyond 4 the 16 registers spill; the Horner steps stay latency-bound);
 * AVX-512 and SSE2 also best at 4. */
#define BMK 4

/* Box-Muller of K vectors of word pairs (we, wo): radius and (cos, sin) of the angle; a
 * pair's even element is radius * cos, its odd element radius * sin.
 *
 * The radius is sqrt(-2 ln u1) with the Cephes logf of u1 = RN(we + 1) * 2**-32: that
 * scaling by a power of two is exact and only moves the exponent, so it is taken out of
 * the exponent instead of multiplied in. The angle is (wo * 2**-32) * 2pi rounded once:
 * the scaling is exact, so one multiply by the scaled constant (also exact) rounds the
 * same product. (cos, sin) is the Cephes sincosf: a quadrant reduction by pi/2 in three
 * parts and two polynomials. The log's and the sincos' steps alternate, so each step has
 * 2K independent operations in flight. */
static inline __attribute__((always_inline)) void box_muller(const vu *we, const vu *wo, vf *radius, vf *c_out,
                                                            vf *s_out, const int K) {
    vf m[BMK], z[BMK], y[BMK], fe[BMK];      /* log */
    vi q[BMK];                                /* sincos */
    vf r[BMK], rz[BMK], s[BMK], c[BMK];
    EACH(K) {
        vu ix = (vu)word_to_float(we[k], 1);
        vi e = (vi)(ix >> 23) - (126 + 32);  /* positive: no sign bit above the exponent */
        m[k] = (vf)((ix & 0x7fffffu) | 0x3f000000u);  /* mantissa in [0.5, 1) */
        vi small = m[k] < 0.707106781186547524f;  /* all ones where true */
        fe[k] = __builtin_convertvector(e + small, vf);
        m[k] = v_select(small, m[k] + m[k], m[k]) - 1.0f;
        vf angle = word_to_float(wo[k], 0) * (6.2831854820251465f * 0x1p-32f);
        q[k] = __builtin_convertvector(angle * 0.63661977236758134f + 0.5f, vi);  /* truncation, as (int) */
        vf fq = __builtin_convertvector(q[k], vf);
        r[k] = ((angle - fq * 1.5703125f) - fq * 4.837512969970703125e-4f) - fq * 7.54978995489188216e-8f;
    }
    EACH(K) {
        z[k] = m[k] * m[k];
        y[k] = 7.0376836292E-2f * m[k] - 1.1514610310E-1f;
        rz[k] = r[k] * r[k];
    }
    EACH(K) {
        y[k] = y[k] * m[k] + 1.1676998740E-1f;
        s[k] = -1.9515295891E-4f * rz[k] + 8.3321608736E-3f;
    }
    EACH(K) {
        y[k] = y[k] * m[k] - 1.2420140846E-1f;
        c[k] = 2.443315711809948E-5f * rz[k] - 1.388731625493765E-3f;
    }
    EACH(K) {
        y[k] = y[k] * m[k] + 1.4249322787E-1f;
        s[k] = s[k] * rz[k] - 1.6666654611E-1f;
    }
    EACH(K) {
        y[k] = y[k] * m[k] - 1.6668057665E-1f;
        c[k] = c[k] * rz[k] + 4.166664568298827E-2f;
    }
    EACH(K) {
        y[k] = y[k] * m[k] + 2.0000714765E-1f;
        s[k] = r[k] + r[k] * rz[k] * s[k];
    }
    EACH(K) {
        y[k] = y[k] * m[k] - 2.4999993993E-1f;
        c[k] = 1.0f - 0.5f * rz[k] + rz[k] * rz[k] * c[k];
    }
    /* quadrant q: sin = (s, c, -s, -c)[q & 3], cos = (c, -s, -c, s)[q & 3]; the signs as
     * bit flips, since a sign flip is what negation is (and cheaper than a select): sin's
     * is bit 1 of q, cos's that xor bit 0 (q & 3 = 0, 1, 2, 3 -> cos + - - +) */
    EACH(K) {
        y[k] = y[k] * m[k] + 3.3333331174E-1f;
        vu odd = (vu)q[k] << 31, sin_sign = ((vu)q[k] << 30) & 0x80000000u;
        s_out[k] = (vf)((vu)v_select_sign((vi)odd, c[k], s[k]) ^ sin_sign);
        c_out[k] = (vf)((vu)v_select_sign((vi)odd, s[k], c[k]) ^ (sin_sign ^ odd));
    }
    EACH(K) y[k] = y[k] * m[k] * z[k];
    EACH(K) y[k] = y[k] + -2.12194440e-4f * fe[k];
    EACH(K) y[k] = y[k] + -0.5f * z[k];
    EACH(K) radius[k] = v_sqrt(((m[k] + y[k]) + 0.693359375f * fe[k]) * -2.0f);
}

typedef struct {
    float *out;
    uint64_t seed, base;
    int ndim;
    const int64_t *size, *strides;
    float mean, std;
    const int64_t *counters; /* if set: element i has counter base + counters[i] */
} njob_t;

/* Elements per step of the per-element path (word pairs buffered): a whole number of
 * Box-Muller steps, which may read a whole step's vectors past a batch's end. */
#define NB (4 * GROUP)
_Static_assert(NB / WL % BMK == 0, "the word buffers hold whole Box-Muller steps");

/* z * std + mean, as the scalar definition rounds it; z * 1 is z, so std == 1 skips it. */
static inline vf affine(vf z, vf std, vf mean, const int unit_std) { return (unit_std ? z : z * std) + mean; }

/* One instantiation per unit_std (a constant after inlining). */
static inline __attribute__((always_inline)) void normal_range_op(const njob_t *j, int64_t begin, int64_t end,
                                                                   const int unit_std) {
    walk_t walk;
    walk_start(&walk, j->base, j->ndim, j->size, j->strides, begin);
    int contiguous = !j->counters;  /* counter = base + i: whole batches of blocks at once */
    for (int d = j->ndim - 1, expected = 1; d >= 0 && contiguous; d--) {
        if (j->size[d] != 1 && j->strides[d] != expected) contiguous = 0;
        expected *= (int)j->size[d];
    }
    keys_t ks;
    key_schedule(j->seed, &ks);
    const vf mean = (vf){0} + j->mean, std = (vf){0} + j->std;
    uint64_t cached = ~(uint64_t)0;
    uint32_t w[4];
    /* word pairs of NB elements (per-element path) or of 2 * NB (contiguous: a pair
     * gives two elements); vectors past a batch's end hold stale words, never stored */
    vu we[NB / WL] = {{0}}, wo[NB / WL] = {{0}};
    vi odd[NB / WL] = {{0}};
    for (int64_t i = begin; i < end;) {
        if (contiguous && (walk.n & 3) == 0 && end - i >= GROUP) {
            /* whole blocks in order: Philox for up to NB / WL word-vector pairs first,
             * then Box-Muller over them; lane l of pair q gives elements PAIR * q + 2l
             * (cos) and + 2l + 1 (sin) after the unpacks */
            int64_t groups = (end - i) / GROUP < NB / WL / NPAIRS ? (end - i) / GROUP : NB / WL / NPAIRS;
            for (int64_t g = 0; g < groups; g++) {
                words_t2 b[NPAIRS];
                philox_group((walk.n >> 2) + (uint64_t)(g * NV * LANES), &ks, b);
                EACH(NPAIRS) {
                    we[g * NPAIRS + k] = b[k].e;
                    wo[g * NPAIRS + k] = b[k].o;
                }
            }
            for (int64_t q = 0; q < groups * NPAIRS; q += BMK) {
                vf radius[BMK], c[BMK], s[BMK];
                box_muller(we + q, wo + q, radius, c, s, BMK);
                EACH(BMK) {
                    if (q + k >= groups * NPAIRS) break;
                    vf zc = affine(radius[k] * c[k], std, mean, unit_std);
                    vf zs = affine(radius[k] * s[k], std, mean, unit_std);
                    float *o = j->out + i + PAIR * (q + k);
                    store_f(o, __builtin_shuffle(zc, zs, UNPACK_LO));
                    store_f(o + WL, __builtin_shuffle(zc, zs, UNPACK_HI));
                }
            }
            i += groups * GROUP;
            walk.n += (uint64_t)(groups * GROUP);  /* contiguous: the counter is all the walker needs */
            continue;
        }
        /* any other layout, or a contiguous stream's head (to a block boundary) and tail:
         * each element's word pair (layout walk, block cache), then the same vector code */
        int64_t cnt = end - i < NB ? end - i : NB;
        if (contiguous && (walk.n & 3)) cnt = cnt < (int64_t)(4 - (walk.n & 3)) ? cnt : (int64_t)(4 - (walk.n & 3));
        uint32_t *we_k = (uint32_t *)we, *wo_k = (uint32_t *)wo;
        int32_t *odd_k = (int32_t *)odd;
        for (int k = 0; k < cnt; k++) {
            uint64_t n = j->counters ? j->base + (uint64_t)j->counters[i + k] : walk.n;
            uint64_t block = n >> 2;
            unsigned lane = (unsigned)(n & 3);
            if (block != cached) {
                w[0] = (uint32_t)block; w[1] = (uint32_t)(block >> 32); w[2] = 0; w[3] = 0;
                philox4x32_10(w, (uint32_t)j->seed, (uint32_t)(j->seed >> 32));
                cached = block;
            }
            unsigned p = lane >> 1;
            we_k[k] = w[2 * p];
            wo_k[k] = w[2 * p + 1];
            odd_k[k] = -(int32_t)(lane & 1);
            if (contiguous) walk.n += 1;
            else if (!j->counters) walk_next(&walk);
        }
        for (int64_t q = 0; q * WL < cnt; q += BMK) {
            vf radius[BMK], c[BMK], s[BMK];
            box_muller(we + q, wo + q, radius, c, s, BMK);
            EACH(BMK) {
                int64_t from = (q + k) * WL, left = cnt - from < WL ? cnt - from : WL;
                if (left <= 0) break;
                vf z = affine(radius[k] * v_select(odd[q + k], s[k], c[k]), std, mean, unit_std);
                __builtin_memcpy(j->out + i + from, &z, (size_t)left * sizeof(float));
            }
        }
        i += cnt;
    }
}

static void normal_range(const void *ctx, int64_t begin, int64_t end) {
    const njob_t *j = (const njob_t *)ctx;
    if (j->std == 1.0f) normal_range_op(j, begin, end, 1);
    else normal_range_op(j, begin, end, 0);
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
