/* The local engine's native CPU kernels, float32: paged decode attention reading the KV cache blocks in place
 * (no gather copy), rotary embedding applied to q and k in place, projections on weights packed in panels
 * (decode batches and small prefill chunks: at read bandwidth for a few rows, at the FMA units' rate for
 * dozens; the panels in float32 or in a GGUF file's own Q4_1 / Q8_0 blocks, dequantized on the fly to the same
 * float32 weights), the step's small ops in one pass each (RMSNorm with its residual add, silu-and-mul, the KV cache
 * write), and all of them for a decode step's whole decoder stack in one call (`unigate_decode_layers_f32`, at the
 * end: each kernel's body is an orphaned `omp for` or a per-thread range, run inside whichever parallel region
 * calls it).
 *
 * Built at run time by library.py with the machine's C compiler (-O3 -march=native -fopenmp) and called
 * through ctypes. AVX2 + FMA intrinsics, AVX-512 where the CPU has it (the projections and prefill attention: GCC
 * vector extensions of either width; decode attention: AVX-512 forms for head dims that are multiples of 64);
 * OpenMP over sequences or panels (the process's one OpenMP runtime: torch's).
 *
 * Layouts: q [B, H, D] with rows `q_stride` floats apart (a view into the fused qkv projection); out [B, H, D];
 * k_cache and v_cache [num_blocks, block_size, KVH, D], float32, or int8 with float32 scales k_scale / v_scale
 * [num_blocks, KVH] (an element reads as q * scale; null scales: a float32 cache; the write rule is
 * kernels/reference.py's, `unigate_store_kv_i8`); block_tables int32 [B, table_width]; context_lens int32
 * [B]. Head h attends with KV head h / (H / KVH). Per KV head of a sequence, the context is taken 512 keys at
 * a time in two passes: the scores of all its query heads (four keys' dot products at a time, each K row read
 * prefetching the same row of the block two ahead), one online-softmax update per head over the whole chunk
 * (running max and sum in float32), then the weighted sum of the chunk's values with 64 lanes of accumulators
 * per head in registers across blocks (with AVX-512, up to four heads at once, each value row loaded once for
 * all of them). A sequence with context_len 0 gets zeros.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64
#define PREFETCH_BLOCKS_AHEAD 2

/* The widest float vector of this CPU as a GCC vector type (the projections and prefill attention): 16 lanes with
   AVX-512, else 8 (AVX2). Loads and stores through it are unaligned (aligned(4)). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes_t __attribute__((vector_size(LANES * 4), aligned(4)));

static inline lanes_t lanes_load(const float *p) { return *(const lanes_t *)p; }
static inline void lanes_store(float *p, lanes_t v) { *(lanes_t *)p = v; }

int64_t unigate_vector_lanes(void) { return LANES; }

int unigate_cpu_kernels_limits(int64_t *heads, int64_t *group, int64_t *head_dim, int64_t *block_size) {
    *heads = MAX_HEADS;
    *group = MAX_GROUP;
    *head_dim = MAX_HEAD_DIM;
    *block_size = MAX_BLOCK_SIZE;
    return 1;
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float hmax8(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The softmax's and silu's arithmetic at the CPU's full vector width (16 lanes with AVX-512, else 8). */
#ifdef __AVX512F__
typedef __m512 vec_t;
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_set1 _mm512_set1_ps
#define vec_zero _mm512_setzero_ps
#define vec_add _mm512_add_ps
#define vec_sub _mm512_sub_ps
#define vec_mul _mm512_mul_ps
#define vec_div _mm512_div_ps
#define vec_max _mm512_max_ps
#define vec_min _mm512_min_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_fnmadd _mm512_fnmadd_ps
#define vec_floor(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define vec_pow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23))
#define vec_sum _mm512_reduce_add_ps
#define vec_hmax _mm512_reduce_max_ps
#else
typedef __m256 vec_t;
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_set1 _mm256_set1_ps
#define vec_zero _mm256_setzero_ps
#define vec_add _mm256_add_ps
#define vec_sub _mm256_sub_ps
#define vec_mul _mm256_mul_ps
#define vec_div _mm256_div_ps
#define vec_max _mm256_max_ps
#define vec_min _mm256_min_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_fnmadd _mm256_fnmadd_ps
#define vec_floor _mm256_floor_ps
#define vec_pow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23))
#define vec_sum hsum8
#define vec_hmax hmax8
#endif

/* exp(x) for x <= 0 (scores minus their running max): Cephes' single-precision polynomial on x = n ln2 + r,
   relative error about 2e-7; inputs below -87 (weights under 1e-38) are clamped. */
static inline vec_t vec_exp(vec_t x) {
    x = vec_max(x, vec_set1(-87.0f));
    const vec_t fx = vec_floor(vec_fmadd(x, vec_set1(1.44269504088896341f), vec_set1(0.5f)));
    x = vec_fnmadd(fx, vec_set1(0.693359375f), x);
    x = vec_fnmadd(fx, vec_set1(-2.12194440e-4f), x);
    const vec_t z = vec_mul(x, x);
    vec_t y = vec_set1(1.9875691500e-4f);
    y = vec_fmadd(y, x, vec_set1(1.3981999507e-3f));
    y = vec_fmadd(y, x, vec_set1(8.3334519073e-3f));
    y = vec_fmadd(y, x, vec_set1(4.1665795894e-2f));
    y = vec_fmadd(y, x, vec_set1(1.6666665459e-1f));
    y = vec_fmadd(y, x, vec_set1(5.0000001201e-1f));
    y = vec_add(vec_fmadd(y, z, x), vec_set1(1.0f));
    return vec_mul(y, vec_pow2(fx));
}

/* Online softmax over n scores of a head (a chunk of keys): p = exp(s - new max) in place; returns the new max and
   adds the chunk's sum to *sum after scaling the old one (and, via *alpha, the caller's accumulator). */
static inline float block_softmax(float *p, int64_t n, float running_max, float *running_sum, float *alpha) {
    int64_t t = 0;
    vec_t vmax = vec_set1(running_max);
    for (; t + LANES <= n; t += LANES) vmax = vec_max(vmax, vec_load(p + t));
    float new_max = vec_hmax(vmax);
    for (; t < n; t++) new_max = p[t] > new_max ? p[t] : new_max;
    const vec_t shift = vec_set1(new_max);
    vec_t vsum = vec_zero();
    for (t = 0; t + LANES <= n; t += LANES) {
        const vec_t e = vec_exp(vec_sub(vec_load(p + t), shift));
        vec_store(p + t, e);
        vsum = vec_add(vsum, e);
    }
    float sum = vec_sum(vsum);
    for (; t < n; t++) {
        p[t] = expf(p[t] - new_max);
        sum += p[t];
    }
    *alpha = expf(running_max - new_max);
    *running_sum = *running_sum * *alpha + sum;
    return new_max;
}

static inline void prefetch(const float *p, int64_t num_floats) {
    const char *c = (const char *)p;
    for (int64_t offset = 0; offset < num_floats * 4; offset += 64) _mm_prefetch(c + offset, _MM_HINT_T0);
}

/* The KV cache's elements: float32, or int8 (`i8`, a compile-time constant wherever these are inlined) that read as
   q * scale with a float32 scale per (block, KV head). Offsets below count elements, whatever their size. */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t elements, const int i8) {
    return (const char *)base + elements * (i8 ? 1 : 4);
}

static inline __attribute__((always_inline)) vec_t kv_load(const void *base, int64_t elements, const int i8) {
    if (!i8) return vec_load((const float *)base + elements);
    const int8_t *p = (const int8_t *)base + elements;
#ifdef __AVX512F__
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

static inline __attribute__((always_inline)) void kv_prefetch(const void *p, int64_t elements, const int i8) {
    const char *c = (const char *)p;
    for (int64_t offset = 0; offset < elements * (i8 ? 1 : 4); offset += 64) _mm_prefetch(c + offset, _MM_HINT_T0);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)]: four accumulators' lanes summed by one shuffle tree */
static inline __m128 vec_sum4(vec_t a0, vec_t a1, vec_t a2, vec_t a3) {
#ifdef __AVX512F__
    /* t0: a0's 8 partial sums (lanes 0-7) and a1's (8-15); t1 likewise for a2 and a3 */
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
    /* u: four partial sums each of a0, a1, a2 and a3, one 128-bit lane apiece; then each lane's total */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    const __m512 w = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w));
#else
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
#endif
}

/* out[t] = q . k_t for the n keys of one block (rows `stride` floats apart), four keys at a time. With `ahead`
   (the same rows of a later block), each row read here prefetches its counterpart there: a steady stream of
   prefetches alongside the arithmetic rather than a burst that stalls on the miss buffers. */
static inline __attribute__((always_inline)) void block_scores(const float *q, const void *k, int64_t stride,
                                                               int64_t n, int64_t dim, float *out, const void *ahead,
                                                               const int i8) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const int64_t k0 = t * stride, k1 = k0 + stride, k2 = k1 + stride, k3 = k2 + stride;
        if (ahead)
            for (int64_t r = t; r < t + 4; r++) kv_prefetch(kv_at(ahead, r * stride, i8), dim, i8);
        vec_t a0 = vec_zero(), a1 = vec_zero(), a2 = vec_zero(), a3 = vec_zero();
        for (int64_t d = 0; d < dim; d += LANES) {
            const vec_t qd = vec_load(q + d);
            a0 = vec_fmadd(qd, kv_load(k, k0 + d, i8), a0);
            a1 = vec_fmadd(qd, kv_load(k, k1 + d, i8), a1);
            a2 = vec_fmadd(qd, kv_load(k, k2 + d, i8), a2);
            a3 = vec_fmadd(qd, kv_load(k, k3 + d, i8), a3);
        }
        _mm_storeu_ps(out + t, vec_sum4(a0, a1, a2, a3));
    }
    for (; t < n; t++) {
        vec_t a = vec_zero();
        for (int64_t d = 0; d < dim; d += LANES) a = vec_fmadd(vec_load(q + d), kv_load(k, t * stride + d, i8), a);
        out[t] = vec_sum(a);
    }
}

/* Scores of up to this many keys per query head are held at once (a multiple of every allowed block size). */
#define SCORE_CHUNK 512

/* The rows of KV head `offset` in the block PREFETCH_BLOCKS_AHEAD after block `index`, or 0 past the context. */
static inline __attribute__((always_inline)) const void *block_ahead(const void *cache, const int32_t *table,
                                                                     int64_t index, int64_t num_blocks,
                                                                     int64_t block_floats, int64_t offset,
                                                                     const int i8) {
    const int64_t later = index + PREFETCH_BLOCKS_AHEAD;
    return later < num_blocks ? kv_at(cache, table[later] * block_floats + offset, i8) : 0;
}

/* Query heads of a group whose values are summed together (each value row loaded once for all of them): as many
   as leave their accumulators (64 lanes per head) in registers, four with AVX-512's 32 registers, one with AVX2's
   16. */
#ifdef __AVX512F__
#define DECODE_HEADS 4
#else
#define DECODE_HEADS 1
#endif
#define DECODE_VECS (64 / LANES) /* vectors per 64 lanes of a head */

/* acc[g][0 : vecs * LANES] += sum_t p_g[t] * v_t[d0 : ...] for `heads` query heads (acc rows `dim` floats apart,
   score rows SCORE_CHUNK apart) over the chunk's n keys, the accumulators in registers across its blocks. */
static inline __attribute__((always_inline)) void chunk_values(const int heads, const int vecs, float *acc,
                                                               int64_t dim, const float *p, const void *v_cache,
                                                               const int32_t *table, int64_t first_block,
                                                               int64_t n, int64_t block_size, int64_t block_floats,
                                                               int64_t offset, int64_t stride, int64_t total_blocks,
                                                               int prefetch_v, const float *v_scale,
                                                               int64_t num_kv_heads, const int i8) {
    vec_t c[DECODE_HEADS][DECODE_VECS];
    for (int g = 0; g < heads; g++)
        for (int j = 0; j < vecs; j++) c[g][j] = vec_load(acc + g * dim + j * LANES);
    for (int64_t b = 0; b * block_size < n; b++) {
        const int64_t index = first_block + b, nb = n - b * block_size < block_size ? n - b * block_size : block_size;
        const void *vb = kv_at(v_cache, table[index] * block_floats + offset, i8);
        const void *ahead =
            prefetch_v ? block_ahead(v_cache, table, index, total_blocks, block_floats, offset, i8) : 0;
        const float *pb = p + b * block_size;
        const float vs = i8 ? v_scale[table[index] * num_kv_heads] : 1.0f; /* v_scale: this KV head's column */
        for (int64_t t = 0; t < nb; t++) {
            if (ahead) kv_prefetch(kv_at(ahead, t * stride, i8), vecs * LANES, i8);
            vec_t v[DECODE_VECS];
            for (int j = 0; j < vecs; j++) v[j] = kv_load(vb, t * stride + j * LANES, i8);
            for (int g = 0; g < heads; g++) {
                const vec_t pt = vec_set1(i8 ? pb[g * SCORE_CHUNK + t] * vs : pb[g * SCORE_CHUNK + t]);
                for (int j = 0; j < vecs; j++) c[g][j] = vec_fmadd(pt, v[j], c[g][j]);
            }
        }
    }
    for (int g = 0; g < heads; g++)
        for (int j = 0; j < vecs; j++) vec_store(acc + g * dim + j * LANES, c[g][j]);
}

#define CHUNK_VALUES(h, v)                                                                                     \
    case v:                                                                                                    \
        chunk_values(h, v, acc + g0 * dim + d0, dim, scores + g0 * SCORE_CHUNK, v_cache, table, first_block, n, \
                     block_size, block_floats, kh * dim + d0, token_stride, total_blocks, g0 == 0 && d0 == 0,   \
                     v_scale ? v_scale + kh : 0, num_kv_heads, i8);                                             \
        break;
#if DECODE_VECS == 4
#define CHUNK_VALUES_HEADS(h) \
    case h:                   \
        switch (vecs) { CHUNK_VALUES(h, 1) CHUNK_VALUES(h, 2) CHUNK_VALUES(h, 3) CHUNK_VALUES(h, 4) } break;
#else
#define CHUNK_VALUES_HEADS(h)                                                                                  \
    case h:                                                                                                    \
        switch (vecs) {                                                                                        \
            CHUNK_VALUES(h, 1) CHUNK_VALUES(h, 2) CHUNK_VALUES(h, 3) CHUNK_VALUES(h, 4) CHUNK_VALUES(h, 5)     \
            CHUNK_VALUES(h, 6) CHUNK_VALUES(h, 7) CHUNK_VALUES(h, 8)                                           \
        }                                                                                                      \
        break;
#endif

/* KV heads [kh_first, kh_last) of one sequence (q and out point at the sequence's first head). Per KV head, the
   context is taken SCORE_CHUNK keys at a time in two passes: the scores of all its query heads over the chunk,
   one softmax update per head over the whole chunk, then the weighted sum of the chunk's values with the
   accumulators of DECODE_HEADS query heads in registers across the chunk's blocks. */
static inline __attribute__((always_inline)) void decode_one(const float *q, const void *k_cache, const void *v_cache,
                                                             const float *k_scale, const float *v_scale,
                                                             const int32_t *table, int64_t context_len, float *out,
                                                             int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                                             int64_t block_size, float scale, int64_t kh_first,
                                                             int64_t kh_last, const int i8) {
    const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * dim;
    const int64_t block_floats = block_size * token_stride;
    const int64_t total_blocks = (context_len + block_size - 1) / block_size;
    float qs[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], scores[MAX_GROUP * SCORE_CHUNK];
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int64_t kh = kh_first; kh < kh_last; kh++) {
        for (int64_t i = 0; i < group * dim; i++) {
            qs[i] = q[kh * group * dim + i] * scale;
            acc[i] = 0.0f;
        }
        for (int64_t g = 0; g < group; g++) {
            running_max[g] = -INFINITY;
            running_sum[g] = 0.0f;
        }
        for (int64_t chunk = 0; chunk < context_len; chunk += SCORE_CHUNK) {
            const int64_t n = context_len - chunk < SCORE_CHUNK ? context_len - chunk : SCORE_CHUNK;
            const int64_t first_block = chunk / block_size, num_blocks = (n + block_size - 1) / block_size;
            for (int64_t b = 0; b < num_blocks; b++) {
                const int64_t index = first_block + b, nb = n - b * block_size < block_size ? n - b * block_size : block_size;
                const void *kb = kv_at(k_cache, table[index] * block_floats + kh * dim, i8);
                const void *k_ahead = block_ahead(k_cache, table, index, total_blocks, block_floats, kh * dim, i8);
                for (int64_t g = 0; g < group; g++) {
                    float *sc = scores + g * SCORE_CHUNK + b * block_size;
                    block_scores(qs + g * dim, kb, token_stride, nb, dim, sc, g == 0 ? k_ahead : 0, i8);
                    if (i8) { /* the block's K scale: scores of int8 keys times it */
                        const float ks = k_scale[table[index] * num_kv_heads + kh];
                        for (int64_t t = 0; t < nb; t++) sc[t] *= ks;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float alpha, *p = scores + g * SCORE_CHUNK;
                running_max[g] = block_softmax(p, n, running_max[g], &running_sum[g], &alpha);
                if (alpha != 1.0f)
                    for (int64_t d = 0; d < dim; d++) acc[g * dim + d] *= alpha;
            }
            for (int64_t g0 = 0; g0 < group; g0 += DECODE_HEADS)
                for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                    const int vecs = (int)((dim - d0 < 64 ? dim - d0 : 64) / LANES);
                    switch (group - g0 < DECODE_HEADS ? (int)(group - g0) : DECODE_HEADS) {
                        CHUNK_VALUES_HEADS(1)
#if DECODE_HEADS > 1
                        CHUNK_VALUES_HEADS(2) CHUNK_VALUES_HEADS(3) CHUNK_VALUES_HEADS(4)
#endif
                        default: break;
                    }
                }
        }
        for (int64_t g = 0; g < group; g++) {
            const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
            for (int64_t d = 0; d < dim; d++) out[(kh * group + g) * dim + d] = acc[g * dim + d] * inv;
        }
    }
}

/* The decode tasks of one call, shared out among the threads of the enclosing parallel region (an orphaned
   `omp for`: the exported kernel below opens the region; the fused decoder calls it inside its own). */
static void decode_seq_f32(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                           int64_t context_len, float *out, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                           int64_t block_size, float scale, int64_t kh_first, int64_t kh_last) {
    decode_one(q, k_cache, v_cache, 0, 0, table, context_len, out, num_heads, num_kv_heads, dim, block_size, scale,
               kh_first, kh_last, 0);
}

static void decode_seq_i8(const float *q, const void *k_cache, const void *v_cache, const float *k_scale,
                          const float *v_scale, const int32_t *table, int64_t context_len, float *out,
                          int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale,
                          int64_t kh_first, int64_t kh_last) {
    decode_one(q, k_cache, v_cache, k_scale, v_scale, table, context_len, out, num_heads, num_kv_heads, dim,
               block_size, scale, kh_first, kh_last, 1);
}

/* k_scale / v_scale: null for a float32 cache, else the int8 cache's scales [num_blocks, KVH]. */
static void decode_tasks(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const float *k_scale, const float *v_scale, const int32_t *block_tables,
                         const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t table_width,
                         float scale) {
    /* Whole sequences per task when there are enough of them to keep every thread busy; else one task per
       (sequence, KV head), so batch 1 uses every thread too. */
    const int64_t split_heads = num_seqs < 2 * omp_get_num_threads() ? num_kv_heads : 1;
    const int64_t heads_per_task = num_kv_heads / split_heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * split_heads; task++) {
        const int64_t b = task / split_heads, kh_first = (task % split_heads) * heads_per_task;
        if (k_scale)
            decode_seq_i8(q + b * q_stride, k_cache, v_cache, k_scale, v_scale, block_tables + b * table_width,
                          context_lens[b], out + b * num_heads * head_dim, num_heads, num_kv_heads, head_dim,
                          block_size, scale, kh_first, kh_first + heads_per_task);
        else
            decode_seq_f32(q + b * q_stride, k_cache, v_cache, block_tables + b * table_width, context_lens[b],
                           out + b * num_heads * head_dim, num_heads, num_kv_heads, head_dim, block_size, scale,
                           kh_first, kh_first + heads_per_task);
    }
}

void unigate_paged_decode_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *context_lens, float *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              int64_t table_width, float scale, const float *k_scale, const float *v_scale) {
#pragma omp parallel
    decode_tasks(q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out, num_seqs, num_heads,
                 num_kv_heads, head_dim, block_size, table_width, scale);
}

/* Paged prefill attention, causal: sequence s has q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s] query tokens, the
 * last q_len of its context_lens[s] (their K and V already in the cache); its token i attends keys
 * [0, context_len - q_len + i]. q [T, H, D] (token rows q_stride floats apart), out [T, H, D].
 *
 * Flash-attention style, on the CPU. First, per (sequence, KV head), the context's keys are copied transposed
 * ([D][keys], LANES keys per vector) and its value rows' addresses noted, once for all the tasks that read them
 * (copied per task, the transposes took a quarter of the time). Then one task per (sequence, KV head,
 * PREFILL_TOKENS query tokens): the scores of a tile of up to PREFILL_ROWS query rows (token x query head of the
 * group) against PREFILL_KEYS keys are PREFILL_ROWS x 3 vector accumulators, one broadcast q value per row and
 * three K vectors per step along D: no horizontal sums, as in the projections' micro-kernel. Then, per row and
 * tile, an online-softmax update (keys past the row's causal limit left out) and the weighted sum of their value
 * rows into the row's output (kept in L1). The values are read in place from the cache blocks; the next tile's
 * query rows are prefetched (read cold, they stalled the tile's start). */
#ifdef __AVX512F__
#define PREFILL_ROWS 8
#else
#define PREFILL_ROWS 4
#endif
#define PREFILL_TOKENS 64
#define PREFILL_KEYS (3 * LANES) /* keys per score tile and online-softmax update */
#define PREFILL_VECS 4 /* value vectors per pass over a row's output */
#ifdef __AVX512F__
#define PREFILL_SHARE 3 /* rows with the same causal limit (heads of one token) that share each value row's loads */
#else
#define PREFILL_SHARE 2
#endif

static inline __attribute__((always_inline)) void prefill_scores(const int rows, const float *qs, const float *kt,
                                                                 int64_t kpad, int64_t dim, float *sc) {
    lanes_t acc[PREFILL_ROWS][3];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = acc[r][2] = (lanes_t){0};
    for (int64_t d = 0; d < dim; d++) {
        const float *kd = kt + d * kpad;
        const lanes_t k0 = lanes_load(kd), k1 = lanes_load(kd + LANES), k2 = lanes_load(kd + 2 * LANES);
        for (int r = 0; r < rows; r++) {
            const float a = qs[r * dim + d];
            acc[r][0] += a * k0;
            acc[r][1] += a * k1;
            acc[r][2] += a * k2;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 3; j++) lanes_store(sc + r * PREFILL_KEYS + j * LANES, acc[r][j]);
}

/* o_i[0:vecs] = o_i * alpha_i + sum_t p_i[t] * v_t[d0 : d0 + vecs * LANES] over `valid` keys, for `rows` rows with
   the same causal limit (rows `dim` floats apart in o, PREFILL_KEYS in p): each value vector is loaded once. */
static inline __attribute__((always_inline)) void prefill_values(const int rows, const int vecs, float *o, int64_t dim,
                                                                 const float *alpha, const float *p, int64_t valid,
                                                                 const float *const *vrow, int64_t d0) {
    lanes_t c[PREFILL_SHARE][PREFILL_VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) c[r][v] = lanes_load(o + r * dim + v * LANES) * alpha[r];
    for (int64_t t = 0; t < valid; t++) {
        const float *vt = vrow[t] + d0;
        for (int v = 0; v < vecs; v++) {
            const lanes_t x = lanes_load(vt + v * LANES);
            for (int r = 0; r < rows; r++) c[r][v] += p[r * PREFILL_KEYS + t] * x;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) lanes_store(o + r * dim + v * LANES, c[r][v]);
}

#define PREFILL_VALUES(n, v) \
    case v: prefill_values(n, v, orow + d0, dim, alpha, p, valid, vrow, d0); break;
#define PREFILL_VALUES_ROWS(n)                                                                                \
    case n:                                                                                                   \
        switch (vecs) { PREFILL_VALUES(n, 1) PREFILL_VALUES(n, 2) PREFILL_VALUES(n, 3) PREFILL_VALUES(n, 4) } \
        break;

#define PREFILL_SCORES(n) case n: prefill_scores(n, qs, kt + j0, kpad, dim, sc); break;

/* Keys padded to whole score tiles. */
static inline int64_t prefill_kpad(int64_t num_keys) { return (num_keys + PREFILL_KEYS - 1) / PREFILL_KEYS * PREFILL_KEYS; }

/* The context's keys of KV head kh transposed into kt [dim][kpad] (zero past the context), and the addresses of
   its value rows in vrows [num_keys]: once per (sequence, KV head), shared by all its tasks. An int8 cache (scales
   given) is dequantized on the way: the keys into kt, the values into vt [num_keys][dim], which vrows then point
   into. */
static void prefill_keys(const void *k_cache, const void *v_cache, const float *k_scale, const float *v_scale,
                         const int32_t *table, int64_t num_keys, int64_t kh, int64_t num_kv_heads, int64_t dim,
                         int64_t block_size, float *kt, float *vt, const float **vrows) {
    const int64_t token_stride = num_kv_heads * dim, kpad = prefill_kpad(num_keys);
    for (int64_t j = 0; j < num_keys; j++) {
        const int64_t block = table[j / block_size];
        const int64_t offset = (block * block_size + j % block_size) * token_stride + kh * dim;
        if (k_scale) {
            const int8_t *row = (const int8_t *)k_cache + offset, *vrow = (const int8_t *)v_cache + offset;
            const float ks = k_scale[block * num_kv_heads + kh], vs = v_scale[block * num_kv_heads + kh];
            float *v = vt + j * dim;
            for (int64_t d = 0; d < dim; d++) {
                kt[d * kpad + j] = (float)row[d] * ks;
                v[d] = (float)vrow[d] * vs;
            }
            vrows[j] = v;
        } else {
            const float *row = (const float *)k_cache + offset;
            vrows[j] = (const float *)v_cache + offset;
            for (int64_t d = 0; d < dim; d++) kt[d * kpad + j] = row[d];
        }
    }
    for (int64_t d = 0; d < dim; d++)
        for (int64_t j = num_keys; j < kpad; j++) kt[d * kpad + j] = 0.0f;
}

static void prefill_task(const float *q, int64_t q_stride, const float *kt, const float *const *vrows,
                         int64_t context_len, int64_t q_len, int64_t first_token, int64_t num_tokens, int64_t kh,
                         float *out, int64_t num_heads, int64_t num_kv_heads, int64_t dim, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t past = context_len - q_len;  /* token i sees keys [0, past + i] */
    const int64_t kpad = prefill_kpad(context_len);
    float qs[PREFILL_ROWS * MAX_HEAD_DIM], o[PREFILL_ROWS * MAX_HEAD_DIM], sc[PREFILL_ROWS * PREFILL_KEYS];
    float running_max[PREFILL_ROWS], running_sum[PREFILL_ROWS];
    int64_t limit[PREFILL_ROWS];
    const int64_t num_rows = num_tokens * group;
    for (int64_t r0 = 0; r0 < num_rows; r0 += PREFILL_ROWS) {
        const int rows = (int)(num_rows - r0 < PREFILL_ROWS ? num_rows - r0 : PREFILL_ROWS);
        for (int64_t r = r0 + PREFILL_ROWS; r < r0 + 2 * PREFILL_ROWS && r < num_rows; r++)  /* the next tile's q */
            prefetch(q + (first_token + r / group) * q_stride + (kh * group + r % group) * dim, dim);
        for (int r = 0; r < rows; r++) {
            const int64_t i = first_token + (r0 + r) / group, h = kh * group + (r0 + r) % group;
            const float *qr = q + i * q_stride + h * dim;
            for (int64_t d = 0; d < dim; d++) {
                qs[r * dim + d] = qr[d] * scale;
                o[r * dim + d] = 0.0f;
            }
            limit[r] = past + i;
            running_max[r] = -INFINITY;
            running_sum[r] = 0.0f;
        }
        const int64_t keys = limit[rows - 1] + 1;  /* the tile's last row sees the most */
        for (int64_t j0 = 0; j0 < keys; j0 += PREFILL_KEYS) {
            const int64_t tile = keys - j0 < PREFILL_KEYS ? keys - j0 : PREFILL_KEYS;
            switch (rows) {
                PREFILL_SCORES(1) PREFILL_SCORES(2) PREFILL_SCORES(3) PREFILL_SCORES(4)
#if PREFILL_ROWS > 4
                PREFILL_SCORES(5) PREFILL_SCORES(6) PREFILL_SCORES(7) PREFILL_SCORES(8)
#endif
                default: break;
            }
            const float *const *vrow = vrows + j0;
            for (int r = 0; r < rows;) {
                int share = 1;
                while (share < PREFILL_SHARE && r + share < rows && limit[r + share] == limit[r]) share++;
                const int64_t valid = limit[r] - j0 + 1 < tile ? limit[r] - j0 + 1 : tile;
                if (valid > 0) {
                    float *p = sc + r * PREFILL_KEYS, *orow = o + r * dim, alpha[PREFILL_SHARE];
                    for (int i = 0; i < share; i++)
                        running_max[r + i] = block_softmax(p + i * PREFILL_KEYS, valid, running_max[r + i],
                                                           &running_sum[r + i], &alpha[i]);
                    for (int64_t d0 = 0; d0 < dim; d0 += PREFILL_VECS * LANES) {
                        const int vecs = (int)((dim - d0 < PREFILL_VECS * LANES ? dim - d0 : PREFILL_VECS * LANES) / LANES);
                        switch (share) {
                            PREFILL_VALUES_ROWS(1) PREFILL_VALUES_ROWS(2)
#if PREFILL_SHARE > 2
                            PREFILL_VALUES_ROWS(3)
#endif
                        default: break;
                        }
                    }
                }
                r += share;
            }
        }
        for (int r = 0; r < rows; r++) {
            const int64_t i = first_token + (r0 + r) / group, h = kh * group + (r0 + r) % group;
            const float inv = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
            for (int64_t d = 0; d < dim; d++) out[(i * num_heads + h) * dim + d] = o[r * dim + d] * inv;
        }
    }
}

int unigate_paged_prefill_f32(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, int64_t table_width, const int32_t *cu_seqlens_q,
                              const int32_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                              const float *k_scale, const float *v_scale) {
    /* tasks: (sequence, KV head, chunk of PREFILL_TOKENS tokens); first[s] = index of sequence s's first task;
       keys[s]: offset of sequence s's transposed keys (num_kv_heads x [dim][kpad] floats) and value addresses */
    int64_t *first = malloc(sizeof(int64_t) * (2 * num_seqs + 2));
    if (!first) return 1;
    int64_t *keys = first + num_seqs + 1;
    first[0] = keys[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        first[s + 1] = first[s] + (q_len + PREFILL_TOKENS - 1) / PREFILL_TOKENS * num_kv_heads;
        keys[s + 1] = keys[s] + num_kv_heads * prefill_kpad(context_lens[s]);
    }
    float *kt = malloc(sizeof(float) * (head_dim * keys[num_seqs] + 1));
    float *vt = k_scale ? malloc(sizeof(float) * (head_dim * keys[num_seqs] + 1)) : 0; /* int8: dequantized values */
    const float **vrows = malloc(sizeof(float *) * (keys[num_seqs] + 1));
    if (!kt || !vrows || (k_scale && !vt)) {
        free(kt);
        free(vt);
        free(vrows);
        free(first);
        return 1;
    }
    const int64_t total = first[num_seqs];
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < num_seqs * num_kv_heads; unit++) {
            const int64_t s = unit / num_kv_heads, kh = unit % num_kv_heads, kpad = prefill_kpad(context_lens[s]);
            if (cu_seqlens_q[s + 1] == cu_seqlens_q[s]) continue;  /* no new tokens: no task reads its keys */
            prefill_keys(k_cache, v_cache, k_scale, v_scale, block_tables + s * table_width, context_lens[s], kh,
                         num_kv_heads, head_dim, block_size, kt + (keys[s] + kh * kpad) * head_dim,
                         vt ? vt + (keys[s] + kh * kpad) * head_dim : 0, vrows + keys[s] + kh * kpad);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < total; it++) {
            const int64_t task = total - 1 - it;  /* a sequence's last chunks (the most keys) start first */
            int64_t s = 0;
            while (first[s + 1] <= task) s++;
            const int64_t local = task - first[s], chunk = local / num_kv_heads, kh = local % num_kv_heads;
            const int64_t start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - start;
            const int64_t first_token = chunk * PREFILL_TOKENS;
            const int64_t n = q_len - first_token < PREFILL_TOKENS ? q_len - first_token : PREFILL_TOKENS;
            const int64_t kpad = prefill_kpad(context_lens[s]);
            prefill_task(q + start * q_stride, q_stride, kt + (keys[s] + kh * kpad) * head_dim,
                         vrows + keys[s] + kh * kpad, context_lens[s], q_len, first_token, n, kh,
                         out + start * num_heads * head_dim, num_heads, num_kv_heads, head_dim, scale);
        }
    }
    free(kt);
    free(vt);
    free(vrows);
    free(first);
    return 0;  /* nonzero (above): the transposed keys could not be allocated (nothing is written) */
}

/* Rotary embedding in place, HF rotate_half style: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two
   halves of each head. q [T, num_heads, D] and k [T, num_kv_heads, D] with token rows q_stride / k_stride floats
   apart (views into the fused qkv output); cos_sin [max_positions, D] holds cos then sin of each position. */
static void rotate_heads(float *x, int64_t num_heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        float *x1 = x + h * dim, *x2 = x1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

static void rotary_rows(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
                        const float *cos_sin, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *cos = cos_sin + positions[t] * head_dim, *sin = cos + head_dim / 2;
        rotate_heads(q + t * q_stride, num_heads, head_dim, cos, sin);
        rotate_heads(k + t * k_stride, num_kv_heads, head_dim, cos, sin);
    }
}

void unigate_rotary_f32(float *q, int64_t q_stride, float *k, int64_t k_stride, const int64_t *positions,
                        const float *cos_sin, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim) {
#pragma omp parallel if (num_tokens * (num_heads + num_kv_heads) * head_dim > (1 << 16))
    rotary_rows(q, q_stride, k, k_stride, positions, cos_sin, num_tokens, num_heads, num_kv_heads, head_dim);
}

/* y[M, N] = x[M, K] W[N, K]^T (+ bias), W packed once at load time into panels of LINEAR_PANEL output features:
 * [ceil(N / LINEAR_PANEL), K, LINEAR_PANEL] (launch.pack_linear_weight; the last panel zero-padded).
 *
 * A BLAS-style micro-kernel: a tile of up to LINEAR_ROWS rows of x against one panel keeps ROWS x VECS vector
 * accumulators in registers; per step along K it loads the panel's next LINEAR_PANEL weights (contiguous) and
 * broadcasts one x value per row into them. A panel (K x LINEAR_PANEL floats, 110 KB at K = 576 with AVX-512)
 * stays in L2 while every row tile of x runs against it, and while it is used the thread prefetches its next
 * panel, spread evenly over the tiles' K steps (one to three lines a step), so the stream of the weight from
 * memory overlaps the arithmetic: at a few rows a projection runs at read bandwidth, at a few dozen at the
 * FMA units' rate. Each thread takes a contiguous range of panels. Each output is one float32 sum along K in
 * order (a BLAS kernel's order differs; both round to float32 at each step).
 *
 * Written with GCC vector extensions, so the same code is 16-lane AVX-512 where -march=native has it (3 vectors
 * x 8 rows: 24 of 32 registers) and 8-lane AVX2 otherwise (3 x 4: 12 of 16). */
#ifdef __AVX512F__
#define LINEAR_ROWS 8
#else
#define LINEAR_ROWS 4
#endif
#define LINEAR_VECS 3
#define LINEAR_LANES LANES
#define LINEAR_PANEL (LINEAR_VECS * LINEAR_LANES)

int64_t unigate_linear_panel_width(void) { return LINEAR_PANEL; }

static inline __attribute__((always_inline)) void linear_tile(const int rows, const float *x, int64_t ldx,
                                                              const float *panel, int64_t k_dim, float *y,
                                                              int64_t ldy, int cols, const float *bias,
                                                              const char *prefetch, int64_t prefetch_step,
                                                              int accumulate) {
    lanes_t acc[LINEAR_ROWS][LINEAR_VECS];
    for (int r = 0; r < rows; r++)  /* with `accumulate`, y holds whole panels' partial sums (cols = PANEL) */
        for (int j = 0; j < LINEAR_VECS; j++)
            acc[r][j] = accumulate ? *(const lanes_t *)(y + r * ldy + j * LINEAR_LANES) : (lanes_t){0};
    for (int64_t k = 0; k < k_dim; k++) {
        if (prefetch) {
            const char *line = prefetch + k * prefetch_step;
            _mm_prefetch(line, _MM_HINT_T0);
            if (prefetch_step > 64) _mm_prefetch(line + 64, _MM_HINT_T0);
            if (prefetch_step > 128) _mm_prefetch(line + 128, _MM_HINT_T0);
        }
        lanes_t w[LINEAR_VECS];
        for (int j = 0; j < LINEAR_VECS; j++) w[j] = *(const lanes_t *)(panel + k * LINEAR_PANEL + j * LINEAR_LANES);
        for (int r = 0; r < rows; r++) {
            const float a = x[r * ldx + k];
            for (int j = 0; j < LINEAR_VECS; j++) acc[r][j] += a * w[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        if (cols == LINEAR_PANEL && !bias) {  /* a whole panel: vector stores */
            for (int j = 0; j < LINEAR_VECS; j++) *(lanes_t *)(y + r * ldy + j * LINEAR_LANES) = acc[r][j];
            continue;
        }
        float out[LINEAR_PANEL];
        for (int j = 0; j < LINEAR_VECS; j++) *(lanes_t *)(out + j * LINEAR_LANES) = acc[r][j];
        for (int c = 0; c < cols; c++) y[r * ldy + c] = bias ? out[c] + bias[c] : out[c];
    }
}

/* Weight formats of the panels. F32: [K][PANEL] floats per panel. The others keep a GGUF checkpoint's own blocks
 * of 32 weights along K (launch.pack_block_weight reorders them into panels), dequantized on the fly to
 * exactly the float32 values the checkpoint dequantizes to (`gguf.quants`: Q4_1 w = d * q + m, Q8_0 w = d * q;
 * d * q is exact in float32 and the one rounding of the add is the same in an FMA), so the projection's result is
 * the F32 panels' bit for bit while a decode step streams 5-6x fewer bytes of weights. Per panel and block of 32:
 * Q4_1: d[PANEL], m[PANEL] as float32, then 16 rows of PANEL bytes, byte n of row i holding output n's weights
 *       2i (low nibble) and 2i + 1 (high nibble): 24 * PANEL bytes;
 * Q8_0: d[PANEL] as float32, then 32 rows of PANEL int8: 36 * PANEL bytes. */
#define WEIGHTS_F32 0
#define WEIGHTS_Q4_1 1
#define WEIGHTS_Q8_0 2

static int64_t panel_bytes(int format, int64_t k_dim) {
    switch (format) {
        case WEIGHTS_Q4_1: return k_dim / 32 * 24 * LINEAR_PANEL;
        case WEIGHTS_Q8_0: return k_dim / 32 * 36 * LINEAR_PANEL;
        default: return k_dim * LINEAR_PANEL * 4;
    }
}

#ifdef __AVX512F__
typedef __m512i ivec_t;
#define ivec_u8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define ivec_i8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define ivec_low4(x) _mm512_and_si512(x, _mm512_set1_epi32(15))
#define ivec_high4(x) _mm512_srli_epi32(x, 4)
#define ivec_float _mm512_cvtepi32_ps
#else
typedef __m256i ivec_t;
#define ivec_u8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define ivec_i8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define ivec_low4(x) _mm256_and_si256(x, _mm256_set1_epi32(15))
#define ivec_high4(x) _mm256_srli_epi32(x, 4)
#define ivec_float _mm256_cvtepi32_ps
#endif

/* LANES weights of one output row each from their block's scale d (and Q4_1's minimum m), by `gguf`'s arithmetic:
   Q4_1 w = d * q + m (q: the low or high nibbles of a byte row), Q8_0 w = d * q. Both dequantizing paths below
   use these, so they produce the same float32 weights. */
static inline vec_t q4_1_weights(ivec_t nibbles, vec_t d, vec_t m) { return vec_fmadd(ivec_float(nibbles), d, m); }
static inline vec_t q8_0_weights(const uint8_t *q, vec_t d) { return vec_mul(ivec_float(ivec_i8(q)), d); }

/* `k_dim` steps of K (a multiple of 32) of a block-format panel into float32 [k_dim][PANEL] (the F32 panel layout). */
static void dequantize_panel(int format, const uint8_t *src, int64_t k_dim, float *dst) {
    for (int64_t kb = 0; kb < k_dim / 32; kb++) {
        float *out = dst + kb * 32 * LINEAR_PANEL;
        if (format == WEIGHTS_Q4_1) {
            const float *d = (const float *)(src + kb * panel_bytes(format, 32)), *m = d + LINEAR_PANEL;
            const uint8_t *q = (const uint8_t *)(m + LINEAR_PANEL);
            for (int64_t j = 0; j < LINEAR_PANEL; j += LANES) {
                const vec_t dj = vec_load(d + j), mj = vec_load(m + j);
                for (int64_t i = 0; i < 16; i++) {
                    const ivec_t pair = ivec_u8(q + i * LINEAR_PANEL + j);
                    vec_store(out + (2 * i) * LINEAR_PANEL + j, q4_1_weights(ivec_low4(pair), dj, mj));
                    vec_store(out + (2 * i + 1) * LINEAR_PANEL + j, q4_1_weights(ivec_high4(pair), dj, mj));
                }
            }
        } else {
            const float *d = (const float *)(src + kb * panel_bytes(format, 32));
            const uint8_t *q = (const uint8_t *)(d + LINEAR_PANEL);
            for (int64_t j = 0; j < LINEAR_PANEL; j += LANES) {
                const vec_t dj = vec_load(d + j);
                for (int64_t i = 0; i < 32; i++)
                    vec_store(out + i * LINEAR_PANEL + j, q8_0_weights(q + i * LINEAR_PANEL + j, dj));
            }
        }
    }
}

/* Up to a few row tiles (decode batches of a few sequences), a block-format panel is dequantized in registers, a
   block of 32 steps of K at a time, straight into each tile's FMAs: at a few rows, the L1 chunk's stores and
   reloads cost more than the FMAs they feed. The same dequantization and the same FMAs per accumulator in the same
   order as dequantize_panel + linear_tile, so the result is the chunked path's bit for bit. */
#ifdef __AVX512F__
#define REGISTER_ROWS LINEAR_ROWS
#else
/* AVX2 has 16 vector registers: 4 rows x 3 accumulators, the 3 dequantized weight vectors and their scales spill
   (4 rows cost 1.6x 3 rows), so a tile holds 3 rows. */
#define REGISTER_ROWS 3
#endif
/* Up to this many rows (a decode batch, or a speculative verification of 1 + k rows) the register tiles run one
   after another over each panel, re-dequantizing it from L1 per tile, instead of going through the scratch chunk. */
#define REGISTER_MAX_ROWS (4 * REGISTER_ROWS)

static inline __attribute__((always_inline)) void block_tile(const int rows, const int format, const float *x,
                                                             int64_t ldx, const uint8_t *panel, int64_t k_dim,
                                                             float *y, int64_t ldy, int cols, const float *bias,
                                                             const char *next) {
    lanes_t acc[REGISTER_ROWS][LINEAR_VECS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < LINEAR_VECS; j++) acc[r][j] = (lanes_t){0};
    const int q4 = format == WEIGHTS_Q4_1, steps = q4 ? 16 : 32;  /* byte rows per block */
    const int64_t block_bytes = panel_bytes(format, 32), spacing = block_bytes / steps;
    for (int64_t kb = 0; kb < k_dim / 32; kb++) {
        const float *d = (const float *)(panel + kb * block_bytes), *xk = x + kb * 32;
        const uint8_t *q = (const uint8_t *)(d + (q4 ? 2 : 1) * LINEAR_PANEL);
        vec_t dj[LINEAR_VECS], mj[LINEAR_VECS];
        for (int j = 0; j < LINEAR_VECS; j++) {
            dj[j] = vec_load(d + j * LANES);
            mj[j] = q4 ? vec_load(d + LINEAR_PANEL + j * LANES) : vec_zero();
        }
        for (int i = 0; i < steps; i++) {
            if (next) {  /* the same block of the next panel, spread over the block's byte rows: every line once */
                const char *line = next + kb * block_bytes + i * spacing;
                _mm_prefetch(line, _MM_HINT_T0);
                _mm_prefetch(line + spacing - 1, _MM_HINT_T0);
            }
            if (q4) {
                lanes_t lo[LINEAR_VECS], hi[LINEAR_VECS];
                for (int j = 0; j < LINEAR_VECS; j++) {
                    const ivec_t pair = ivec_u8(q + i * LINEAR_PANEL + j * LANES);
                    lo[j] = (lanes_t)q4_1_weights(ivec_low4(pair), dj[j], mj[j]);
                    hi[j] = (lanes_t)q4_1_weights(ivec_high4(pair), dj[j], mj[j]);
                }
                for (int r = 0; r < rows; r++) {
                    const float a = xk[r * ldx + 2 * i], b = xk[r * ldx + 2 * i + 1];
                    for (int j = 0; j < LINEAR_VECS; j++) acc[r][j] += a * lo[j];
                    for (int j = 0; j < LINEAR_VECS; j++) acc[r][j] += b * hi[j];
                }
            } else {
                lanes_t w[LINEAR_VECS];
                for (int j = 0; j < LINEAR_VECS; j++)
                    w[j] = (lanes_t)q8_0_weights(q + i * LINEAR_PANEL + j * LANES, dj[j]);
                for (int r = 0; r < rows; r++) {
                    const float a = xk[r * ldx + i];
                    for (int j = 0; j < LINEAR_VECS; j++) acc[r][j] += a * w[j];
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float out[LINEAR_PANEL];
        for (int j = 0; j < LINEAR_VECS; j++) *(lanes_t *)(out + j * LINEAR_LANES) = acc[r][j];
        for (int c = 0; c < cols; c++) y[r * ldy + c] = bias ? out[c] + bias[c] : out[c];
    }
}

#define BLOCK_TILE(n, f) \
    case n: block_tile(n, f, xr, ldx, packed + p * bytes, k_dim, yr + p * LINEAR_PANEL, n_dim, cols_out, b, next); break;
#define BLOCK_TILES(f, rows)                                              \
    switch (rows) {                                                       \
        BLOCK_TILE(1, f) BLOCK_TILE(2, f) BLOCK_TILE(3, f) BLOCK_TILES_WIDE(f) \
        default: break;                                                   \
    }
#if REGISTER_ROWS > 4
#define BLOCK_TILES_WIDE(f) BLOCK_TILE(4, f) BLOCK_TILE(5, f) BLOCK_TILE(6, f) BLOCK_TILE(7, f) BLOCK_TILE(8, f)
#elif REGISTER_ROWS > 3
#define BLOCK_TILES_WIDE(f) BLOCK_TILE(4, f)
#else
#define BLOCK_TILES_WIDE(f)
#endif

/* This thread's scratch for block-format panels, grown to `floats` as needed and kept for the thread's life (a
   few dozen KiB: a dequantized chunk of a panel and the row tiles' partial sums). Null when it cannot be had. */
static float *panel_scratch(int64_t floats) {
    static __thread float *buffer;
    static __thread int64_t capacity;
    if (capacity < floats) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)(floats * 4 + 63) / 64 * 64);
        capacity = buffer ? floats : 0;
    }
    return buffer;
}

/* K steps per dequantized chunk of a block-format panel: 64 x PANEL floats (12 KiB with AVX-512) stay in L1 while
   every row tile reads them. */
#define DEQUANT_K 128

#define LINEAR_TILE(n)                                                                                       \
    case n:                                                                                                  \
        linear_tile(n, xr, ldx, panel, kn, out + r * ldo, ldo, cols, b, next, step, accumulate); \
        break;

/* The panels of one projection, a contiguous range per thread of the enclosing parallel region (no barrier at
   the end: a caller that reads y next waits for the other threads itself). F32 panels are read in place, each
   row tile over the whole of K. Up to REGISTER_MAX_ROWS rows, a block-format panel is dequantized in registers
   by each tile of REGISTER_ROWS rows in turn (block_tile); beyond, DEQUANT_K steps of K at a time into this
   thread's scratch, every row tile running over that chunk with its partial sums kept in the scratch between chunks (float32 in memory: the sums are the same
   as in registers), then written out. Returns nonzero when the scratch could not be allocated (this thread's
   outputs are then not written). */
static int linear_panels(const float *x, int64_t ldx, int64_t m, const uint8_t *packed, int format, int64_t n_dim,
                         int64_t k_dim, const float *bias, float *y) {
    const int64_t panels = (n_dim + LINEAR_PANEL - 1) / LINEAR_PANEL, bytes = panel_bytes(format, k_dim);
    const int64_t tiles = (m + LINEAR_ROWS - 1) / LINEAR_ROWS;
    /* bytes of the next panel to prefetch per K step of each tile: the whole panel over all the tiles */
    const int64_t step = tiles ? (bytes / k_dim + tiles - 1) / tiles : 0;
    const int blocks = format != WEIGHTS_F32, in_registers = blocks && m <= REGISTER_MAX_ROWS;
    float *scratch = blocks && !in_registers ? panel_scratch((DEQUANT_K + tiles * LINEAR_ROWS) * LINEAR_PANEL) : 0;
    if (blocks && !in_registers && !scratch) return 1;
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / threads, last = panels * (t + 1) / threads;
    for (int64_t p = first; p < last; p++) {
        const int cols_out = n_dim - p * LINEAR_PANEL < LINEAR_PANEL ? (int)(n_dim - p * LINEAR_PANEL) : LINEAR_PANEL;
        if (in_registers) {
            const float *b = bias ? bias + p * LINEAR_PANEL : 0;
            for (int64_t r = 0; r < m; r += REGISTER_ROWS) {
                /* the first tile streams the panel in (and prefetches the next); later ones find it in L1 */
                const char *next = r == 0 && p + 1 < last ? (const char *)(packed + (p + 1) * bytes) : 0;
                const float *xr = x + r * ldx;
                float *yr = y + r * n_dim;
                const int rows = m - r < REGISTER_ROWS ? (int)(m - r) : REGISTER_ROWS;
                if (format == WEIGHTS_Q4_1) {
                    BLOCK_TILES(WEIGHTS_Q4_1, rows)
                } else {
                    BLOCK_TILES(WEIGHTS_Q8_0, rows)
                }
            }
            continue;
        }
        const float *b = blocks ? 0 : bias ? bias + p * LINEAR_PANEL : 0;
        const int cols = blocks ? LINEAR_PANEL : cols_out;
        float *out = blocks ? scratch + DEQUANT_K * LINEAR_PANEL : y + p * LINEAR_PANEL;
        const int64_t ldo = blocks ? LINEAR_PANEL : n_dim, chunk = blocks ? DEQUANT_K : k_dim;
        for (int64_t k0 = 0; k0 < k_dim; k0 += chunk) {
            const int64_t kn = k_dim - k0 < chunk ? k_dim - k0 : chunk;
            const float *panel = (const float *)(packed + p * bytes);
            if (blocks) {
                dequantize_panel(format, packed + p * bytes + panel_bytes(format, k0), kn, scratch);
                panel = scratch;
            }
            const int accumulate = k0 > 0;
            for (int64_t r = 0; r < m; r += LINEAR_ROWS) {
                const char *next =
                    p + 1 < last ? (const char *)(packed + (p + 1) * bytes) + (r / LINEAR_ROWS * k_dim + k0) * step : 0;
                const float *xr = x + r * ldx + k0;
                switch (m - r < LINEAR_ROWS ? (int)(m - r) : LINEAR_ROWS) {
                    LINEAR_TILE(1) LINEAR_TILE(2) LINEAR_TILE(3) LINEAR_TILE(4)
#if LINEAR_ROWS > 4
                    LINEAR_TILE(5) LINEAR_TILE(6) LINEAR_TILE(7) LINEAR_TILE(8)
#endif
                    default: break;
                }
            }
        }
        if (blocks)
            for (int64_t r = 0; r < m; r++)
                for (int c = 0; c < cols_out; c++)
                    y[r * n_dim + p * LINEAR_PANEL + c] =
                        bias ? out[r * LINEAR_PANEL + c] + bias[p * LINEAR_PANEL + c] : out[r * LINEAR_PANEL + c];
    }
    return 0;
}

/* Block-format panels back to the float32 weight [n_dim][k_dim] (row-major), by dequantize_panel's arithmetic, a
   block of 32 steps of K of one panel at a time through this thread's scratch: for calls with so many rows that a
   GEMM library on the float weight outruns dequantizing inside the kernel. Nonzero when a scratch could not be had. */
int unigate_unpack_blocks_f32(const uint8_t *packed, int format, int64_t n_dim, int64_t k_dim, float *out) {
    const int64_t panels = (n_dim + LINEAR_PANEL - 1) / LINEAR_PANEL, bytes = panel_bytes(format, k_dim);
    int failed = 0;
#pragma omp parallel for reduction(| : failed) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *chunk = panel_scratch(32 * LINEAR_PANEL);
        if (!chunk) {
            failed = 1;
            continue;
        }
        const int cols = n_dim - p * LINEAR_PANEL < LINEAR_PANEL ? (int)(n_dim - p * LINEAR_PANEL) : LINEAR_PANEL;
        for (int64_t kb = 0; kb < k_dim / 32; kb++) {
            dequantize_panel(format, packed + p * bytes + panel_bytes(format, kb * 32), 32, chunk);
            for (int c = 0; c < cols; c++) {
                float *row = out + (p * LINEAR_PANEL + c) * k_dim + kb * 32;
                for (int i = 0; i < 32; i++) row[i] = chunk[i * LINEAR_PANEL + c];
            }
        }
    }
    return failed;
}

int unigate_linear_f32(const float *x, int64_t ldx, int64_t m, const uint8_t *packed, int format, int64_t n_dim,
                       int64_t k_dim, const float *bias, float *y) {
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    failed |= linear_panels(x, ldx, m, packed, format, n_dim, k_dim, bias, y);
    return failed;
}

/* RMSNorm over rows of `dim` floats, HF's math in float32: out = x * rsqrt(mean(x^2) + eps) * weight. With
 * `residual`, x + residual is normalised and also written back to `residual` (the running sum between layers);
 * `out` may be `x` (in place). Rows are `x_stride` / `out_stride` floats apart (residual rows are contiguous).
 * The sum of squares runs in 8 lanes, then a horizontal add. */
static inline void norm_row(float *xr, float *res, const float *weight, float *o, int64_t dim, float eps) {
    __m256 squares = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        __m256 v = _mm256_loadu_ps(xr + d);
        if (res) {
            v = _mm256_add_ps(v, _mm256_loadu_ps(res + d));
            _mm256_storeu_ps(res + d, v);
        }
        squares = _mm256_fmadd_ps(v, v, squares);
    }
    float sum = hsum8(squares);
    for (; d < dim; d++) {
        const float v = res ? (res[d] += xr[d]) : xr[d];
        sum += v * v;
    }
    const float *src = res ? res : xr;
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (d = 0; d + 8 <= dim; d += 8)
        _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(weight + d), _mm256_mul_ps(_mm256_loadu_ps(src + d), vinv)));
    for (; d < dim; d++) o[d] = weight[d] * (src[d] * inv);
}

static void rms_norm_rows(float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                          int64_t out_stride, int64_t num_rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < num_rows; row++)
        norm_row(x + row * x_stride, residual ? residual + row * dim : 0, weight, out + row * out_stride, dim, eps);
}

void unigate_rms_norm_f32(float *x, int64_t x_stride, float *residual, const float *weight, float *out,
                          int64_t out_stride, int64_t num_rows, int64_t dim, float eps) {
#pragma omp parallel if (num_rows * dim > (1 << 15))
    rms_norm_rows(x, x_stride, residual, weight, out, out_stride, num_rows, dim, eps);
}

/* silu(gate) * up over the two halves of each row of x [T, 2 * inter] (the fused gate/up projection), written
 * over the gate half: silu(g) = g / (1 + exp(-g)), exp by the same polynomial as the softmax (inputs clamped
 * to [-87, 88], where float32 exp neither underflows nor overflows). */
static void silu_and_mul_rows(float *x, int64_t x_stride, int64_t num_rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < num_rows; row++) {
        float *gate = x + row * x_stride;
        const float *up = gate + inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const vec_t g = vec_load(gate + i);
            const vec_t e = vec_exp(vec_min(vec_sub(vec_zero(), g), vec_set1(88.0f)));
            vec_store(gate + i, vec_mul(vec_div(g, vec_add(vec_set1(1.0f), e)), vec_load(up + i)));
        }
        for (; i < inter; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

void unigate_silu_and_mul_f32(float *x, int64_t x_stride, int64_t num_rows, int64_t inter) {
#pragma omp parallel if (num_rows * inter > (1 << 15))
    silu_and_mul_rows(x, x_stride, num_rows, inter);
}

/* k, v [T, KVH * D] rows (token rows `k_stride` / `v_stride` floats apart: views into the fused qkv output)
 * into their cache slots [num_slots, KVH * D]; slot -1 skips the token. */
void unigate_store_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                          float *v_cache, const int64_t *slots, int64_t num_tokens, int64_t row) {
#pragma omp parallel for schedule(static) if (num_tokens * row > (1 << 16))
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row, k + t * k_stride, row * sizeof(float));
        memcpy(v_cache + slot * row, v + t * v_stride, row * sizeof(float));
    }
}

/* int8 KV cache write, by the rule of kernels/reference.py: tokens in runs (consecutive tokens whose slots share a
 * block; slot -1 skipped), per run and KV head one scale = max(the block's scale, or 0 when the run writes offset
 * 0; the run's max |x| / 127); when it grew, the block's entries below the run's first offset are requantized
 * (round(q * old / new)); the run's tokens stored as round(x / scale), half to even, clamped to [-127, 127]. The same
 * float32 operations in the same order as the torch code, so the bytes are the same. One head of K or V per call:
 * x rows `x_stride` floats apart, cache [num_blocks, block_size, KVH, dim] int8, scales [num_blocks, KVH]. */
static inline void quantize_row(const float *x, float mul, int8_t *out, int64_t dim) {
    for (int64_t d = 0; d < dim; d++) {
        const float r = nearbyintf(x[d] * mul);
        out[d] = (int8_t)(r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r);
    }
}

static void store_head_i8(const float *x, int64_t x_stride, int8_t *cache, float *scales, const int64_t *slots,
                          int64_t num_tokens, int64_t num_kv_heads, int64_t dim, int64_t block_size, int64_t h) {
    const int64_t row = num_kv_heads * dim;
    float requantized[MAX_HEAD_DIM];
    for (int64_t t = 0; t < num_tokens;) {
        if (slots[t] < 0) {
            t++;
            continue;
        }
        const int64_t block = slots[t] / block_size;
        int64_t end = t, first = block_size;
        float amax = 0.0f;
        for (; end < num_tokens && slots[end] >= 0 && slots[end] / block_size == block; end++) {
            const int64_t offset = slots[end] % block_size;
            first = offset < first ? offset : first;
            const float *xr = x + end * x_stride + h * dim;
            for (int64_t d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(xr[d]));
        }
        float *scale_at = scales + block * num_kv_heads + h;
        const float base = first == 0 ? 0.0f : *scale_at, scale = fmaxf(base, amax / 127.0f);
        const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        int8_t *b = cache + block * block_size * row + h * dim;
        if (first > 0 && base > 0.0f && scale > base) {
            const float ratio = base * inv;
            for (int64_t o = 0; o < first; o++) {
                for (int64_t d = 0; d < dim; d++) requantized[d] = (float)b[o * row + d];
                quantize_row(requantized, ratio, b + o * row, dim);
            }
        }
        for (int64_t i = t; i < end; i++) quantize_row(x + i * x_stride + h * dim, inv, b + slots[i] % block_size * row, dim);
        *scale_at = scale;
        t = end;
    }
}

/* K and V of every KV head, one (K or V, head) per task of the enclosing parallel region's threads. */
static void store_kv_i8_tasks(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int8_t *k_cache,
                              int8_t *v_cache, float *k_scale, float *v_scale, const int64_t *slots,
                              int64_t num_tokens, int64_t num_kv_heads, int64_t dim, int64_t block_size) {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < 2 * num_kv_heads; task++) {
        const int is_v = task >= num_kv_heads;
        store_head_i8(is_v ? v : k, is_v ? v_stride : k_stride, is_v ? v_cache : k_cache, is_v ? v_scale : k_scale,
                      slots, num_tokens, num_kv_heads, dim, block_size, task % num_kv_heads);
    }
}

void unigate_store_kv_i8(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int8_t *k_cache,
                         int8_t *v_cache, float *k_scale, float *v_scale, const int64_t *slots, int64_t num_tokens,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
#pragma omp parallel if (num_tokens * num_kv_heads * head_dim > (1 << 14))
    store_kv_i8_tasks(k, k_stride, v, v_stride, k_cache, v_cache, k_scale, v_scale, slots, num_tokens, num_kv_heads,
                      head_dim, block_size);
}

/* The decoder stack of a Llama-family model for one decode step, in one call and one parallel region: per layer,
 * RMSNorm (with the residual add) -> qkv projection -> per-head q/k RMSNorm (Qwen3) and rotary -> KV cache write
 * -> paged decode attention -> o projection -> RMSNorm -> gate/up projection -> silu-and-mul -> down projection;
 * then the final RMSNorm. The same kernels as the per-op calls above, in the same order, so the result equals the
 * model's op-by-op forward bit for bit; what goes is the per-op cost between them (a Python call, argument
 * checks, a new output tensor and an OpenMP fork/join for each of ~10 ops per layer), which at decode sizes is a
 * large share of a step. Threads wait for each other only where the next phase reads what the last one wrote.
 *
 * Weights: each projection in the panel layout of `unigate_linear_f32` (biases optional, per layer), norms'
 * weights as rows. `res` holds the step's token embeddings [B, hidden] on entry and the residual stream after;
 * `out` [B, hidden] gets the final normalised hidden states. `scratch` holds B x (hidden + qkv + H*D + hidden +
 * 2 * inter) floats. Positions, slots, block tables and context lengths as in the per-op kernels. */
typedef struct {
    int64_t num_layers, hidden, inter, num_heads, num_kv_heads, head_dim, block_size;
    int64_t weight_format; /* of the four projections' panels: WEIGHTS_F32, _Q4_1 or _Q8_0 */
    float eps, scale;
    const float *const *input_norm, *const *post_norm, *const *q_norm, *const *k_norm;
    const uint8_t *const *qkv;
    const float *const *qkv_bias;
    const uint8_t *const *o;
    const float *const *o_bias;
    const uint8_t *const *gate_up, *const *down;
    void *const *k_cache, *const *v_cache; /* float32, or int8 with the scales below */
    float *const *k_scale, *const *v_scale; /* int8 KV cache: per layer [num_blocks, KVH]; null: float32 */
    const float *final_norm, *cos_sin;
} unigate_decoder_t;

int unigate_decode_layers_f32(const unigate_decoder_t *m, int64_t num_rows, float *res, float *out,
                              const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                              const int32_t *context_lens, int64_t table_width, float *scratch) {
    const int format = (int)m->weight_format;
    int failed = 0;
    const int64_t hidden = m->hidden, dim = m->head_dim, heads = m->num_heads, kv_heads = m->num_kv_heads;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, qkv_size = q_size + 2 * kv_size;
    float *normed = scratch, *qkv = normed + num_rows * hidden, *attn = qkv + num_rows * qkv_size;
    float *sub = attn + num_rows * q_size, *gate_up = sub + num_rows * hidden;
#pragma omp parallel reduction(| : failed)
    {
        for (int64_t l = 0; l < m->num_layers; l++) {
            /* the first layer normalises the embeddings; later ones add the last sublayer's output first */
            rms_norm_rows(l ? sub : res, hidden, l ? res : 0, m->input_norm[l], normed, hidden, num_rows, hidden,
                          m->eps);
            failed |= linear_panels(normed, hidden, num_rows, m->qkv[l], format, qkv_size, hidden,
                                    m->qkv_bias ? m->qkv_bias[l] : 0, qkv);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t t = 0; t < num_rows; t++) {
                float *q = qkv + t * qkv_size, *k = q + q_size;
                if (m->q_norm) {
                    /* one row per head, by the per-op kernel's loop (no other thread touches this token) */
                    for (int64_t h = 0; h < heads; h++) {
                        float *row = q + h * dim;
                        norm_row(row, 0, m->q_norm[l], row, dim, m->eps);
                    }
                    for (int64_t h = 0; h < kv_heads; h++) {
                        float *row = k + h * dim;
                        norm_row(row, 0, m->k_norm[l], row, dim, m->eps);
                    }
                }
                const float *cos = m->cos_sin + positions[t] * dim, *sin = cos + dim / 2;
                rotate_heads(q, heads, dim, cos, sin);
                rotate_heads(k, kv_heads, dim, cos, sin);
                if (slots[t] >= 0 && !m->k_scale) {
                    memcpy((float *)m->k_cache[l] + slots[t] * kv_size, k, kv_size * sizeof(float));
                    memcpy((float *)m->v_cache[l] + slots[t] * kv_size, k + kv_size, kv_size * sizeof(float));
                }
            }
            if (m->k_scale) /* int8: rows of one sequence share blocks, so the write goes by (K or V, head) */
                store_kv_i8_tasks(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, m->k_cache[l],
                                  m->v_cache[l], m->k_scale[l], m->v_scale[l], slots, num_rows, kv_heads, dim,
                                  m->block_size);
            decode_tasks(qkv, qkv_size, m->k_cache[l], m->v_cache[l], m->k_scale ? m->k_scale[l] : 0,
                         m->v_scale ? m->v_scale[l] : 0, block_tables, context_lens, attn, num_rows, heads, kv_heads,
                         dim, m->block_size, table_width, m->scale);
            failed |= linear_panels(attn, q_size, num_rows, m->o[l], format, hidden, q_size,
                                    m->o_bias ? m->o_bias[l] : 0, sub);
#pragma omp barrier
            rms_norm_rows(sub, hidden, res, m->post_norm[l], normed, hidden, num_rows, hidden, m->eps);
            failed |= linear_panels(normed, hidden, num_rows, m->gate_up[l], format, 2 * m->inter, hidden, 0, gate_up);
#pragma omp barrier
            silu_and_mul_rows(gate_up, 2 * m->inter, num_rows, m->inter);
            failed |= linear_panels(gate_up, 2 * m->inter, num_rows, m->down[l], format, hidden, m->inter, 0, sub);
#pragma omp barrier
        }
        rms_norm_rows(sub, hidden, res, m->final_norm, out, hidden, num_rows, hidden, m->eps);
    }
    return failed; /* nonzero: a thread could not allocate its dequantized panel (the outputs are not valid) */
}
